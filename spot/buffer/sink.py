"""The producer side of the DataBuffer: the engine's feature sink, collected per rollout.

The engine hands every committed token's features to its sink as it computes them
(engine.features): a prompt's features once at its prefill, then per decode step the tokens
that entered the KV cache and stay in a rollout. `DataBufferSink` scatters them into one
preallocated block per call of `generate` ([R, L, F], row r for the call's rollout r, grown by
doubling, reused by later calls), so a step costs one indexed copy, not a loop over tokens.
After a generate call, `stash(rollouts, step)` detaches what it captured (the sink takes a
spare block for the next call) and `put_stashed()` turns each rollout into a buffer entry and
puts it; `flush` does both. The rank coordinator puts its stashes at the start of its idle
window, except on the rank that finished last: there nobody is left to train on the entries
this step, and the put would be on the step's critical path, so that rank holds its stashes,
this step's and an earlier one it may still hold from being last before, until its next window
as an early rank (`put_stashed(hold=2)`:
all but the newest two are put, so at most two blocks wait; a held step's entries then are the
previous step's long responses the sampler's offset wants). An entry:

    tokens   = prompt + response[:L-1]     (the last response token is never fed to the target)
    features = prompt features, then those of response positions 0..L-2   [P + L - 1, F]

Rollouts of fewer than two response tokens hold no training pair with a response input and
are skipped (counted in `skipped`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.idle.rules import stashes_to_hold
from engine.features import CommittedFeatures
from engine.types import FinishReason, Rollout
from spot.buffer.ring import BufferEntry, DataBuffer


@dataclass
class Stash:
    """One generate call's captured features, detached from the sink until they are put."""

    step: int
    rollouts: Sequence[Rollout]
    prompts: dict[str, tuple[torch.Tensor, torch.Tensor]]  # prompt_id -> (tokens [P], features [P, F])
    keys: dict[int, tuple[str, int]]  # block row -> (prompt_id, sample)
    block: torch.Tensor  # [R, L, F]


def put_as_window_opens(sink, window) -> int:
    """The rule of common.idle.rules as a rank's idle window opens (spot.coordinator, spot.pool.follower):
    put every stash, except those the rank that finished last holds for its next window."""
    return sink.put_stashed(hold=stashes_to_hold(window))


class DataBufferSink:
    lag = 0  # the entries of step t are put as step t's idle windows open (spot.buffer.actor_features: 1)

    def __init__(self, buffer: DataBuffer, *, max_new_tokens: int, feature_layers: Sequence[int] = ()) -> None:
        self.buffer = buffer
        self.feature_layers = tuple(feature_layers)
        self.max_len = max_new_tokens
        self.dtype = buffer.dtype
        self.skipped = 0
        self.stashed: list[Stash] = []
        self.spare: list[torch.Tensor] = []  # blocks of put stashes, kept so their pages stay faulted in
        self.prompts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # prompt_id -> (tokens [P], features [P, F])
        self.keys: dict[int, tuple[str, int]] = {}  # row of the block (its rollout index) -> (prompt_id, sample)
        self.known = 0  # rollout indices below this one have been seen (in `keys`)
        self.block = torch.empty(0, self.max_len, buffer.feature_size, dtype=self.dtype)  # [R, L, F]

    # -- FeatureSink -----------------------------------------------------------------------
    def prompt(self, prompt_id: str, tokens: torch.Tensor, features: torch.Tensor, policy_version: int) -> None:
        self.prompts[prompt_id] = (tokens.to("cpu", torch.long), features.to("cpu", self.dtype))

    def tokens(self, entries: CommittedFeatures) -> None:
        slot_of_row = entries.rollouts.cpu()  # [b] a rollout's block row is its index in the generate call
        top = int(slot_of_row.max())
        if top >= self.known:  # rows admitted since the last step: their indices are the new ones (CommittedFeatures)
            self._grow(top + 1)
            new = (slot_of_row >= self.known).nonzero().squeeze(1).tolist()
            for r in new:
                self.keys[int(slot_of_row[r])] = (entries.prompt_ids[r], int(entries.samples[r]))
            self.known = top + 1
        rows = slot_of_row if entries.every_row else slot_of_row[entries.row.cpu()]  # [M]
        pos = entries.position.cpu()
        features = entries.features.detach().to("cpu", self.dtype)
        if int(pos.max()) >= self.max_len:  # a generate longer than the sink's rollouts: keep what fits
            keep = pos < self.max_len
            rows, pos, features = rows[keep], pos[keep], features[keep]
        self.block.view(-1, self.block.shape[-1]).index_copy_(0, pos.add(rows, alpha=self.max_len), features)  # block[rows, pos]

    def _grow(self, rows: int) -> None:
        if rows > self.block.shape[0]:  # grow by doubling: rare, amortised
            grown = torch.empty(max(8, rows, 2 * self.block.shape[0]), *self.block.shape[1:], dtype=self.dtype)
            grown[: self.block.shape[0]] = self.block
            self.block = grown

    # -- into the buffer -------------------------------------------------------------------
    def stash(self, rollouts: Sequence[Rollout], step: int) -> None:
        """Detaches this generate call's captures (for `put_stashed`); the next call fills a spare block."""
        self.stashed.append(Stash(step, list(rollouts), self.prompts, self.keys, self.block))
        self.block = self.spare.pop() if self.spare else torch.empty(0, self.max_len, self.block.shape[-1], dtype=self.dtype)
        self.prompts, self.keys, self.known = {}, {}, 0

    def put_stashed(self, hold: int = 0) -> int:
        """Puts every stash but the newest `hold`, oldest first; returns how many entries were put."""
        cut = max(0, len(self.stashed) - hold)
        put_now, self.stashed = self.stashed[:cut], self.stashed[cut:]
        return sum(self._put(s) for s in put_now)

    def flush(self, rollouts: Sequence[Rollout], step: int) -> int:
        """Puts one entry per rollout of this generate call (and anything stashed before); returns how many."""
        self.stash(rollouts, step)
        return self.put_stashed()

    def _put(self, s: Stash) -> int:
        entries = []
        slots = {key: slot for slot, key in s.keys.items()}
        for ro in s.rollouts:
            L = len(ro.tokens)
            slot = slots.get((ro.prompt_id, ro.sample))
            if L < 2 or slot is None or ro.prompt_id not in s.prompts:
                self.skipped += 1
                continue
            p_tok, p_feat = s.prompts[ro.prompt_id]
            n = min(L, self.max_len) - 1
            tokens = torch.cat([p_tok, torch.tensor(ro.tokens[:n], dtype=torch.long)])
            features = (p_feat, s.block[slot, :n])  # parts, copied into the ring by the put: no temporary
            entries.append(BufferEntry(
                key=f"{ro.prompt_id}/{ro.sample}", step=s.step, policy_version=ro.policy_version,
                finished=ro.finish_reason == FinishReason.STOP, prompt_len=p_tok.numel(), tokens=tokens, features=features,
            ))
        self.buffer.put_many(entries)  # one hold of the writers' lock for the call's rollouts
        self.spare.append(s.block)  # the entries are copies: the block serves a later call
        return len(entries)
