"""Bucketed CUDA graphs: which graphs to capture for the tuner's arms, and a runner that replays them.

A CUDA graph replays one recorded forward at fixed shapes, so every shape the engine runs needs
its own graph and memory pool. Naively that is every arm x every batch size, for the target and
for the drafter (TLT, arXiv 2511.16665: 30.39 GB for multi-strategy graphs). Bucketed (TLT: 10.69 GB):

- batch sizes are padded up to *capture sizes* (1, 2, 4, 8, then multiples of 8, and max_batch);
- a target graph is keyed by (capture size, tokens per row): a decode graph (1 token, the `off`
  arm) or a verify graph (1 + the arm's verify width); arms with the same verify width share it,
  chains and trees alike (the tree's shape is in the attention mask, an input);
- a shape is captured only for the capture sizes of the buckets where one of its arms is a
  candidate (`bucket_arms`; default: every arm in every bucket, as engine.spec.tuner runs).

`capture_plan` is pure arithmetic (no torch): it lists the graphs and estimates their memory
from the model configs (activations of one forward at that shape; the weights and the KV cache
are shared by all graphs and not counted). `GraphRunner` captures `torch.cuda.CUDAGraph`s of
the target forward per the plan's target graphs and replays them, padding rows and tokens up
to the captured shape; a call no graph holds (a larger batch, a wider verify) runs eager.
`DecodeGraphs` is what the engine holds on CUDA (engine.cuda_graphs): the target shapes of its
speculation policy and the runner its decode loop calls for every target forward. The
drafters run eager: their one-layer forwards are not captured.

Shapes: B rows, T tokens per row, S visible cache slots, H hidden, V vocab, I intermediate size.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.model import ModelOutput
from engine.model_config import ModelConfig
from engine.spec.config import SpecConfig
from engine.spec.drafter import DraftShape
from engine.spec.tuner import parse_arm


def capture_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes: 1, 2, 4, 8, 16, 24, ... (multiples of 8), max_batch last."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


def pad_batch(batch: int, sizes: list[int]) -> int:
    """The smallest capture size >= batch."""
    i = bisect.bisect_left(sizes, batch)
    if i == len(sizes):
        raise ValueError(f"batch {batch} is larger than the largest capture size {sizes[-1]}")
    return sizes[i]


def verify_width(arm: DraftShape | None) -> int:
    """Draft nodes a step with this arm verifies per row at most (0 for off): a chain's depth
    (capped by verify_tokens), a tree's verify_tokens."""
    if arm is None:
        return 0
    return arm.chain_len if arm.topk == 1 else arm.verify_tokens


def bucket_ranges(thresholds: list[int], max_batch: int) -> list[range]:
    """Batch sizes per bucket (engine.spec.tuner's thresholds), cut at max_batch; empty past it."""
    ends = [*thresholds[1:], max_batch + 1]
    return [range(lo, max(lo, min(hi, max_batch + 1))) for lo, hi in zip(thresholds, ends)]


@dataclass(frozen=True)
class TargetGraph:
    batch: int  # capture size (rows)
    tokens: int  # per row: 1 (decode) or 1 + verify width
    arms: tuple[str, ...]  # labels of the arms that replay it ("off" for decode)
    bytes: int


@dataclass
class CapturePlan:
    sizes: list[int]  # all capture sizes up to max_batch
    target: list[TargetGraph]  # sorted by (batch, tokens)
    naive_graphs: int  # every arm x every batch size 1..max_batch
    naive_bytes: int
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(g.bytes for g in self.target)

    def target_shapes(self) -> list[tuple[int, int]]:
        """(batch, tokens per row) of every target graph."""
        return [(g.batch, g.tokens) for g in self.target]


