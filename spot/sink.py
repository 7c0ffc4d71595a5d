"""The producer side of the DataBuffer: the engine's feature sink, collected per rollout.

The engine hands every committed token's features to its sink as it computes them
(engine.features): a prompt's features once at its prefill, then per decode step the tokens
that entered the KV cache and stay in a rollout. `DataBufferSink` scatters them into one
preallocated block per call of `generate` ([R, L, F], rows given out on first sight of a
rollout key, grown by doubling, kept across calls), so a step costs one indexed copy, not a loop over tokens.
`flush(rollouts, step)` then turns each finished rollout into a buffer entry and puts it:

    tokens   = prompt + response[:L-1]     (the last response token is never fed to the target)
    features = prompt features, then those of response positions 0..L-2   [P + L - 1, F]

Rollouts of fewer than two response tokens hold no training pair with a response input and
are skipped (counted in `skipped`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.features import CommittedFeatures
from engine.types import FinishReason, Rollout
from spot.buffer import BufferEntry, DataBuffer


class DataBufferSink:
    def __init__(self, buffer: DataBuffer, *, max_new_tokens: int, feature_layers: Sequence[int] = ()) -> None:
        self.buffer = buffer
        self.feature_layers = tuple(feature_layers)
        self.max_len = max_new_tokens
        self.dtype = buffer.dtype
        self.skipped = 0
        self._reset(rows=0)

    def _reset(self, rows: int) -> None:
        F = self.buffer.feature_size
        self.prompts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # prompt_id -> (tokens [P], features [P, F])
        self.keys: dict[int, tuple[str, int]] = {}  # row of the block (its rollout index) -> (prompt_id, sample)
        self.seen = torch.zeros(rows, dtype=torch.bool)  # [R] rows in `keys`
        self.block = torch.empty(rows, self.max_len, F, dtype=self.dtype)  # [R, L, F]

    # -- FeatureSink -----------------------------------------------------------------------
    def prompt(self, prompt_id: str, tokens: torch.Tensor, features: torch.Tensor, policy_version: int) -> None:
        self.prompts[prompt_id] = (tokens.to("cpu", torch.long), features.to("cpu", self.dtype))

    def tokens(self, entries: CommittedFeatures) -> None:
        slot_of_row = entries.rollouts.cpu()  # [b] a rollout's block row is its index in the generate call
        self._grow(int(slot_of_row.max()) + 1)
        new = (~self.seen[slot_of_row]).nonzero().squeeze(1)
        if new.numel():  # rows seen for the first time (just admitted): a Python loop over those only
            for r, slot in zip(new.tolist(), slot_of_row[new].tolist()):
                self.keys[slot] = (entries.prompt_ids[r], int(entries.samples[r]))
            self.seen[slot_of_row[new]] = True
        rows = slot_of_row[entries.row.cpu()]  # [M]
        pos = entries.position.cpu()
        features = entries.features.detach().to("cpu", self.dtype)
        if pos.numel() and int(pos.max()) >= self.max_len:  # a generate longer than the sink's rollouts: keep what fits
            keep = pos < self.max_len
            rows, pos, features = rows[keep], pos[keep], features[keep]
        self.block.view(-1, self.block.shape[-1]).index_copy_(0, rows * self.max_len + pos, features)  # block[rows, pos]

    def _grow(self, rows: int) -> None:
        if rows > self.block.shape[0]:  # grow by doubling: rare, amortised
            grown = torch.empty(max(8, rows, 2 * self.block.shape[0]), *self.block.shape[1:], dtype=self.dtype)
            grown[: self.block.shape[0]] = self.block
            self.block = grown
            self.seen = torch.cat([self.seen, torch.zeros(grown.shape[0] - self.seen.shape[0], dtype=torch.bool)])

    # -- into the buffer -------------------------------------------------------------------
    def flush(self, rollouts: Sequence[Rollout], step: int) -> int:
        """Puts one entry per rollout of this generate call; returns how many were put."""
        entries = []
        slots = {key: slot for slot, key in self.keys.items()}
        for ro in rollouts:
            L = len(ro.tokens)
            slot = slots.get((ro.prompt_id, ro.sample))
            if L < 2 or slot is None or ro.prompt_id not in self.prompts:
                self.skipped += 1
                continue
            p_tok, p_feat = self.prompts[ro.prompt_id]
            n = min(L, self.max_len) - 1
            tokens = torch.cat([p_tok, torch.tensor(ro.tokens[:n], dtype=torch.long)])
            features = torch.cat([p_feat, self.block[slot, :n]])
            entries.append(BufferEntry(
                key=f"{ro.prompt_id}/{ro.sample}", step=step, policy_version=ro.policy_version,
                finished=ro.finish_reason == FinishReason.STOP, prompt_len=p_tok.numel(), tokens=tokens, features=features,
            ))
        self.buffer.put_many(entries)  # one hold of the writers' lock for the step's rollouts
        # The entries are copies: the block is kept for the next call, so its pages are not faulted in anew.
        self.prompts, self.keys = {}, {}
        self.seen = torch.zeros_like(self.seen)  # (not zero_(): it may be an inference-mode tensor)
        return len(entries)
