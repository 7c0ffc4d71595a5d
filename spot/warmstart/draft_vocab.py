"""The draft vocabulary: the target's most frequent token ids (EAGLE-3's d2t mapping).

A drafter whose head covers only the N most frequent ids of the target's own text pays N / V of
the LM-head cost per draft step and loses little: tokens outside it are rarely the target's
sample. The ids are sorted ascending; row j of the draft head is target id `draft_vocab[j]`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

AUTO_FULL_MAX = 4096  # vocabularies up to this size keep every id by default
AUTO_SIZE = 8192  # default draft vocabulary for larger ones


def default_size(vocab_size: int) -> int:
    """0 (full vocabulary) for small vocabularies, else AUTO_SIZE."""
    return 0 if vocab_size <= AUTO_FULL_MAX else AUTO_SIZE


def most_frequent(sequences: Iterable[torch.Tensor], vocab_size: int, n: int) -> torch.Tensor | None:
    """[n] the n most frequent ids over `sequences` (ties: lower id first), sorted; None if n is 0 or >= vocab_size.

    Ids never seen fill the remaining places in id order, so the result always has n ids.
    """
    if n < 0:
        raise ValueError(f"the draft vocabulary size must be >= 0 (0 = full vocabulary), got {n}")
    if n == 0 or n >= vocab_size:
        return None
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        counts += torch.bincount(s.reshape(-1).long(), minlength=vocab_size)
    order = torch.argsort(-counts, stable=True)  # stable: equal counts stay in id order
    return order[:n].sort().values
