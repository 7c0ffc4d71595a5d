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


def eagle_against_autoregressive(target, temperature: float, topk: int, **engine_kwargs) -> tuple[list[Rollout], list[Rollout]]:
    """Three random prompts x 3 samples generated autoregressively and with a random EAGLE drafter
    (a depth-4 chain or tree) by engines of EngineConfig(**engine_kwargs): (reference, speculative).
    Asserts the drafter drafted."""
    import copy

    from engine.config import EngineConfig
    from engine.engine import RolloutEngine
    from engine.sampling import SamplingParams
    from engine.spec.config import SpecConfig
    from engine.spec.eagle import EagleConfig, EagleModel
    from engine.spec.eagle_drafter import EagleDrafter
    from engine.types import Request

    g = torch.Generator().manual_seed(4)
    reqs = [Request(prompt_id=f"p{i}", prompt=torch.randint(3, 101, (3 + 2 * i,), generator=g).tolist(), n=3)
            for i in range(3)]
    params = SamplingParams(max_new_tokens=30, temperature=temperature, seed=5, stop_token_ids=(2,))

    def run(drafter=None):
        cfg = EngineConfig(max_batch=8, max_len=96, spec=SpecConfig(depth=4, topk=topk, verify_tokens=6), **engine_kwargs)
        return RolloutEngine(copy.deepcopy(target), cfg, drafter).generate(reqs, params)

    reference = run()
    torch.manual_seed(0)
    spec = run(EagleDrafter(EagleModel(EagleConfig.for_target(target.config, "eagle"), target)))
    assert spec.stats.drafted > 0
    return list(reference), list(spec)
