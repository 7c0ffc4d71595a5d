"""The engine's weight handles: load_weights serves exactly the loaded weights, in-place changes
behind its back are refused, bad input is named, and the drafter follows the target."""

from __future__ import annotations

import re

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.sampling import SamplingParams
from engine.spec.compose import FallbackDrafter
from engine.spec.config import SpecConfig
from engine.spec.eagle import EagleConfig, EagleModel
from engine.spec.eagle_drafter import EagleDrafter
from engine.spec.ngram import NgramDrafter
from engine.types import Request
from tests.conftest import FAMILIES, make_hf_model

PARAMS = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, stop_token_ids=(2,))
SPEC = SpecConfig(depth=3, topk=2, verify_tokens=4)


def requests() -> list[Request]:
    return [Request(prompt_id="a", prompt=[5, 9, 17, 4], n=2), Request(prompt_id="b", prompt=[8, 3, 30], n=2)]


def engine(model, drafter=None) -> RolloutEngine:
    return RolloutEngine(model, EngineConfig(max_batch=4, max_len=64, spec=SPEC), drafter)


def outputs(batch) -> list[tuple]:
    return [(r.prompt_id, r.sample, r.tokens, r.logprobs, r.finish_reason) for r in batch]


def records(batch) -> list[tuple]:
    return [(s.batch_size, s.shape, s.drafted, s.accepted, s.emitted) for s in batch.steps]


def new_weights(family: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """Another random model's state dict, by Hugging Face name."""
    return make_hf_model(family, seed=seed).state_dict()


def model_with(folder, state: dict[str, torch.Tensor]):
    """The checkpoint in `folder` with `state` loaded into it the plain PyTorch way."""
    model = load_checkpoint(folder)
    with torch.no_grad():
        missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)  # a tied head may be left out
    return model


def eagle_net(target, seed: int = 0) -> EagleModel:
    torch.manual_seed(seed)
    return EagleModel(EagleConfig.for_target(target.config), target)


def eagle_state(target, seed: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in eagle_net(target, seed).state_dict().items() if k != "draft_vocab"}


# -- load_weights serves the loaded weights ------------------------------------------------
@pytest.mark.parametrize("form", ["state_dict", "named_parameters"])
@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_weights_generate_exactly_what_a_fresh_engine_of_them_does(hf_folders, family, form):
    e = engine(load_checkpoint(hf_folders[family]))
    before = e.generate(requests(), PARAMS)
    other = make_hf_model(family, seed=1)
    e.load_weights(other.state_dict() if form == "state_dict" else other.named_parameters(), version=3)
    got = e.generate(requests(), PARAMS)
    want = engine(model_with(hf_folders[family], other.state_dict())).generate(requests(), PARAMS)
    assert outputs(got) == outputs(want)  # tokens and logprobs bit for bit
    assert [r.tokens for r in got] != [r.tokens for r in before]  # the new weights are served, not the old ones
    assert got.policy_version == 3 and {r.policy_version for r in got} == {3} and e.version == 3
    assert {r.policy_version for r in before} == {0}


@pytest.mark.parametrize("with_head", [True, False], ids=["with-lm_head", "without-lm_head"])
def test_a_tied_model_takes_the_state_dict_with_or_without_its_lm_head(hf_folders, with_head):
    e = engine(load_checkpoint(hf_folders["llama"]))
    assert e.model.config.tie_word_embeddings
    state = new_weights("llama")
    if with_head:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    else:
        state.pop("lm_head.weight", None)
    e.load_weights(state, version=1)
    assert torch.equal(e.model.lm_head.weight, state["model.embed_tokens.weight"])
    want = engine(model_with(hf_folders["llama"], new_weights("llama"))).generate(requests(), PARAMS)
    assert outputs(e.generate(requests(), PARAMS)) == outputs(want)


# -- in-place changes are refused -----------------------------------------------------------
DOWN = "model.layers.1.mlp.down_proj.weight"


def _mul(model):
    with torch.no_grad():
        dict(model.named_parameters())[DOWN].mul_(1.5)


def _data_copy(model):
    p = dict(model.named_parameters())[DOWN]
    p.data.copy_(torch.randn_like(p))  # autograd does not count this one


def _data_swap(model):
    p = dict(model.named_parameters())[DOWN]
    p.data = torch.randn_like(p)  # new storage, no version bump: the old one stays where the engine sampled it


def _one_value(model):
    p = dict(model.named_parameters())[DOWN]
    p.data[(0,) * p.dim()] += 1.0  # one sampled element (the first, row-major), by one


