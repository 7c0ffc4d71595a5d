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
from engine.spec.tree import DraftTree


class PregeneratedDrafter(DrafterBase):
    name = "pregenerated"

    def __init__(self, realign: int = 3) -> None:
        if realign < 1:
            raise ValueError(f"realign must be >= 1, got {realign}")
        self.realign = realign

    def propose(self, ctx: DraftContext) -> DraftTree:
        b, D = ctx.roots.shape[0], min(ctx.shape.depth, ctx.shape.verify_tokens)
        device = ctx.roots.device
        tokens = torch.zeros(b, D, dtype=torch.long, device=device)
        lengths = torch.zeros(b, dtype=torch.long, device=device)
        generated = ctx.generated.tolist()
        for r in range(b):
            own = ctx.drafts[r] if r < len(ctx.drafts) else None
            siblings = ctx.siblings[r] if r < len(ctx.siblings) else ()
            if own is None and not siblings:
                continue
            cont = self._continuation(own, siblings, ctx.responses[r, : generated[r]], D)
            tokens[r, : len(cont)] = cont
            lengths[r] = len(cont)
        return DraftTree.chains(tokens, lengths)

    def _continuation(self, own: torch.Tensor | None, siblings: tuple[torch.Tensor, ...], done: torch.Tensor,
                      D: int) -> torch.Tensor:
        """Up to D tokens that follow `done` (the response so far): own draft first, then siblings'."""
        g = done.shape[0]
        if own is not None and g <= own.shape[0] and torch.equal(own[:g], done):
            return own[g : g + D]
        for i, draft in enumerate((own, *siblings) if own is not None else siblings):
            sibling = own is None or i > 0
            if sibling and g < self.realign:  # a sibling shares no position with this row: ask for a full window
                continue
            start = self._realign(draft, done)
            if start is not None:
                return draft[start : start + D]
        return done[:0]

    def _realign(self, draft: torch.Tensor, done: torch.Tensor) -> int | None:
        """Where in `draft` the row's last `realign` tokens end (nearest the row's position), or None."""
        g = done.shape[0]
        k = min(self.realign, g)
        if k == 0 or draft.shape[0] <= k:
            return None
        hits = (draft.unfold(0, k, 1)[: draft.shape[0] - k] == done[g - k :]).all(-1).nonzero().squeeze(1)  # windows followed by a token
        if hits.numel() == 0:
            return None
        ends = hits + k
        return int(ends[(ends - g).abs().argmin()])
