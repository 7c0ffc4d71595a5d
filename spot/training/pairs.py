"""Training pairs for the EAGLE drafter, packed into fixed-length windows.

A row x_0..x_{T-1} with target features f_0..f_{T-1} gives T-1 *pairs*, one per t < T-1:

    input token    x_{t+1}      (embedded with the target's frozen embedding)
    input feature  f_t
    RoPE position  t+1          (the position of x_{t+1}, as when drafting)
    target         f_{t+1}      (regression target; its last H dims give the target's
                                 distribution of x_{t+2} through the frozen LM head)

which is what the drafter sees at decode time: the root x_{t+1} just sampled, the target's
feature of the token before it, and the task of predicting the feature that yields x_{t+2}.
The loss counts pairs whose input token is a response token (t+1 >= prompt_len); prompt pairs
are context only. Pairs of one row form a *segment*; segments are packed first-fit-decreasing
into *windows* of `window` pairs with a block-diagonal causal mask, so no pair attends across
rows. Rows with more than `window` pairs are cut into consecutive segments (a later segment
does not see the earlier ones); segments with no loss pair are dropped.

Everything is flat: all rows' tokens and features are concatenated once (`tokens [N]`,
`features [N, F]`, `offsets [R+1]`), and a window is a [W] vector of flat indices of f_t.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spot.training.records import HiddenStateRows


@dataclass
class DrafterBatch:
    tokens: torch.Tensor  # [B, W] x_{t+1}
    features: torch.Tensor  # [B, W, F] f_t
    positions: torch.Tensor  # [B, W] t+1
    targets: torch.Tensor  # [B, W, F] f_{t+1}
    loss_mask: torch.Tensor  # [B, W] bool: response pairs
    attn_mask: torch.Tensor  # [B, W, W] bool, True = attend: causal within a segment

    @property
    def num_pairs(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device, dtype: torch.dtype | None = None) -> DrafterBatch:
        """Moves the batch; `dtype` (the drafter's) applies to the features and targets only."""
        return DrafterBatch(
            self.tokens.to(device), self.features.to(device=device, dtype=dtype), self.positions.to(device),
            self.targets.to(device=device, dtype=dtype), self.loss_mask.to(device), self.attn_mask.to(device),
        )


@dataclass
class Segment:
    row: int
    start: int  # first pair index t within the row
    length: int  # pairs


def row_segments(rows: Sequence[HiddenStateRows], window: int) -> list[Segment]:
    """Each row's pairs cut into segments of at most `window`; segments without a loss pair dropped."""
    out = []
    for i, r in enumerate(rows):
        pairs = r.length - 1
        for start in range(0, pairs, window):
            n = min(window, pairs - start)
            if start + n >= r.prompt_len:  # last pair's input token x_{start+n} is a response token
                out.append(Segment(i, start, n))
    return out


def pack_first_fit(lengths: Sequence[int], window: int) -> list[list[int]]:
    """Bins of segment indices whose lengths sum to <= window (first fit, longest first)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        assert 0 < lengths[i] <= window
        b = next((j for j, r in enumerate(room) if r >= lengths[i]), None)
        if b is None:
            bins.append([])
            room.append(window)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


class PackedPairs:
    """All pairs of a set of rows, packed into windows; `batch(idx)` gathers windows into a DrafterBatch.

    `segments` and `bins` (window -> its segment indices) say which rows' pairs each window holds;
    `repacked(segments)` packs a chosen subset of segments into windows of their own over the same
    (shared) data: a pair's prediction depends only on its segment, not on its window's other
    members, so any packing of the same segments gives the same per-pair losses."""

    def __init__(self, rows: Sequence[HiddenStateRows], window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not rows:
            raise ValueError("no rows to pack")
        self.window = window
        lens = torch.tensor([r.length for r in rows])
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])  # [R+1]
        self.tokens = torch.cat([r.tokens for r in rows])  # [N]
        self.features = torch.cat([r.features for r in rows])  # [N, F]
        self.prompt_lens = [r.prompt_len for r in rows]
        self._pack(row_segments(rows, window))

    def _pack(self, segments: list[Segment]) -> None:
        window = self.window
        self.segments = segments
        self.bins = pack_first_fit([s.length for s in segments], window)
        Nw = len(self.bins)
        self.src = torch.zeros(Nw, window, dtype=torch.long)  # flat index of f_t
        self.pos = torch.zeros(Nw, window, dtype=torch.long)  # t+1
        self.seg = torch.full((Nw, window), -1, dtype=torch.long)  # segment id within the window; -1 padding
        self.loss = torch.zeros(Nw, window, dtype=torch.bool)
        for w, members in enumerate(self.bins):
            at = 0
            for k, si in enumerate(members):
                s = segments[si]
                t = torch.arange(s.start, s.start + s.length)  # pair indices within the row
                sl = slice(at, at + s.length)
                self.src[w, sl] = self.offsets[s.row] + t
                self.pos[w, sl] = t + 1
                self.seg[w, sl] = k
                self.loss[w, sl] = t + 1 >= self.prompt_lens[s.row]
                at += s.length
        self.num_pairs = int(self.loss.sum())

    def repacked(self, segments: list[Segment]) -> PackedPairs:
        """The same rows' data, not copied, in windows holding `segments` (rows indexed as here) only."""
        view = copy.copy(self)
        view._pack(segments)
        return view

    def __len__(self) -> int:
        return self.src.shape[0]

    def batch(self, idx: torch.Tensor) -> DrafterBatch:
        """idx [B] window indices -> their pairs, gathered."""
        src, seg = self.src[idx], self.seg[idx]  # [B, W]
        W = self.window
        causal = torch.ones(W, W, dtype=torch.bool).tril()  # [W, W]
        # Padding (seg -1) attends to earlier padding only: no fully masked row, no NaN.
        attn = (seg.unsqueeze(2) == seg.unsqueeze(1)) & causal  # [B, W, W]
        return DrafterBatch(
            tokens=self.tokens[src + 1], features=self.features[src], positions=self.pos[idx],
            targets=self.features[src + 1], loss_mask=self.loss[idx], attn_mask=attn,
        )
