"""The one optimiser / schedule / training-step helper of the project's trainers.

AdamW with weight decay on matrices only (embeddings and Linear weights; norms and biases are
not decayed), a linear-warmup-then-cosine learning rate, and the step itself: clip the gradient
norm, step, and report that norm. Callers that accumulate gradients over micro-batches call
`backward` themselves and then `clip_and_step`; callers with one loss per step call `train_step`.
This module knows nothing about models, data or distribution: under DDP the gradients it clips
are already all-reduced, so the norm it reports is the global one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (dim >= 2) decay, vectors (norms, biases) do not. A parameter
    partitioned by DeepSpeed ZeRO-3 (zero.Init) is an empty stub judged by its full shape, `ds_shape`."""
    params = [p for p in params if p.requires_grad]

    def matrix(p: torch.nn.Parameter) -> bool:
        return len(getattr(p, "ds_shape", p.shape)) >= 2

    return [
        {"params": [p for p in params if matrix(p)], "weight_decay": weight_decay},
        {"params": [p for p in params if not matrix(p)], "weight_decay": 0.0},
    ]


def make_adamw(params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.95),
               weight_decay: float = 0.0) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(params, weight_decay), lr=lr, betas=betas)


def warmup_cosine(lr: float, step: int, warmup_steps: int, progress: float, min_lr_ratio: float) -> float:
    """Linear warmup over warmup_steps, then cosine from lr to lr * min_lr_ratio as progress goes 0 -> 1."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def scheduled_lr(lr: float, schedule: str, step: int, steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """The learning rate of 0-based step `step` of a schedule of `steps`: a linear warmup over
    warmup_steps, then lr ("constant") or a cosine from lr down to lr * min_lr_ratio at its last
    step and after it ("cosine"). A pure function of the step, so a resumed run continues the same
    schedule."""
    if schedule == "constant":
        return lr * (step + 1) / warmup_steps if step < warmup_steps else lr
    if schedule != "cosine":
        raise ValueError(f"unknown learning-rate schedule {schedule!r}: use constant or cosine")
    progress = (step - warmup_steps) / max(1, steps - 1 - warmup_steps)
    return warmup_cosine(lr, step, warmup_steps, progress, min_lr_ratio)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_and_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], grad_clip: float) -> float:
    """Clips the accumulated gradients to grad_clip (0 = no clipping), steps; returns the norm before clipping."""
    max_norm = grad_clip if grad_clip > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    return float(norm)


def train_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
               grad_clip: float) -> float:
    """zero_grad, backward, clip, step for one loss; returns the gradient norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    return clip_and_step(optimizer, params, grad_clip)
