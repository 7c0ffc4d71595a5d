"""DAPO's dynamic sampling: train only on groups whose rewards differ, refilling the batch.

A group whose n rewards are all equal (all solved, or all failed) has advantage 0 for every
response under GRPO and RLOO: it costs a training step's compute and adds no gradient. DAPO
(Yu et al., 2025) drops such groups and samples more prompts until the batch holds the target
number of groups with nonzero reward variance.

`fill_groups` is the refill as a pure function over a *stream* of candidate groups (any payload
paired with its rewards): it pulls groups one at a time, keeps the informative ones and stops
pulling as soon as the batch is full, so a lazily generating stream samples no more rounds than
needed. The caller bounds the stream (a maximum number of generation rounds); running out before
the batch is full is an error, as in DAPO, because it means the tasks are solved or unsolvable.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:  # [G, n] -> [G] bool
    """True for groups whose rewards are not all equal."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, n], got shape {tuple(rewards.shape)}")
    return rewards.amax(-1) > rewards.amin(-1)


def fill_groups(stream: Iterable[tuple[T, Sequence[float]]], target: int) -> tuple[list[T], dict[str, float]]:
    """The first `target` groups of `stream` with differing rewards -> (groups, metrics)."""
    if target < 1:
        raise ValueError(f"fill_groups: target must be >= 1, got {target}")
    kept: list[T] = []
    drawn = 0
    for group, rewards in stream:
        drawn += 1
        if max(rewards) > min(rewards):
            kept.append(group)
            if len(kept) == target:
                break
    if len(kept) < target:
        raise ValueError(
            f"dynamic sampling found only {len(kept)} of {target} groups with differing rewards in {drawn} "
            "drawn; the prompts are all solved or all failed by the policy: raise the stream's maximum "
            "number of generation rounds, use harder or easier problems, or turn algorithm.dynamic_sampling off"
        )
    return kept, {
        "train/dynamic_sampling_drawn": float(drawn),
        "train/dynamic_sampling_dropped": float(drawn - len(kept)),
        "train/dynamic_sampling_kept_frac": len(kept) / drawn,
    }
