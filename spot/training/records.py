"""HiddenStateRows: one sequence's token ids with the target's features, and an in-memory store.

A *row* is a prompt + response sequence as the target saw it: token ids x_0..x_{T-1} and the
target's feature f_t at every position (for `eagle` its final hidden state after the final norm;
for `eagle3` the outputs of its auxiliary layers followed by that final hidden state). Rows are
what drafter training consumes, whoever produced them (the offline warm-start's teacher-forced
forward here; later the engine's verify passes and the actor's log-prob forward). Features are
detached copies: nothing that reads a row can send a gradient into the target.

This module knows nothing about drafters, pairs or windows (see spot.training.pairs).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True)
class HiddenStateRows:
    prompt_id: str  # rows of one prompt (a group) share it; held-out splits go by prompt
    sample: int = 0
    step: int = 0  # RL step whose policy produced the features (0 offline)
    tokens: torch.Tensor  # [T] long: prompt then response
    features: torch.Tensor  # [T, F] float32 or bfloat16, no grad
    prompt_len: int  # tokens[:prompt_len] is the prompt

    def __post_init__(self) -> None:
        T = self.tokens.shape[0]
        if self.tokens.dim() != 1 or self.features.dim() != 2 or self.features.shape[0] != T:
            raise ValueError(f"row {self.prompt_id!r}: tokens [T] and features [T, F] must agree, got "
                             f"{tuple(self.tokens.shape)} and {tuple(self.features.shape)}")
        if not 0 < self.prompt_len <= T:
            raise ValueError(f"row {self.prompt_id!r}: prompt_len {self.prompt_len} not in 1..{T}")
        if self.features.requires_grad:
            raise ValueError(f"row {self.prompt_id!r}: features must be detached from the target")

    @property
    def length(self) -> int:
        return self.tokens.shape[0]

    @property
    def response_len(self) -> int:
        return self.length - self.prompt_len

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.features.nbytes


@dataclass
class RowStore:
    """An in-memory list of rows with byte and token counts (the shared-memory ring comes later)."""

    rows: list[HiddenStateRows] = field(default_factory=list)

    def add(self, row: HiddenStateRows) -> None:
        if self.rows and row.features.shape[1] != self.feature_size:
            raise ValueError(f"row {row.prompt_id!r} has feature size {row.features.shape[1]}, the store holds {self.feature_size}")
        self.rows.append(row)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[HiddenStateRows]:
        return iter(self.rows)

    def __getitem__(self, i: int) -> HiddenStateRows:
        return self.rows[i]

    @property
    def feature_size(self) -> int:
        return self.rows[0].features.shape[1]

    @property
    def num_tokens(self) -> int:
        return sum(r.length for r in self.rows)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    def split_by_prompt(self, fraction: float, generator: torch.Generator) -> tuple[RowStore, RowStore]:
        """-> (train, held out): about `fraction` of the prompts, with all their samples, held out.

        Splitting by prompt keeps a prompt's sibling samples from leaking into the held-out
        metrics. At least one prompt is held out when there are two or more; with a single prompt
        the split goes by row instead; with a single row nothing is held out.
        """
        if not 0 <= fraction < 1:
            raise ValueError(f"the held-out fraction must be in [0, 1), got {fraction}")
        keys = sorted({r.prompt_id for r in self.rows})
        by_row = len(keys) < 2
        units = list(range(len(self.rows))) if by_row else keys
        n_out = 0 if fraction == 0 or len(units) < 2 else max(1, round(fraction * len(units)))
        perm = torch.randperm(len(units), generator=generator).tolist()
        out = {units[i] for i in perm[:n_out]}
        train, held = RowStore(), RowStore()
        for i, r in enumerate(self.rows):
            (held if (i if by_row else r.prompt_id) in out else train).add(r)
        return train, held
