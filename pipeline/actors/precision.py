"""The update's arithmetic precision: float32, or bf16-mixed (float32 weights, optimizer and residual
stream; the matrix products in bfloat16 under torch.autocast), chosen once when an actor is built.

Why: on a CPU the actor's update is a large share of an RL step, and most of its forward and
backward is `aten::mm`, already near a core's float32 peak. A core with bfloat16 dot products
(AVX512_BF16, AMX) does twice the multiply-adds per instruction in bfloat16 (oneDNN through torch,
float32 accumulation), and GPU RL trainers compute in bf16 as a rule (verl, NeMo-RL). What stays
float32, and why:
- the weights, their gradients' accumulation and AdamW's state (the master copy: a bf16 weight would
  round away updates of lr 1e-4);
- attention's softmax and sums: its products run in bf16 arithmetic too where the kernels have
  AVX512_BF16 (pipeline/actors/attention.py, engine/kernels/causal_attention_bf16.cpp), else in float32;
- the LM head: its logits give the log-probs that the PPO ratio compares with the engine's float32
  ones; a bf16 head is the trainer-sampler mismatch MiniMax-M1 traced and fixed the same way. The
  head (pipeline/actors/head.py, installed by load_policy with `float32` set under bf16-mixed)
  computes its products in float32 whatever autocast says, a chunk of tokens at a time.
How much faster the update runs, and how far its log-probs move from float32's (the share of tokens
whose ratio leaves PPO's clip range), is measured by `python -m bench.precision` (docs/BENCHMARKS.md,
"The update"); tests/test_precision.py bounds the distance on a small model, and the RL run logs the
actor's distance from the engine as `train/mismatch_kl`.

`auto` picks bf16-mixed for the torch backend on a CPU with bfloat16 dot products, float32 elsewhere
(without them torch emulates bf16 products, slower than float32's). DeepSpeed and Megatron keep
their own precision settings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from pipeline.actors import actor_caps
from pipeline.actors.base import ActorConfig


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512_BF16 or AMX), so bf16 products beat float32's."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve(cfg: ActorConfig) -> str:
    """cfg.precision with `auto` decided for this machine: "float32" or "bf16-mixed"."""
    if cfg.precision != "auto":
        return cfg.precision
    mixed = actor_caps(cfg.backend).autocast and cfg.device == "cpu" and cfg.dtype == "float32" and cpu_has_bf16()
    return "bf16-mixed" if mixed else "float32"


def autocast(precision: str, device: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context the actor's forwards run in: bf16 autocast, or nothing."""
    if precision == "bf16-mixed":
        return lambda: torch.autocast(device, dtype=torch.bfloat16)
    return contextlib.nullcontext
