"""Compiled tree drafts (engine.kernels.eagle_tree): the same trees as the Python expansion, and
speculative rollouts through them equal autoregressive ones."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.kernels import eagle_tree as tree_kernel
from engine.kernels.library import available
from engine.runtime import TargetRuntime
from engine.sampling import SamplingParams, row_keys
from engine.spec.config import SpecConfig
from engine.spec.drafter import Admission, DraftContext, DraftShape
from engine.spec.eagle import EagleConfig, EagleModel
from engine.spec.eagle_drafter import EagleDrafter
from engine.types import Request

OK, WHY = available()
pytestmark = pytest.mark.skipif(not OK, reason=f"CPU kernels unavailable here: {WHY}")


@pytest.fixture(scope="module")
def runtime(hf_folders):
    return TargetRuntime(load_checkpoint(hf_folders["llama"]))


def sharp_drafter(target, kind: str, draft_vocab: bool) -> EagleModel:
    torch.manual_seed(4)
    vd = 40 if draft_vocab else target.config.vocab_size
    ids = torch.arange(0, 80, 2) if draft_vocab else None
    net = EagleModel(EagleConfig.for_target(target.config, kind, draft_vocab_size=vd), target, ids)
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(3.0)  # sharper drafts: coupled samples that differ from the top alternatives
    return net


def admitted(runtime, net, params, shape, lengths: list[int], pending: list[int] | None = None,
             products: int = 0, reference: bool = False) -> EagleDrafter:  # products: EagleRuntime.products
    """A drafter with rows of prompts of different lengths admitted, and then `pending` pairs
    waiting per row (as after verifications that accepted different numbers of tokens)."""
    P = max(lengths)
    prompt = torch.tensor([[5, 9, 14, 20, 7, 3, 8], [4, 4, 8, 1, 3, 2, 6], [7, 1, 2, 9, 9, 5, 4]])[: len(lengths), :P]
    with torch.no_grad():
        out = runtime(prompt, torch.arange(P).expand(len(lengths), P), hidden_layers=tuple(net.config.aux_layers))
    feats = torch.cat([out.layer_hidden[i] for i in net.config.aux_layers] + [out.hidden], -1)
    drafter = EagleDrafter(net, bf16_weights=products == 1, bf16_products=products == 2, reference=reference)
    drafter.reset(len(lengths), 64, params, shape)
    b = len(lengths)
    drafter.admit(Admission(slots=torch.arange(b), owner=torch.arange(b), tokens=prompt, lengths=torch.tensor(lengths),
                            features=feats, first_tokens=torch.tensor([11, 12, 13][:b])))
    if pending is not None:
        g = torch.Generator().manual_seed(7)
        W = max(pending)
        drafter.pend_tok[:b, 1:W] = torch.randint(3, 100, (b, W - 1), generator=g)
        drafter.pend_feat[:b, 1:W] = torch.randn(b, W - 1, feats.shape[-1], generator=g)
        drafter.pend_n[:b] = torch.tensor(pending)
    return drafter


def context(params, shape, b: int) -> DraftContext:
    roots = torch.tensor([11, 12, 13][:b])
    return DraftContext(
        roots=roots, positions=torch.tensor([0, 3, 1][:b]), keys=row_keys(0, 0, torch.tensor([3, 4, 5][:b]), torch.zeros(b, dtype=torch.long)),
        responses=roots.unsqueeze(1), generated=torch.ones(b, dtype=torch.long), prompts=[], prompt_ids=["a", "b", "c"][:b],
        samples=torch.zeros(b, dtype=torch.long), drafts=[None] * b, params=params, shape=shape,
    )


def proposal(drafter: EagleDrafter, ctx: DraftContext) -> dict[str, list]:
    tree = drafter.propose(ctx)
    cache = drafter.cache
    b = ctx.roots.shape[0]
    return {"tokens": tree.tokens.tolist(), "parents": tree.parents.tolist(), "offsets": tree.offsets.tolist(),
            "lengths": cache.lengths[:b].tolist(), "q": tree.q_logits}


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("draft_vocab", [True, False])
@pytest.mark.parametrize("products", [0, 1, 2], ids=["fp32", "bf16-weights", "bf16-products"])
def test_compiled_tree_proposes_what_the_python_expansion_proposes(runtime, kind, temperature, draft_vocab, products):
    net = sharp_drafter(runtime.model, kind, draft_vocab)
    params = SamplingParams(temperature=temperature)
    for shape, pending in ((DraftShape(depth=4, topk=3, verify_tokens=12), [3, 1, 2]),
                           (DraftShape(depth=3, topk=2, verify_tokens=50), None)):
        lengths = [7, 4, 6]  # rows of different lengths
        compiled_drafter = admitted(runtime, net, params, shape, lengths, pending, products)
        assert compiled_drafter.draft_tree == compiled_drafter._tree_compiled
        compiled = proposal(compiled_drafter, context(params, shape, 3))
        python_drafter = admitted(runtime, net, params, shape, lengths, pending, products, reference=True)
        assert python_drafter.draft_tree == python_drafter._tree_reference
        python = proposal(python_drafter, context(params, shape, 3))
        assert compiled == python
        n = min(shape.verify_tokens, tree_kernel.pool_size(shape.depth, shape.topk))
        assert compiled["offsets"] == [0, n, 2 * n, 3 * n]
        assert len(set(compiled["tokens"])) > shape.topk  # not a degenerate tree
        # The catch-up wrote the same committed cache slots.
        for row, L in enumerate(compiled["lengths"]):
            torch.testing.assert_close(compiled_drafter.cache.k[0, row, :, :L], python_drafter.cache.k[0, row, :, :L],
                                       rtol=1e-4, atol=1e-5)


def test_trees_with_iid_children_or_top_p_stay_on_the_python_path(runtime):
    net = sharp_drafter(runtime.model, "eagle", True)
    shape = DraftShape(depth=3, topk=2, verify_tokens=6)
    drafter = admitted(runtime, net, SamplingParams(temperature=1.0, top_p=0.9), shape, [5, 5])
    assert (drafter.draft_chain, drafter.draft_tree) == (drafter._chain_reference, drafter._tree_reference)
    iid = DraftShape(depth=3, topk=2, verify_tokens=6, iid_children=True)
    drafter = admitted(runtime, net, SamplingParams(temperature=1.0), iid, [5, 5])
    assert drafter.draft_tree == drafter._tree_reference
    tree = drafter.propose(context(drafter.params, iid, 2))
    assert tree.q_logits is not None  # rejection verification still gets q from the Python path


def test_the_draft_path_is_chosen_at_reset_for_the_runs_sampling(runtime):
    drafter = EagleDrafter(sharp_drafter(runtime.model, "eagle", True))
    assert drafter.draft_tree is None  # nothing to choose before a run's sampling is known
    shape = DraftShape(depth=3, topk=2, verify_tokens=6)
    compiled = (drafter._chain_compiled, drafter._tree_compiled)
    reference = (drafter._chain_reference, drafter._tree_reference)
    for params, paths in ((SamplingParams(temperature=1.0), compiled), (SamplingParams(temperature=1.0, top_k=5), reference),
                          (SamplingParams(temperature=0.0, top_k=5), compiled)):  # greedy: a mask changes no argmax
        drafter.reset(2, 64, params, shape)
        assert (drafter.draft_chain, drafter.draft_tree) == paths


def rollout_requests() -> list[Request]:
    g = torch.Generator().manual_seed(4)
    return [Request(prompt_id=f"p{i}", prompt=torch.randint(3, 101, (3 + 2 * i,), generator=g).tolist(), n=2) for i in range(3)]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rollouts_through_compiled_trees_equal_autoregressive_token_for_token(hf_folders, kind, temperature, monkeypatch):
    target = load_checkpoint(hf_folders["llama"])  # float32: the kernels' dtype
    params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=3, stop_token_ids=(2,))
    cfg = EngineConfig(max_batch=8, max_len=96, spec=SpecConfig(depth=4, topk=3, verify_tokens=8))
    reference = RolloutEngine(target, EngineConfig(max_batch=8, max_len=96)).generate(rollout_requests(), params)
    calls = []
    real = tree_kernel.draft
    monkeypatch.setattr(tree_kernel, "draft", lambda *a, **k: calls.append(1) or real(*a, **k))
    drafter = EagleDrafter(sharp_drafter(target, kind, draft_vocab=True))
    rollouts = RolloutEngine(target, cfg, drafter).generate(rollout_requests(), params)
    assert calls and rollouts.stats.drafted > 0
    for a, b in zip(reference, rollouts, strict=True):
        assert (a.prompt_id, a.sample) == (b.prompt_id, b.sample)
        assert b.tokens == a.tokens
        assert b.finish_reason == a.finish_reason