def forward_bytes(cfg: ModelConfig, batch: int, tokens: int, visible: int, *, dtype_bytes: int = 2, feature_layers: int = 0) -> int:
    """Activation memory of one forward at (B, T, S): what a graph's pool keeps (outputs: final
    hidden, float32 logits, `feature_layers` layer outputs) plus one layer's transients (residual,
    q/k/v, attention scores as the math path holds them, its mask, the MLP's gate/up and product;
    layers run one after the other, so one layer's worth is live at a time)."""
    M = batch * tokens
    H, I, V, D = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    outputs = M * H * dtype_bytes * (1 + feature_layers) + M * V * 4
    rope_mask = 2 * M * D * dtype_bytes + M * visible * (1 + hq // hkv)
    layer = M * dtype_bytes * (2 * H + (hq + 2 * hkv) * D + 3 * I) + batch * hq * tokens * visible * dtype_bytes
    return outputs + rope_mask + layer


def capture_plan(arms: list[DraftShape | None], thresholds: list[int], max_batch: int, target: ModelConfig,
                 *, context: int, bucket_arms: list[list[int]] | None = None,
                 dtype_bytes: int = 2, feature_layers: int = 0) -> CapturePlan:
    """The graphs for `arms` (None = off) over the tuner's buckets, and their memory against the naive plan.

    `context`: the visible cache slots a graph is captured for (the engine's KV cache length).
    `bucket_arms[i]`: indices into `arms` that bucket i may choose (default: all of them).
    """
    if not thresholds or thresholds[0] != 1 or any(b <= a for a, b in zip(thresholds, thresholds[1:])):
        raise ValueError(f"bucket thresholds must start at 1 and increase, got {thresholds}")
    if not arms:
        raise ValueError("capture_plan needs at least one arm")
    if bucket_arms is None:
        bucket_arms = [list(range(len(arms))) for _ in thresholds]
    if len(bucket_arms) != len(thresholds) or any(not 0 <= a < len(arms) for b in bucket_arms for a in b):
        raise ValueError(f"bucket_arms needs one list of arm indices (0..{len(arms) - 1}) per bucket ({len(thresholds)})")
    labels = [a.label if a is not None else "off" for a in arms]
    sizes = capture_sizes(max_batch)
    shared: dict[tuple[int, int], set[str]] = {}  # (batch, tokens) -> arm labels
    for rng, members in zip(bucket_ranges(thresholds, max_batch), bucket_arms):
        padded = sorted({pad_batch(b, sizes) for b in rng})
        for a in members:
            for s in padded:
                shared.setdefault((s, 1 + verify_width(arms[a])), set()).add(labels[a])
    fb = lambda b, t: forward_bytes(target, b, t, context, dtype_bytes=dtype_bytes, feature_layers=feature_layers)  # noqa: E731
    tgraphs = [TargetGraph(batch=b, tokens=t, arms=tuple(sorted(shared[(b, t)], key=labels.index)), bytes=fb(b, t))
               for b, t in sorted(shared)]
    naive = 0
    naive_graphs = 0
    for arm in arms:
        for b in range(1, max_batch + 1):
            naive += fb(b, 1 + verify_width(arm))
            naive_graphs += 1
    plan = CapturePlan(sizes=sizes, target=tgraphs, naive_graphs=naive_graphs, naive_bytes=naive)
    plan.metrics = {"graphs/count": float(len(tgraphs)), "graphs/naive_count": float(naive_graphs),
                    "graphs/gb": plan.bytes / 1e9, "graphs/naive_gb": naive / 1e9}
    return plan


@dataclass
class Captured:
    """One captured shape: its static inputs, filled before each replay, and the replay, which
    returns the graph's static outputs."""

    inputs: dict[str, torch.Tensor]  # ids, pos, slots [B, T] long; mask [B, T, cache.max_len] bool
    replay: Callable[[], ModelOutput]


def _replay(graph: torch.cuda.CUDAGraph, out: ModelOutput) -> ModelOutput:
    graph.replay()
    return out


class GraphRunner:
    """The target forward through CUDA graphs at the plan's (batch, tokens) shapes, eager elsewhere.

    `forward` is how the engine runs the target (engine.runtime.TargetRuntime or the Transformer),
    `cache` the engine's KVCache: graphs read and write its storage in place, so a rebuilt cache
    (engine.attach_drafter growing the margin) needs a new runner (DecodeGraphs makes one). Calls
    take the engine's decode arguments for rows 0..b-1 with T tokens each and a mask over
    S <= cache.max_len slots; rows are padded with free cache rows (b..batch-1: the engine keeps
    nothing there while decoding), tokens with the next tentative slots, the mask with False. The
    returned tensors are contiguous; unless tokens were padded they are views of the graph's
    static outputs: read them before the next call.
    """

    def __init__(self, forward, cache, shapes: list[tuple[int, int]], *, hidden_layers: tuple[int, ...] = ()) -> None:
        self.forward, self.cache, self.hidden_layers = forward, cache, tuple(hidden_layers)
        self.graphs: dict[tuple[int, int], Captured] = {}
        self.pool = None
        # Largest first: the smaller graphs reuse its pool.
        for shape in sorted({s for s in shapes if s[0] <= cache.max_batch}, reverse=True):
            self.graphs[shape] = self._capture(*shape)

    @property
    def captured(self) -> list[tuple[int, int]]:
        return sorted(self.graphs)

    def _static_inputs(self, batch: int, tokens: int) -> dict[str, torch.Tensor]:
        dev, S = self.cache.k.device, self.cache.max_len
        pos = torch.arange(tokens, device=dev).expand(batch, tokens).contiguous()
        return {"ids": torch.zeros(batch, tokens, dtype=torch.long, device=dev), "pos": pos, "slots": pos.clone(),
                "mask": torch.arange(S, device=dev) <= pos.unsqueeze(-1)}

    def _run(self, x: dict[str, torch.Tensor]) -> ModelOutput:
        """The forward on static inputs x (what a graph records)."""
        return self.forward(x["ids"], x["pos"], cache=self.cache, cache_pos=x["slots"], attn_mask=x["mask"],
                            hidden_layers=self.hidden_layers)

    @torch.inference_mode()
    def _capture(self, batch: int, tokens: int) -> Captured:
        if self.cache.k.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the KV cache on a CUDA device, not {self.cache.k.device}; "
                             "elsewhere the engine runs the forward eagerly (it builds no GraphRunner)")
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        x = self._static_inputs(batch, tokens)
        saved = self.cache.k[:, :batch, :, :tokens].clone(), self.cache.v[:, :batch, :, :tokens].clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture (lazy inits, autotuning)
            for _ in range(2):
                self._run(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._run(x)
        self.cache.k[:, :batch, :, :tokens], self.cache.v[:, :batch, :, :tokens] = saved  # capture wrote dummy entries
        torch.cuda.synchronize()
        return Captured(x, functools.partial(_replay, graph, out))

    def graph_for(self, batch: int, tokens: int) -> tuple[int, int] | None:
        """The smallest captured shape that holds (batch, tokens), or None (eager)."""
        fits = [s for s in self.graphs if s[0] >= batch and s[1] >= tokens]
        return min(fits, key=lambda s: (s[0] * s[1], s)) if fits else None

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache_pos: torch.Tensor, attn_mask: torch.Tensor) -> ModelOutput:
        """input_ids, positions, cache_pos [b, T]; attn_mask [b, T, S] bool -> ModelOutput for [b, T]."""
        b, T = input_ids.shape
        key = self.graph_for(b, T)
        if key is None:
            return self.forward(input_ids, positions, cache=self.cache, cache_pos=cache_pos, attn_mask=attn_mask,
                                hidden_layers=self.hidden_layers)
        g = self.graphs[key]
        B, W = key
        ids, pos, slots, mask = g.inputs["ids"], g.inputs["pos"], g.inputs["slots"], g.inputs["mask"]
        S, last = attn_mask.shape[-1], self.cache.max_len - 1
        ids[:b, :T].copy_(input_ids)
        pos[:b, :T].copy_(positions)
        slots[:b, :T].copy_(cache_pos)
        if W > T:  # padding tokens: the next tentative slots and positions; their outputs are dropped
            step = torch.arange(1, W - T + 1, device=ids.device)
            ids[:b, T:] = 0
            pos[:b, T:] = positions[:, -1:] + step
            slots[:b, T:] = (cache_pos[:, -1:] + step).clamp(max=last)
        mask[:b, :T, :S].copy_(attn_mask)
        mask[:b, :T, S:] = False
        if W > T:
            mask[:b, T:] = torch.arange(mask.shape[-1], device=mask.device) <= slots[:b, T:].unsqueeze(-1)
        if B > b:  # padding rows: positions 0..W-1 of free cache rows, causal
            ids[b:] = 0
            pos[b:] = torch.arange(W, device=pos.device)
            slots[b:] = pos[b:]
            mask[b:] = torch.arange(mask.shape[-1], device=mask.device) <= pos[b:].unsqueeze(-1)
        out = g.replay()
        cut = lambda t: t[:b, :T].contiguous()  # noqa: E731  (a copy only where tokens were padded)
        return ModelOutput(hidden=cut(out.hidden), logits=cut(out.logits) if out.logits is not None else None,
                           layer_hidden={i: cut(h) for i, h in out.layer_hidden.items()})


