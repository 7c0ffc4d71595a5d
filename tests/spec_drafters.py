"""Drafters for tests: an oracle that knows the target's samples, and a random one."""

from __future__ import annotations

import torch

from engine.spec.drafter import DraftContext, DrafterBase
from engine.spec.tree import DraftTree
from engine.types import Rollout


class OracleDrafter(DrafterBase):
    """Proposes the next `depth` tokens of a reference rollout whose prefix matches the row."""

    name = "oracle"

    def __init__(self, reference: list[Rollout]) -> None:
        self.reference: dict[str, list[list[int]]] = {}
        for r in reference:
            self.reference.setdefault(r.prompt_id, []).append(r.tokens)

    def propose(self, ctx: DraftContext) -> DraftTree:
        b, D = ctx.roots.shape[0], min(ctx.shape.depth, ctx.shape.verify_tokens)
        tokens = torch.zeros(b, D, dtype=torch.long)
        lengths = torch.zeros(b, dtype=torch.long)
        for r in range(b):
            g = int(ctx.generated[r])
            done = ctx.responses[r, :g].tolist()
            for ref in self.reference.get(ctx.prompt_ids[r], []):
                if ref[:g] == done:
                    cont = ref[g : g + D]
                    tokens[r, : len(cont)] = torch.tensor(cont, dtype=torch.long)
                    lengths[r] = len(cont)
                    break
        return DraftTree.chains(tokens, lengths)


class RandomDrafter(DrafterBase):
    """A deliberately bad drafter: random distinct tokens, as a chain or a random tree."""

    name = "random"

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab, self.g = vocab, torch.Generator().manual_seed(seed)

    def propose(self, ctx: DraftContext) -> DraftTree:
        b, n = ctx.roots.shape[0], ctx.shape.verify_tokens
        tokens = torch.randint(0, self.vocab, (b, n), generator=self.g)
        if ctx.shape.topk == 1:
            return DraftTree.chains(tokens[:, : ctx.shape.depth])
        # Node i hangs under a random earlier node or the root; siblings made distinct by value.
        parents = torch.stack([torch.randint(-1, max(i, 0), (b,), generator=self.g) if i else torch.full((b,), -1) for i in range(n)], 1)
        tokens = (torch.arange(n) * 7 + tokens[:, :1]) % self.vocab  # distinct within a row
        return DraftTree.from_padded(tokens, parents, torch.ones(b, n, dtype=torch.bool))