def _load_state_dict(model):
    model.load_state_dict(new_weights("llama"), strict=False)


def _optimizer_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.enable_grad():
        out = model(torch.tensor([[5, 9, 17]]), torch.arange(3)[None])
        out.logits.logsumexp(-1).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


IN_PLACE = {"mul_": (_mul, DOWN), "data.copy_": (_data_copy, DOWN), "data swapped": (_data_swap, DOWN),
            "one value": (_one_value, DOWN), "load_state_dict": (_load_state_dict, None),
            "optimizer.step": (_optimizer_step, None)}


@pytest.mark.parametrize("change", IN_PLACE)
def test_weights_changed_in_place_are_refused_not_served_stale(hf_folders, change):
    model = load_checkpoint(hf_folders["llama"])
    e = engine(model)
    e.generate(requests(), PARAMS)
    update, name = IN_PLACE[change]
    update(model)
    named = re.escape(name) if name else "[^']+"
    with pytest.raises(ValueError, match=rf"weight '{named}' changed in place.*load_weights"):
        e.generate(requests(), PARAMS)
    # Loading the weights the model now has serves them, as a fresh engine of them would.
    e.load_weights(model.state_dict(), version=1)
    fresh = engine(model_with(hf_folders["llama"], {k: v.clone() for k, v in model.state_dict().items()}))
    assert outputs(e.generate(requests(), PARAMS)) == outputs(fresh.generate(requests(), PARAMS))


def test_a_drafter_weight_changed_in_place_is_refused(hf_folders):
    target = load_checkpoint(hf_folders["llama"])
    drafter = EagleDrafter(eagle_net(target))
    e = engine(target, drafter)
    with torch.no_grad():
        drafter.net.fc.weight.mul_(2.0)
    with pytest.raises(ValueError, match=r"weight 'fc.weight' changed in place.*load_drafter_weights"):
        e.generate(requests(), PARAMS)


# -- bad input ------------------------------------------------------------------------------
def _unknown(state):
    state["model.layers.9.mlp.down_proj.weight"] = state[DOWN]
    return state, r"'model.layers.9.mlp.down_proj.weight' is not a weight of this model"


def _wrong_shape(state):
    state[DOWN] = state[DOWN][:, :-1]
    return state, rf"'{DOWN}' has shape \(64, 159\), the model's is \(64, 160\)"


def _missing(state):
    del state[DOWN]
    return state, rf"1 weights were not given, e\.g\. \['{DOWN}'\]; send the full state dict"


BAD = {"unknown name": _unknown, "wrong shape": _wrong_shape, "missing": _missing}


@pytest.mark.parametrize("bad", BAD)
def test_bad_weights_are_named_and_a_half_loaded_model_is_never_served(hf_folders, bad):
    e = engine(load_checkpoint(hf_folders["llama"]))
    state, message = BAD[bad](dict(new_weights("llama")))
    with pytest.raises(ValueError, match=message):
        e.load_weights(state, version=1)
    assert e.version == 0
    # Weights copied before the error changed the model: generate refuses until a full load.
    with pytest.raises(ValueError, match="changed in place"):
        e.generate(requests(), PARAMS)
    e.load_weights(new_weights("llama"), version=1)
    assert e.generate(requests(), PARAMS).policy_version == 1


def test_version_going_backwards_is_refused(hf_folders):
    e = engine(load_checkpoint(hf_folders["llama"]))
    e.load_weights(new_weights("llama"), version=5)
    e.load_weights(new_weights("llama", seed=2), version=5)  # the same version again is fine
    with pytest.raises(ValueError, match="version 4 is older than the served version 5"):
        e.load_weights(new_weights("llama"), version=4)
    assert e.version == 5


