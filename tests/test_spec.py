"""Speculative rollouts are the same tokens as autoregressive ones, for every drafter."""

from __future__ import annotations

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
from engine.spec.history import HistoryDrafter
from engine.spec.history_index import HistoryStore
from engine.spec.ngram import NgramDrafter
from engine.types import Request
from tests.spec_drafters import OracleDrafter, RandomDrafter

PARAMS = {
    "greedy": SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=(2,)),
    "T1-top-p0.9": SamplingParams(max_new_tokens=40, temperature=1.0, top_p=0.9, seed=5, stop_token_ids=(2,)),
}


def requests() -> list[Request]:
    g = torch.Generator().manual_seed(4)
    return [Request(prompt_id=f"p{i}", prompt=torch.randint(3, 101, (3 + 2 * i,), generator=g).tolist(), n=3) for i in range(4)]


@pytest.fixture(scope="module")
def target(hf_folders):
    return load_checkpoint(hf_folders["llama"], dtype=torch.float64)


def engine(target, drafter=None, **spec) -> RolloutEngine:
    cfg = EngineConfig(max_batch=8, max_len=128, spec=SpecConfig(**{"depth": 4, "topk": 1, "verify_tokens": 6, **spec}))
    return RolloutEngine(target, cfg, drafter)


def eagle(target, kind: str) -> EagleDrafter:
    torch.manual_seed(0)
    return EagleDrafter(EagleModel(EagleConfig.for_target(target.config, kind), target).double())


def history(reference) -> HistoryDrafter:
    """History drafts from the reference rollouts themselves, truncated (the rest is the target's to find)."""
    store = HistoryStore(min_match=2)
    for r in reference:
        store.add(r.prompt_id, [r.tokens[: len(r.tokens) // 2]])
    return HistoryDrafter(store)


DRAFTERS = {
    "ngram": lambda t, ref: NgramDrafter(),
    "oracle": lambda t, ref: OracleDrafter(ref),
    "random": lambda t, ref: RandomDrafter(t.config.vocab_size),
    "eagle": lambda t, ref: eagle(t, "eagle"),
    "eagle3": lambda t, ref: eagle(t, "eagle3"),
    "mtp": lambda t, ref: eagle(t, "mtp"),
    "eagle3_vllm": lambda t, ref: eagle(t, "eagle3_vllm"),
    "ngram+eagle": lambda t, ref: FallbackDrafter([NgramDrafter(), eagle(t, "eagle")]),
    "history+eagle": lambda t, ref: FallbackDrafter([history(ref), eagle(t, "eagle")]),
}


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
@pytest.mark.parametrize("name", DRAFTERS)
@pytest.mark.parametrize("topk", [1, 3], ids=["chain", "tree"])
def test_speculative_rollouts_equal_autoregressive_token_for_token(target, name, params, topk):
    if name == "oracle" and topk > 1:
        pytest.skip("the oracle proposes chains only")
    reference = engine(target).generate(requests(), params)
    spec_engine = engine(target, DRAFTERS[name](target, reference), topk=topk)
    rollouts = spec_engine.generate(requests(), params)
    assert [(r.prompt_id, r.sample) for r in rollouts] == [(r.prompt_id, r.sample) for r in reference]
    for a, b in zip(reference, rollouts):
        assert (a.prompt_id, a.sample) == (b.prompt_id, b.sample)
        assert b.tokens == a.tokens
        assert b.finish_reason == a.finish_reason
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-9)
    assert rollouts.stats.drafted > 0


def test_oracle_acceptance_length_is_depth_plus_one(target):
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=2)  # no stop: every row runs 40 tokens
    reference = engine(target).generate(requests(), params)
    spec_engine = engine(target, OracleDrafter(reference), depth=4, verify_tokens=4)
    steps = spec_engine.generate(requests(), params).steps
    # Every verify step accepts all 4 drafts plus the bonus: 40 tokens = 1 (prefill) + 8 steps
    # of 5, the last cut to 4 by max_new_tokens.
    assert all(a == 4 for r in steps for a in r.accepted)
    emitted = sorted(e for r in steps for e in r.emitted)
    assert emitted == [4] * 12 + [5] * (7 * 12)


def test_bad_drafter_accepts_little_but_changes_nothing(target):
    params = PARAMS["T1-top-p0.9"]
    reference = engine(target).generate(requests(), params)
    spec_engine = engine(target, RandomDrafter(target.config.vocab_size), topk=3, verify_tokens=8)
    out = spec_engine.generate(requests(), params)
    assert [r.tokens for r in out] == [r.tokens for r in reference]
    stats = out.stats
    assert stats.accepted < 0.2 * stats.drafted


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
def test_a_confidence_stop_shortens_chains_and_changes_no_token(target, params):
    reference = engine(target).generate(requests(), params)
    full = engine(target, eagle(target, "eagle"), depth=6, verify_tokens=6).generate(requests(), params)
    stopped = engine(target, eagle(target, "eagle"), depth=6, verify_tokens=6, min_confidence=0.5).generate(requests(), params)
    assert [r.tokens for r in stopped] == [r.tokens for r in reference]
    assert 0 < stopped.stats.drafted < full.stats.drafted
