"""The EAGLE drafter network: save / load round trip, and clear errors for bad folders."""

from __future__ import annotations

import json

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.sampling import SamplingParams, row_keys
from engine.spec.drafter import Admission, DraftContext, DraftShape
from engine.spec.eagle import EagleConfig, EagleModel
from engine.spec.eagle_drafter import EagleDrafter
from tests.conftest import make_hf_model


@pytest.fixture(scope="module")
def target(hf_folders):
    return load_checkpoint(hf_folders["llama"])


def proposals(drafter: EagleDrafter, target) -> tuple[list[int], list[int]]:
    prompt = torch.tensor([[5, 9, 14, 20, 7]])
    with torch.no_grad():
        out = target(prompt, torch.arange(5)[None], hidden_layers=drafter.feature_layers)
    feats = torch.cat([out.layer_hidden[i] for i in drafter.feature_layers] + [out.hidden], -1)
    params = SamplingParams(temperature=1.0)
    shape = DraftShape(depth=4, topk=2, verify_tokens=6)
    drafter.reset(2, 64, params, shape)
    drafter.admit(Admission(slots=torch.tensor([0]), owner=torch.tensor([0]), tokens=prompt, lengths=torch.tensor([5]),
                            features=feats, first_tokens=torch.tensor([11])))
    ctx = DraftContext(
        roots=torch.tensor([11]), positions=torch.tensor([0]), keys=row_keys(0, 0, torch.tensor([3]), torch.tensor([0])),
        responses=torch.tensor([[11]]), generated=torch.tensor([1]), prompts=[prompt[0]], prompt_ids=["p"],
        samples=torch.tensor([0]), drafts=[None], params=params, shape=shape,
    )
    tree = drafter.propose(ctx)
    return tree.tokens.tolist(), tree.parents.tolist()


def first_row_proposal(drafter: EagleDrafter, target, slots: int, topk: int) -> tuple[list[int], list[int]]:
    """Row 0's draft after admitting one prompt into `slots` slots (1: its pairs stay pending)."""
    prompt = torch.tensor([[5, 9, 14, 20, 7, 3, 12]])
    with torch.no_grad():
        out = target(prompt, torch.arange(7)[None], hidden_layers=drafter.feature_layers)
    feats = torch.cat([out.layer_hidden[i] for i in drafter.feature_layers] + [out.hidden], -1)
    params = SamplingParams(temperature=0.0)  # greedy: the draft follows the (untrained) logits, not the noise
    shape = DraftShape(depth=5, topk=topk, verify_tokens=5 if topk == 1 else 8)
    drafter.reset(2, 64, params, shape)
    drafter.admit(Admission(slots=torch.arange(slots), owner=torch.zeros(slots, dtype=torch.long), tokens=prompt,
                            lengths=torch.tensor([7]), features=feats, first_tokens=torch.full((slots,), 11)))
    if slots == 1:  # nothing to share: no drafter pass ran, the prompt's pairs wait for the first draft
        assert drafter.pend_n[0] == 7 and drafter.cache.lengths[0] == 0
    b = slots
    ctx = DraftContext(
        roots=torch.full((b,), 11), positions=torch.zeros(b, dtype=torch.long),
        keys=row_keys(0, 0, torch.full((b,), 3), torch.zeros(b, dtype=torch.long)),
        responses=torch.full((b, 1), 11), generated=torch.ones(b, dtype=torch.long), prompts=[prompt[0]] * b,
        prompt_ids=["p"] * b, samples=torch.zeros(b, dtype=torch.long), drafts=[None] * b, params=params, shape=shape,
    )
    tree = drafter.propose(ctx)
    end = int(tree.offsets[1])
    return tree.tokens[:end].tolist(), tree.parents[:end].tolist()


@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3_vllm", "mtp"])
def test_a_prompt_admitted_alone_drafts_as_when_its_pairs_run_at_admission(target, kind, topk):
    torch.manual_seed(2)
    net = EagleModel(EagleConfig.for_target(target.config, kind, draft_vocab_size=40), target, torch.arange(0, 80, 2))
    drafter = EagleDrafter(net)
    alone, shared = first_row_proposal(drafter, target, 1, topk), first_row_proposal(drafter, target, 2, topk)
    assert alone == shared and len(alone[0]) == 5 + 3 * (topk - 1)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3_vllm", "mtp"])
def test_drafter_save_then_load_gives_the_same_proposals(target, kind, tmp_path):
    torch.manual_seed(1)
    net = EagleModel(EagleConfig.for_target(target.config, kind, draft_vocab_size=40), target, torch.arange(0, 80, 2))
    net.save(tmp_path)
    names = set(json.loads((tmp_path / "config.json").read_text()))
    assert {"kind", "hidden_size", "aux_layers"} <= names
    loaded = EagleDrafter.load(tmp_path, target, expect=kind)
    assert loaded.net.vocab_ids.tolist() == list(range(0, 80, 2))
    a, b = proposals(EagleDrafter(net), target), proposals(loaded, target)
    assert a == b and len(a[0]) == 6
    assert all(t % 2 == 0 for t in a[0])  # drafts come from the draft vocabulary


