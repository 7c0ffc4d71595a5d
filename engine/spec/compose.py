"""FallbackDrafter: per row, the first drafter that proposes something wins.

Typical use: `ngram+eagle` drafts from sibling responses where a suffix matches (free, and
often long), and from the EAGLE network elsewhere. Every drafter sees every hook, so each keeps
its state current even on steps where another one's draft was used; when an earlier drafter
drafts every row, the later ones are not asked at all on that step.
"""

from __future__ import annotations

import torch

from engine.sampling import SamplingParams
from engine.spec.drafter import DraftContext, Drafter, DrafterBase, DraftShape
from engine.spec.tree import DraftTree
from engine.spec.verify import Verdict


class FallbackDrafter(DrafterBase):
    def __init__(self, drafters: list[Drafter]) -> None:
        if len(drafters) < 2:
            raise ValueError("FallbackDrafter needs at least two drafters")
        self.drafters = drafters
        self.name = "+".join(d.name for d in drafters)
        self.feature_layers = next((tuple(d.feature_layers) for d in drafters if d.feature_layers), ())
        if any(d.feature_layers and tuple(d.feature_layers) != self.feature_layers for d in drafters):
            raise ValueError("drafters in one composition must read the same target layers")
        self.wants_features = any(d.wants_features or d.feature_layers for d in drafters)
        self.wants_noise = any(d.wants_noise for d in drafters)

    def reset(self, max_batch: int, max_len: int, params: SamplingParams, limits: DraftShape) -> None:
        for d in self.drafters:
            d.reset(max_batch, max_len, params, limits)

    def admit(self, adm) -> None:
        for d in self.drafters:
            d.admit(adm)

    def update(self, verdict: Verdict, features) -> None:
        for d in self.drafters:
            d.update(verdict, features)

    def move_rows(self, src, dst) -> None:
        for d in self.drafters:
            d.move_rows(src, dst)

    def finish(self, prompt_id: str, tokens: list[int]) -> None:
        for d in self.drafters:
            d.finish(prompt_id, tokens)

    def target_changed(self) -> None:
        for d in self.drafters:
            d.target_changed()

    def stale(self) -> str | None:
        return next((s for s in (d.stale() for d in self.drafters) if s), None)

    def parts(self) -> list[Drafter]:
        return list(self.drafters)

    def propose(self, ctx: DraftContext) -> DraftTree:
        # In order, until every row has a draft: the later drafters' turn is then skipped, which
        # is an off step for them (a model drafter keeps taking in the pass's pairs through
        # update() and catches up on its next propose).
        trees = []
        for d in self.drafters:
            trees.append(d.propose(ctx))
            if d is not self.drafters[-1] and bool((trees[-1].num_nodes > 0).all()):
                trees[-1].source = torch.full((ctx.roots.shape[0],), len(trees) - 1, dtype=torch.long)
                return trees[-1]
        b = ctx.roots.shape[0]
        choice = torch.full((b,), len(trees) - 1, dtype=torch.long)
        for i in reversed(range(len(trees) - 1)):
            choice = torch.where(trees[i].num_nodes.cpu() > 0, i, choice)
        merged = merge_rows(trees, choice)
        merged.source = choice
        return merged


def merge_rows(trees: list[DraftTree], choice: torch.Tensor) -> DraftTree:
    """Row b of the result is row b of trees[choice[b]] (a chain when every tree is one or has no node)."""
    tokens, parents, q, counts = [], [], [], []
    use_q = all(t.q_logits is not None for t in trees)
    for b, i in enumerate(choice.tolist()):
        t = trees[i]
        s, e = int(t.offsets[b]), int(t.offsets[b + 1])
        tokens.append(t.tokens[s:e])
        parents.append(t.parents[s:e])
        counts.append(e - s)
        if use_q:
            q.append(t.q_logits[s:e])
    device = trees[0].tokens.device
    offsets = torch.zeros(len(counts) + 1, dtype=torch.long, device=device)
    offsets[1:] = torch.tensor(counts, device=device).cumsum(0)
    return DraftTree(torch.cat(tokens), torch.cat(parents), offsets, torch.cat(q) if use_q else None,
                     chain=all(t.chain or t.tokens.numel() == 0 for t in trees))