def config_arms(spec: SpecConfig, shape: DraftShape) -> tuple[list[DraftShape | None], list[int], list[list[int]]]:
    """What the engine's config policy (engine.RolloutEngine._config_policy) may choose, as
    `capture_plan` takes it: arms (None = off, always a candidate: a step whose drafter proposes
    nothing runs plain), bucket thresholds, and each bucket's arm indices. The tuner: its arms in
    its buckets; the fixed shape: in every bucket, or only up to `max_active_batch` rows."""
    if spec.tuner_arms:
        arms = [None, *(a for a in (parse_arm(label) for label in spec.tuner_arms) if a is not None)]
        return arms, list(spec.tuner_buckets), [list(range(len(arms)))] * len(spec.tuner_buckets)
    if spec.max_active_batch is not None:
        return [None, shape], [1, spec.max_active_batch + 1], [[0, 1], [0]]
    return [None, shape], [1], [[0, 1]]


class DecodeGraphs:
    """The engine's graphed target decode: the (batch, tokens) shapes to capture and the
    GraphRunner that serves the decode loop's target forwards.

    `plain`: the shapes of autoregressive decoding (no drafter attached); `speculative`: those of
    the policy's arms, off included. A runner's graphs hold what they were captured with: the
    forward, the KV cache, the RoPE table (its rows are gathered inside the graph) and the hidden
    layers returned. `runner()` captures on first use and again whenever one of them differs
    (attach_drafter rebuilds the cache and the table; the drafter and the sink choose the layers),
    so no graph replays storage the engine has replaced. `make_runner` builds the runner
    (GraphRunner; tests pass one that records the shapes it serves).
    """

    def __init__(self, plain: list[tuple[int, int]], speculative: list[tuple[int, int]], *,
                 make_runner: Callable[..., GraphRunner] = GraphRunner) -> None:
        self.plain, self.speculative, self.make_runner = sorted(set(plain)), sorted(set(speculative)), make_runner
        self.current: GraphRunner | None = None
        # ((forward, cache, RoPE table), (layers, speculative)) of `current`, held: its storage stays alive.
        self._key: tuple | None = None

    @classmethod
    def for_config(cls, spec: SpecConfig, shape: DraftShape, max_batch: int, target: ModelConfig, *,
                   context: int) -> DecodeGraphs:
        """The target graphs of the engine's config policy (`config_arms`) at batch sizes up to max_batch."""
        arms, thresholds, bucket_arms = config_arms(spec, shape)
        plain = capture_plan([None], [1], max_batch, target, context=context)
        speculative = capture_plan(arms, thresholds, max_batch, target, context=context, bucket_arms=bucket_arms)
        return cls(plain.target_shapes(), speculative.target_shapes())

    def runner(self, forward, cache, rope_table, hidden_layers: tuple[int, ...], *, speculative: bool) -> GraphRunner:
        """The runner for a generate() call with this forward, cache, RoPE table and hidden layers;
        `speculative`: a drafter is attached."""
        held, asked = (forward, cache, rope_table), (tuple(hidden_layers), speculative)
        if self._key is None or any(a is not b for a, b in zip(held, self._key[0])) or asked != self._key[1]:
            self.current = self._key = None  # the old graphs are released before the new ones are captured
            shapes = self.speculative if speculative else self.plain
            self.current = self.make_runner(forward, cache, shapes, hidden_layers=asked[0])
            self._key = held, asked
        return self.current