def test_missing_drafter_file_is_named(target, tmp_path):
    EagleModel(EagleConfig.for_target(target.config), target).save(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        EagleDrafter.load(tmp_path, target)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        EagleDrafter.load(tmp_path / "nope", target)


def test_drafter_for_another_hidden_size_is_rejected(target, tmp_path):
    other = load_checkpoint_from(make_hf_model("llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=1), tmp_path / "t")
    EagleModel(EagleConfig.for_target(other.config), other).save(tmp_path / "d")
    with pytest.raises(ValueError, match="hidden size 32.*target has hidden size 64"):
        EagleDrafter.load(tmp_path / "d", target)


def test_drafter_kind_must_match_the_config(target, tmp_path):
    EagleModel(EagleConfig.for_target(target.config, "eagle"), target).save(tmp_path)
    with pytest.raises(ValueError, match="eagle3 but .* holds a eagle drafter"):
        EagleDrafter.load(tmp_path, target, expect="eagle3")


def load_checkpoint_from(hf_model, path):
    hf_model.save_pretrained(path)
    return load_checkpoint(path)


@pytest.mark.parametrize("draft_vocab", ["subset", "full"])
def test_a_chain_drafted_with_the_steps_noise_is_the_chain_drafted_with_its_own(target, draft_vocab):
    """DraftContext.noise (the verify pass's noise, drawn once by the step) holds, at entry d - 1,
    exactly the noise the drafter draws for its level d, on its draft vocabulary or the full one."""
    from engine.sampling import gumbel

    torch.manual_seed(3)
    ids = torch.arange(0, 80, 2) if draft_vocab == "subset" else None
    cfg = EagleConfig.for_target(target.config, "eagle", draft_vocab_size=40 if ids is not None else None)
    drafter = EagleDrafter(EagleModel(cfg, target, ids))
    prompt = torch.tensor([[5, 9, 14, 20, 7]])
    with torch.no_grad():
        feats = target(prompt, torch.arange(5)[None]).hidden
    params, D = SamplingParams(temperature=1.0), 6
    shape = DraftShape(depth=D, topk=1, verify_tokens=D)
    keys, generated = row_keys(0, 0, torch.tensor([3]), torch.tensor([0])), torch.tensor([4])
    V = target.config.vocab_size
    drafts = []
    for noise in (None, gumbel(keys.repeat_interleave(D + 1), generated + torch.arange(D + 1), V).view(1, D + 1, V)):
        drafter.reset(1, 64, params, shape)
        drafter.admit(Admission(slots=torch.tensor([0]), owner=torch.tensor([0]), tokens=prompt, lengths=torch.tensor([5]),
                                features=feats, first_tokens=torch.tensor([11])))
        ctx = DraftContext(
            roots=torch.tensor([11]), positions=generated - 1, keys=keys, responses=torch.tensor([[1, 2, 3, 11]]),
            generated=generated, prompts=[prompt[0]], prompt_ids=["p"], samples=torch.tensor([0]), drafts=[None],
            params=params, shape=shape, noise=noise,
        )
        drafts.append(drafter.propose(ctx).tokens.tolist())
    assert drafts[0] == drafts[1] and len(drafts[0]) == D


@pytest.mark.parametrize("reference", [False, True], ids=["compiled", "python"])
def test_a_verified_chain_prefix_keeps_its_draft_entries_and_only_the_rest_waits_for_catch_up(target, reference):
    from engine.spec.verify import Verdict

    torch.manual_seed(2)
    drafter = EagleDrafter(EagleModel(EagleConfig.for_target(target.config), target), reference=reference)
    prompt = torch.tensor([[5, 9, 14, 20, 7, 3, 12]])
    with torch.no_grad():
        out = target(prompt, torch.arange(7)[None], hidden_layers=drafter.feature_layers)
    feats = torch.cat([out.layer_hidden[i] for i in drafter.feature_layers] + [out.hidden], -1)
    params, shape = SamplingParams(temperature=0.0), DraftShape(depth=4, topk=1, verify_tokens=4)
    drafter.reset(2, 64, params, shape)
    drafter.admit(Admission(slots=torch.arange(2), owner=torch.zeros(2, dtype=torch.long), tokens=prompt,
                            lengths=torch.tensor([7]), features=feats, first_tokens=torch.full((2,), 11)))
    ctx = DraftContext(
        roots=torch.full((2,), 11), positions=torch.zeros(2, dtype=torch.long),
        keys=row_keys(0, 0, torch.full((2,), 3), torch.zeros(2, dtype=torch.long)), responses=torch.full((2, 1), 11),
        generated=torch.ones(2, dtype=torch.long), prompts=[prompt[0]] * 2, prompt_ids=["p"] * 2,
        samples=torch.zeros(2, dtype=torch.long), drafts=[None] * 2, params=params, shape=shape,
    )
    drafted = drafter.propose(ctx).tokens.view(2, 4)
    lengths = drafter.cache.lengths[:2].clone()  # after the catch-up: nothing pending
    assert drafter.pend_n[:2].tolist() == [0, 0]
    # Row 0 verified the chain's first 2 tokens, then a bonus 7; row 1's first token is not the
    # chain's (another drafter's draft in a composition): it keeps nothing.
    tokens = torch.stack([torch.cat([drafted[0, :2], torch.tensor([7, 0, 0])]),
                          torch.cat([(drafted[1, :1] + 1) % 40, drafted[1, 1:2], torch.tensor([7, 0, 0])])])
    two = torch.tensor([2, 2])
    verdict = Verdict(accepted=torch.zeros(2, 4, dtype=torch.bool), num_accepted=two, last_index=two,
                      path=torch.tensor([[0, 1, -1, -1]] * 2), tokens=tokens, num_emitted=two + 1, chain=True)
    features = torch.randn(2, 5, feats.shape[-1])
    drafter.update(verdict, features)
    assert drafter.cache.lengths[:2].tolist() == [int(lengths[0]) + 2, int(lengths[1])]
    assert drafter.pend_n[:2].tolist() == [1, 3]  # row 0: only the bonus pair; row 1: all three
    assert drafter.pend_tok[0, 0] == 7 and torch.equal(drafter.pend_feat[0, 0], features[0, 2])
    assert torch.equal(drafter.pend_tok[1, :3], tokens[1, :3]) and torch.equal(drafter.pend_feat[1, :3], features[1, :3])
