"""PregeneratedDrafter: drafts from the pre-generated responses of the row's request.

A request may carry, per sample index, a response generated earlier (BubbleSpec: an idle rank
pre-generated step t+1's rollouts with policy t and step t+1's noise keys, so they mostly
coincide with what the target samples now). While the row's response so far is a prefix of its
own pre-generated one, the draft is the next `depth` tokens of it. After a divergence the drafter
re-aligns by suffix match: it looks up the row's last `realign` tokens in its own pre-generated
response first, then in the request's other samples' (`DraftContext.siblings`: the same prompt,
other noise, often the same reasoning a few tokens apart), and drafts what followed the
occurrence nearest to the row's position. A row without a draft of its own re-aligns against
its siblings' the same way once it has `realign` tokens. Rows without any match get no draft,
so composed with other drafters (`FallbackDrafter([PregeneratedDrafter(), eagle])`) those take
over.

Token ids only, no state: batch compaction and resets need nothing.
"""

from __future__ import annotations

import torch

from engine.spec.drafter import DraftContext, DrafterBase
from engine.spec.ngram import SEP
from engine.spec.tree import DraftTree


class PregeneratedDrafter(DrafterBase):
    name = "pregenerated"

    def __init__(self, realign: int = 3) -> None:
        if realign < 1:
            raise ValueError(f"realign must be >= 1, got {realign}")
        self.realign = realign

    def propose(self, ctx: DraftContext) -> DraftTree:
        b, D = ctx.roots.shape[0], ctx.shape.chain_len
        device = ctx.roots.device
        tokens = torch.zeros(b, D, dtype=torch.long, device=device)
        lengths = torch.zeros(b, dtype=torch.long, device=device)
        generated = ctx.generated.tolist()
        for r in range(b):
            own = ctx.drafts[r]
            siblings = ctx.siblings[r] if r < len(ctx.siblings) else None
            if own is None and siblings is None:
                continue
            cont = self._continuation(own, siblings, ctx.responses[r, : generated[r]], D)
            tokens[r, : len(cont)] = cont
            lengths[r] = len(cont)
        return DraftTree.chains(tokens, lengths)

    def _continuation(self, own: torch.Tensor | None, siblings: torch.Tensor | None, done: torch.Tensor,
                      D: int) -> torch.Tensor:
        """Up to D tokens that follow `done` (the response so far): own draft first, then siblings'."""
        g = done.shape[0]
        if own is not None:
            if g <= own.shape[0] and torch.equal(own[:g], done):
                return own[g : g + D]
            start = self._realign(own, done)
            if start is not None:
                return own[start : start + D]
        if siblings is None or g < self.realign:  # a sibling shares no position with this row: ask for a full window
            return done[:0]
        start = self._realign(siblings, done, segments=True)
        if start is None:
            return done[:0]
        cont = siblings[start : start + D]
        cut = (cont == SEP).nonzero()
        return cont[: int(cut[0])] if cut.numel() else cont

    def _realign(self, draft: torch.Tensor, done: torch.Tensor, segments: bool = False) -> int | None:
        """Where in `draft` the row's last `realign` tokens end, nearest the row's position, or None.
        With `segments`, `draft` is several drafts joined by SEP and the position counts within each."""
        g = done.shape[0]
        k = min(self.realign, g)
        if k == 0 or draft.shape[0] <= k:
            return None
        hits = (draft.unfold(0, k, 1)[: draft.shape[0] - k] == done[g - k :]).all(-1).nonzero().squeeze(1)  # windows followed by a token
        if hits.numel() == 0:
            return None
        ends = at = hits + k
        if segments:  # the response position of each end: its offset after the SEP before it
            seps = (draft == SEP).nonzero().squeeze(1)
            starts = torch.cat([seps.new_zeros(1), seps + 1])  # [S] where each segment begins
            at = ends - starts[torch.searchsorted(starts, ends, right=True) - 1]
        return int(ends[(at - g).abs().argmin()])


def sibling_corpus(drafts: list[torch.Tensor]) -> torch.Tensor | None:
    """The request's other samples' drafts joined by SEP (no window that matches a row's tokens spans two), or None."""
    if not drafts:
        return None
    sep = drafts[0].new_full((1,), SEP)
    parts = [p for d in drafts for p in (d, sep)][:-1]
    return torch.cat(parts)
