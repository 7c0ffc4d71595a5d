"""Admission's bookkeeping for a generate() call: which samples enter the free slots now, and the
right-padded records a prefill and a drafter's admission are built from.

A request with more samples than the batch holds (GRPO groups of 64-128) is admitted in chunks:
`take_chunks` hands out whole requests in order while they fit, and splits only a request larger
than the batch. These are pure functions of their inputs; the decode loop (engine.decode) owns
the slots, the cache and the prefill pass.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from engine.spec.drafter import Admission
from engine.types import Request


@dataclass
class Pending:
    """Samples first..first+count-1 of request `index`, not yet admitted."""

    index: int
    request: Request
    first: int
    count: int


@dataclass
class Prefill:
    """A prompt's prefill, kept for its later chunks (never recomputed)."""

    k: torch.Tensor  # [L, Hkv, P, D]
    v: torch.Tensor
    logits: torch.Tensor  # [V] at the last prompt position
    features: torch.Tensor | None  # [P, F] the drafter's
    ids: torch.Tensor  # [P]


def take_chunks(pending: deque[Pending], free: int, max_batch: int) -> list[Pending]:
    """The chunks admitted into `free` slots now, taken off `pending`: whole requests in order
    while they fit; a request larger than the batch is split into chunks of whatever is free."""
    chunks = []
    while pending and free > 0:
        head = pending[0]
        if head.count <= free:
            chunks.append(pending.popleft())
            free -= head.count
        elif head.request.n > max_batch:
            chunks.append(Pending(head.index, head.request, head.first, free))
            head.first, head.count, free = head.first + free, head.count - free, 0
        else:
            break
    return chunks


def right_pad(rows: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths [n_j, ...] -> (zero-padded [P, T, ...], lengths [P]) on `device`."""
    T = max(r.shape[0] for r in rows)
    out = torch.zeros(len(rows), T, *rows[0].shape[1:], dtype=rows[0].dtype, device=device)
    for j, r in enumerate(rows):
        out[j, : r.shape[0]] = r
    return out, torch.tensor([r.shape[0] for r in rows], device=device)


def admission_record(counts: list[int], slots: list[torch.Tensor], ids: list[torch.Tensor],
                     features: list[torch.Tensor] | None, first_tokens: torch.Tensor, device: torch.device) -> Admission:
    """What a drafter is told of the chunks admitted at once: chunk j's `counts[j]` samples in
    `slots[j]`, its prompt `ids[j]` [P_j] and target features [P_j, F] (None: not wanted)."""
    tokens, lengths = right_pad(ids, device)
    padded = right_pad(features, device)[0] if features is not None else None
    owner = torch.repeat_interleave(torch.arange(len(counts), device=device), torch.tensor(counts, device=device))
    return Admission(slots=torch.cat(slots), owner=owner, tokens=tokens, lengths=lengths, features=padded,
                     first_tokens=first_tokens)
