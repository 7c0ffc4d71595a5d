"""PregeneratedDrafter: drafts from a pre-generated response of the row's own sample.

A request may carry, per sample index, a response generated earlier (BubbleSpec: an idle rank
pre-generated step t+1's rollouts with policy t and step t+1's noise keys, so they mostly
coincide with what the target samples now). While the row's response so far is a prefix of its
pre-generated one, the draft is the next `depth` tokens of it. After a divergence the drafter
re-aligns: it looks up the row's last `realign` tokens in the pre-generated response and, if
they occur, drafts what followed their occurrence nearest to the row's position. Rows without
a pre-generated response (or without a match) get no draft, so composed with other drafters
(`FallbackDrafter([PregeneratedDrafter(), eagle])`) those take over.

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
        for r, draft in enumerate(ctx.drafts):
            if draft is None:
                continue
            start = self._start(draft, ctx.responses[r, : generated[r]])
            cont = draft[start : start + D] if start is not None else draft[:0]
            tokens[r, : len(cont)] = cont
            lengths[r] = len(cont)
        return DraftTree.chains(tokens, lengths)

    def _start(self, draft: torch.Tensor, done: torch.Tensor) -> int | None:
        """Where in `draft` the continuation of `done` (the response so far) starts, or None."""
        g = done.shape[0]
        if g <= draft.shape[0] and torch.equal(draft[:g], done):
            return g
        k = min(self.realign, g)
        if draft.shape[0] <= k:
            return None
        hits = (draft.unfold(0, k, 1)[: draft.shape[0] - k] == done[g - k :]).all(-1).nonzero().squeeze(1)  # windows followed by a token
        if hits.numel() == 0:
            return None
        ends = hits + k
        return int(ends[(ends - g).abs().argmin()])
