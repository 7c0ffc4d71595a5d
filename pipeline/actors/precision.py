"""The update's arithmetic precision: float32, or bf16-mixed (float32 weights, optimizer and residual
stream; the matrix products in bfloat16 under torch.autocast), chosen once when an actor is built.

Why: the tiny model's float32 update was ~55% of `make train`'s step, and ~70% of its forward and
backward is `aten::mm`, already near a core's float32 peak (~100 GFLOP/s on the AVX-512 EPYC). A core
with bfloat16 dot products (AVX512_BF16, AMX) multiplies bfloat16 at 2.2x that (oneDNN through
torch, float32 accumulation), and GPU RL trainers compute in bf16 as a rule (verl, NeMo-RL). The
model's forward and backward then run 1.62-1.86x faster (the attention's products in bf16 too). What
stays float32, and why:
- the weights, their gradients' accumulation and AdamW's state (the master copy: a bf16 weight would
  round away updates of lr 1e-4);
- attention's softmax and sums: its products run in bf16 arithmetic too where the kernels have
  AVX512_BF16 (pipeline/actors/attention.py, engine/kernels/causal_attention_bf16.cpp), else in float32;
- the LM head: its logits give the log-probs that the PPO ratio compares with the engine's float32
  ones; a bf16 head is the trainer-sampler mismatch MiniMax-M1 traced and fixed the same way. The
  head (pipeline/actors/head.py, installed by load_policy with `float32` set under bf16-mixed)
  computes its products in float32 whatever autocast says, a chunk of tokens at a time.
On 7,128 tokens of the mult task's worked solutions the tiny model's log-probs differ from float32's
by 1.6e-3 on average and 4.4e-2 at the 99th percentile; 0.07% of tokens have a ratio outside PPO's
clip range of 0.2 (`python -m bench.precision`; tests/test_precision.py bounds it on a small model).
In the RL run the actor's log-probs stay as close to the float32 engine's with the attention in bf16
as without (`train/mismatch_kl` 1.5-2.1e-6 against 1.1-2.3e-6 a step, five seeds each).

`auto` picks bf16-mixed for the torch backend on a CPU with bfloat16 dot products, float32 elsewhere
(without them torch emulates bf16 products, slower than float32's). DeepSpeed and Megatron keep
their own precision settings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from pipeline.actors.base import ActorConfig


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512_BF16 or AMX), so bf16 products beat float32's."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve(cfg: ActorConfig) -> str:
    """cfg.precision with `auto` decided for this machine: "float32" or "bf16-mixed"."""
    if cfg.precision != "auto":
        return cfg.precision
    mixed = cfg.backend == "torch" and cfg.device == "cpu" and cfg.dtype == "float32" and cpu_has_bf16()
    return "bf16-mixed" if mixed else "float32"


def autocast(precision: str, device: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context the actor's forwards run in: bf16 autocast, or nothing."""
    if precision == "bf16-mixed":
        return lambda: torch.autocast(device, dtype=torch.bfloat16)
    return contextlib.nullcontext
