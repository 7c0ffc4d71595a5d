"""Latency of one forward pass of a rollout group: decode / verify, draft levels, overhead.

Vocabulary (per forward pass of one group):
- rows: active sequences; query_tokens: tokens computed this pass, summed over rows (1 per row
  for plain decode, 1 + verify_tokens per row for a verify pass, the prompt for prefill);
- kv_tokens: cached context tokens read, summed over rows;
- a draft *level*: one drafter forward over rows x topk tokens; a draft of depth d is d levels.

Two models with one protocol. `Roofline`: time = max(bytes / bandwidth, FLOPs / FLOP/s) +
overhead, with bytes = weights touched (for MoE the experts some token routes
to) + KV read and FLOPs = 2 x active params x query tokens +
attention (4 x layers x q_heads x head_dim x query tokens x mean context), all divided over the
tensor-parallel devices; a prefill is one such pass over the prompts. `Fitted`: what
`sim.calibrate` fits to a measured run (see `LatencySpec`): a forward cost measured as a table
over query tokens (linear between its points, the fitted slope beyond them; a plain linear basis
without a table), per-row and per-verified-token overheads, and a measured prefill cost per
prompt token. Pure functions of numbers; they know nothing about requests, schedules or steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from sim.config import HardwareSpec, LatencySpec, ModelSpec, Scenario


class LatencyModel(Protocol):
    def forward_s(self, rows: int, query_tokens: float, kv_tokens: float) -> float: ...

    def draft_level_s(self, tokens: float) -> float: ...

    def other_s(self, rows: int, query_tokens: float, drafter: bool) -> float: ...

    def prefill_s(self, rows: int, prompt_len: int) -> float: ...


@dataclass(frozen=True)
class Roofline:
    model: ModelSpec
    hardware: HardwareSpec
    tensor_parallel: int = 1
    draft_params_b: float = 0.0

    def _time(self, bytes_: float, flops: float) -> float:
        hw = self.hardware
        memory = bytes_ / (hw.hbm_tbps * 1e12 * hw.bandwidth_efficiency)
        compute = flops / (hw.tflops * 1e12 * hw.flops_efficiency)
        return max(memory, compute) / self.tensor_parallel

    def forward_s(self, rows: int, query_tokens: float, kv_tokens: float) -> float:
        m = self.model
        bytes_ = m.touched_b(query_tokens) * 1e9 * m.bytes_per_param + kv_tokens * m.kv_bytes_per_token
        mean_context = kv_tokens / max(rows, 1)
        flops = (2 * m.active_b * 1e9 * query_tokens
                 + 4 * m.layers * m.q_heads * m.head_dim * query_tokens * mean_context)
        return self._time(bytes_, flops) + self.hardware.step_overhead_s

    def draft_level_s(self, tokens: float) -> float:
        if self.draft_params_b <= 0:
            return 0.0
        bytes_ = self.draft_params_b * 1e9 * self.model.bytes_per_param
        flops = 2 * self.draft_params_b * 1e9 * tokens
        return self._time(bytes_, flops) + self.hardware.step_overhead_s

    def other_s(self, rows: int, query_tokens: float, drafter: bool) -> float:
        return 0.0

    def prefill_s(self, rows: int, prompt_len: int) -> float:
        return one_pass_prefill_s(self, rows, prompt_len)


@dataclass(frozen=True)
class Fitted:
    spec: LatencySpec

    def forward_s(self, rows: int, query_tokens: float, kv_tokens: float) -> float:
        s = self.spec
        attn_pairs = query_tokens * kv_tokens / max(rows, 1)  # each computed token over its row's context
        return self._query_part(query_tokens) + s.kv_s * kv_tokens + s.attn_s * attn_pairs

    def _query_part(self, q: float) -> float:
        s = self.spec
        if not s.table_tokens:
            return s.base_s + s.query_s * q
        xs, ys = s.table_tokens, s.table_s
        if q <= xs[0]:
            return ys[0] + s.query_s * (q - xs[0])
        if q >= xs[-1]:
            return ys[-1] + s.query_s * (q - xs[-1])
        return float(np.interp(q, xs, ys))

    def draft_level_s(self, tokens: float) -> float:
        return self.spec.draft_base_s + self.spec.draft_token_s * tokens

    def other_s(self, rows: int, query_tokens: float, drafter: bool) -> float:
        s = self.spec
        return (s.other_base_s + s.other_row_s * rows + s.other_verify_s * (query_tokens - rows)
                + (s.other_drafter_s if drafter else 0.0))

    def prefill_s(self, rows: int, prompt_len: int) -> float:
        if self.spec.prefill_token_s is None:
            return one_pass_prefill_s(self, rows, prompt_len)
        return self.spec.prefill_token_s * rows * prompt_len


def build_latency(scn: Scenario) -> LatencyModel:
    if scn.latency.kind == "fitted":
        return Fitted(scn.latency)
    assert scn.model is not None and scn.hardware is not None  # Scenario.validate checked it
    return Roofline(scn.model, scn.hardware, scn.cluster.tensor_parallel, scn.spec.draft_params_b)


def one_pass_prefill_s(latency: LatencyModel, rows: int, prompt_len: int) -> float:
    """One forward pass over `rows` prompts (causal attention: half the prompt on average)."""
    if rows == 0:
        return 0.0
    return latency.forward_s(rows, rows * prompt_len, rows * prompt_len / 2)