# -- the drafter follows ----------------------------------------------------------------------
def test_after_load_weights_the_drafter_reads_the_new_head(hf_folders):
    target = load_checkpoint(hf_folders["qwen2"])  # untied: the head is its own weight
    drafter = EagleDrafter(eagle_net(target))
    e = engine(target, drafter)
    e.load_weights(new_weights("qwen2"), version=1)
    fresh_target = model_with(hf_folders["qwen2"], new_weights("qwen2"))
    fresh = EagleDrafter(eagle_net(fresh_target))
    assert torch.equal(drafter.net.head_t, fresh_target.lm_head.weight.t())
    pred = torch.randn(5, fresh.net.config.feature_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(drafter.rt.logits(pred), fresh.rt.logits(pred))
    got = e.generate(requests(), PARAMS)
    want = engine(fresh_target, fresh).generate(requests(), PARAMS)
    assert outputs(got) == outputs(want) and records(got) == records(want)


def composed(drafter: EagleDrafter, compose: bool):
    return FallbackDrafter([NgramDrafter(), drafter]) if compose else drafter


@pytest.mark.parametrize("compose", [False, True], ids=["eagle", "ngram+eagle"])
def test_loaded_drafter_weights_draft_as_a_fresh_drafter_of_them(hf_folders, compose):
    target = load_checkpoint(hf_folders["llama"])
    drafter = EagleDrafter(eagle_net(target, seed=0))
    e = engine(target, composed(drafter, compose))
    before = e.generate(requests(), PARAMS)
    state = eagle_state(target, seed=7)
    e.load_drafter_weights(state, version=2)
    assert drafter.version == 2
    got = e.generate(requests(), PARAMS)
    fresh = engine(load_checkpoint(hf_folders["llama"]), composed(EagleDrafter(eagle_net(target, seed=7)), compose))
    fresh.generate(requests(), PARAMS)  # the same history: an n-gram drafter remembers this step's finished rollouts
    want = fresh.generate(requests(), PARAMS)
    assert records(got) == records(want) and outputs(got) == outputs(want)
    assert records(got) != records(before)  # the new drafter drafts differently
    assert [r.tokens for r in got] == [r.tokens for r in before]  # and the target's tokens stay


def test_bad_drafter_weights_are_named(hf_folders):
    target = load_checkpoint(hf_folders["llama"])
    e = engine(target, EagleDrafter(eagle_net(target)))
    state = eagle_state(target, seed=1)
    with pytest.raises(ValueError, match=r"drafter weight 'fc.weight' has shape \(64, 64\)"):
        e.load_drafter_weights({**state, "fc.weight": state["fc.weight"][:, :64]}, version=1)
    with pytest.raises(ValueError, match=r"drafter weight 'fc.bias' does not exist"):
        e.load_drafter_weights({**state, "fc.bias": torch.zeros(64)}, version=1)
    with pytest.raises(ValueError, match="engine has 0 drafters with weights"):
        engine(target).load_drafter_weights(state, version=1)
    with pytest.raises(ValueError, match="engine has 0 drafters with weights"):
        engine(target, NgramDrafter()).load_drafter_weights(state, version=1)
    with pytest.raises(ValueError, match="the ngram drafter has no weights to load"):
        NgramDrafter().load_weights(state.items(), version=1)


def test_a_composition_declares_its_parts_and_their_one_network(hf_folders):
    target = load_checkpoint(hf_folders["llama"])
    eagle, ngram = EagleDrafter(eagle_net(target)), NgramDrafter()
    both = FallbackDrafter([ngram, eagle])
    assert both.parts() == [ngram, eagle] and eagle.parts() == [eagle]
    assert ngram.network() is None and eagle.network() is eagle.net
    assert engine(target, both).drafter_nets() == [eagle.net]
    assert engine(target, ngram).drafter_nets() == [] and engine(target).drafter_nets() == []


def test_a_drafter_attached_later_speculates_without_changing_tokens(hf_folders):
    target = load_checkpoint(hf_folders["llama"])
    e = engine(target)
    plain = e.generate(requests(), PARAMS)
    e.attach_drafter(EagleDrafter(eagle_net(target)))
    spec = e.generate(requests(), PARAMS)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert [r.finish_reason for r in spec] == [r.finish_reason for r in plain]
    assert spec.stats.drafted > 0 and plain.stats.drafted == 0


def test_two_engines_on_one_model_both_serve(hf_folders):
    model = load_checkpoint(hf_folders["qwen2"])
    first = engine(model)
    second = engine(model)  # packs the same model again: the packed storage is reused, nothing is stale
    a, b = first.generate(requests(), PARAMS), second.generate(requests(), PARAMS)
    assert outputs(a) == outputs(b)
    # Both read the one model: weights loaded through one are stale for the other, never served by it.
    second.load_weights(new_weights("qwen2"), version=1)
    with pytest.raises(ValueError, match="changed in place"):
        first.generate(requests(), PARAMS)
    want = engine(model_with(hf_folders["qwen2"], new_weights("qwen2"))).generate(requests(), PARAMS)
    assert outputs(second.generate(requests(), PARAMS)) == outputs(want)
