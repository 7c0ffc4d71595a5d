"""The cost tuner: pass-cost tables, the acceptance model, choices that never pick a predicted loss, state, engine use."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine.spec.cost_policy import Acceptance, CostPolicy, expected_emitted, predict
from engine.spec.drafter import DraftShape
from engine.spec.pass_costs import PassCosts, grid
from engine.types import StepRecord

D1 = DraftShape(depth=1, topk=1, verify_tokens=1)
D4 = DraftShape(depth=4, topk=1, verify_tokens=4)


def record(b: int, shape: DraftShape | None, drafted: list[int], accepted: list[int], seconds: float = 0.1,
           source: list[int] | None = None) -> StepRecord:
    emitted = [a + 1 for a in accepted]
    return StepRecord(index=0, batch_size=b, shape=shape.label if shape else "off", drafted=drafted, accepted=accepted,
                      emitted=emitted, context_mean=100.0, draft_s=0.0, forward_s=seconds, other_s=0.0, source=source)


def test_the_table_reproduces_its_grid_and_interpolates_between_points():
    c = PassCosts.make_dummy(fixed=0.05, per_token=0.002)
    for b in c.rows:
        for t in c.entries:
            assert c(b, t) == pytest.approx(0.05 + 0.002 * b * t)
    # bilinear between grid points of a product b * t: exact at the corners, between them elsewhere
    assert c(8, 1) < c(12, 1) < c(16, 1)
    assert c(12, 4) == pytest.approx(0.05 + 0.002 * ((8 * 3 + 8 * 5) / 2 + (16 * 3 + 16 * 5) / 2) / 2)
    assert c(64, 1) == pytest.approx(0.05 + 0.002 * 64)  # linear past the grid's edge


@pytest.mark.parametrize("rows,entries", [((2, 1), (1, 2)), ((1, 2), (2, 3)), ((1,), ())])
def test_a_bad_table_is_refused(rows, entries):
    with pytest.raises(ValueError, match="PassCosts"):
        PassCosts(rows, entries, tuple(tuple(1.0 for _ in entries) for _ in rows))


def test_the_grid_spans_the_engine_sizes():
    assert grid(32, 9) == ((1, 2, 4, 8, 16, 32), (1, 2, 3, 5, 9))
    assert grid(24, 7) == ((1, 2, 4, 8, 16, 24), (1, 2, 3, 5, 7))


def test_expected_emitted_is_the_geometric_sum():
    assert expected_emitted(0.0, 8) == 1.0
    assert expected_emitted(1.0, 8) == 9.0
    assert expected_emitted(0.5, 2) == pytest.approx(1.75)
    with pytest.raises(ValueError):
        expected_emitted(1.5, 2)


def test_acceptance_counts_accepted_prefixes_and_first_rejections_per_source():
    a = Acceptance(prior=0.5, weight=0.0)
    # source 0 accepts 3 of 4 (one rejection), source 1 accepts all 4 (no rejection); a row without a draft
    a.add(record(3, D4, drafted=[4, 4, 0], accepted=[3, 4, 0], source=[0, 1, 0]))
    assert a.sources[0].accepted == 3 and a.sources[0].rejected == 1
    assert a.sources[1].accepted == 4 and a.sources[1].rejected == 0
    assert a.plain_rows == 1
    e = a.emitted(4)
    assert e == pytest.approx((expected_emitted(0.75, 4) + expected_emitted(0.98, 4) + 1.0) / 3)  # alpha capped at 0.98


def test_off_is_chosen_where_no_draft_can_pay_and_a_draft_where_it_does():
    """On a CPU-like table (a pass costs per row x entry past a few rows) with drafts that accept
    every other token, one draft token pays at batch 1 and loses at batch 32."""
    costs = PassCosts.make_dummy(fixed=0.07, per_token=0.003)
    policy = CostPolicy([None, D1, D4], costs, epsilon=0.0, prior=0.5)
    policy.acceptance.weight = 1e6  # hold alpha at the prior
    assert policy.choose(32, None) is None
    assert policy.choose(1, None) is not None
    for b in (1, 2, 4, 8, 16, 32):  # whatever it chooses is predicted at least as fast as off
        arm = policy.choose(b, None)
        off = predict(b, None, costs, policy.acceptance, 1.0, 1.0, 0.0)
        assert arm is None or predict(b, arm, costs, policy.acceptance, 1.0, 1.0, 0.0) > off


def test_measured_acceptance_moves_the_choice():
    costs = PassCosts.make_dummy(fixed=0.07, per_token=0.003)
    policy = CostPolicy([None, D4], costs, epsilon=0.0, prior=0.5)
    assert policy.choose(8, None) is None  # alpha 0.5 does not pay at 8 rows x 5 entries
    for _ in range(30):  # drafts that the target accepts in full
        policy.pending = D4
        policy._credit(record(8, D4, drafted=[4] * 8, accepted=[4] * 8, seconds=costs(8, 5)))
    assert policy.acceptance.alpha() > 0.9
    assert policy.choose(8, None) == D4
    for _ in range(200):  # the drafts stop matching: back to off
        policy.pending = D4
        policy._credit(record(8, D4, drafted=[4] * 8, accepted=[0] * 8, seconds=costs(8, 5)))
    assert policy.choose(8, None) is None


def test_exploration_never_runs_an_arm_that_cannot_win_even_when_optimistic():
    costs = PassCosts.make_dummy(fixed=0.001, per_token=0.01)  # no fixed cost: every entry costs as much as a step
    policy = CostPolicy([None, D1, D4], costs, epsilon=1.0, prior=0.5)
    assert all(policy.choose(b, None) is None for b in (1, 4, 32) for _ in range(20))
    assert policy.explored == 0


def test_exploration_is_bounded_by_epsilon():
    costs = PassCosts.make_dummy(fixed=0.07, per_token=0.003)
    policy = CostPolicy([None, D4], costs, epsilon=0.1, prior=0.3, seed=1)
    chosen = [policy.choose(4, None) for _ in range(2000)]  # off predicted best; optimism says the draft may pay
    share = sum(c is not None for c in chosen) / len(chosen)
    assert policy.explored == sum(c is not None for c in chosen)
    assert 0.05 < share < 0.15


def test_state_round_trips_through_json_and_continues_the_same_choices():
    costs = PassCosts.make_dummy()
    a = CostPolicy([None, D1, D4], costs, epsilon=0.2, seed=3)
    last = None
    for b in (32, 16, 8, 4, 2, 1):
        arm = a.choose(b, last)
        last = record(b, arm, drafted=[arm.chain_len if arm else 0] * b, accepted=[1 if arm else 0] * b)
    b_ = CostPolicy([None, D1, D4], costs, epsilon=0.2, seed=99)
    b_.load_state_dict(json.loads(json.dumps(a.state_dict())))
    a.pending = None
    assert [a.choose(n, None) for n in (1, 3, 9, 20) * 5] == [b_.choose(n, None) for n in (1, 3, 9, 20) * 5]
    with pytest.raises(ValueError, match="tuner_arms"):
        CostPolicy([None, D1], costs).load_state_dict(a.state_dict())


def test_the_engine_with_the_cost_tuner_gives_autoregressive_tokens(hf_folders, tmp_path, monkeypatch):
    from engine.checkpoint import load_checkpoint
    from engine.config import EngineConfig
    from engine.engine import RolloutEngine
    from engine.sampling import SamplingParams
    from engine.spec.config import SpecConfig
    from engine.spec.ngram import NgramDrafter
    from engine.types import Request

    monkeypatch.setenv("TAILSPEC_CACHE", str(tmp_path))
    target = load_checkpoint(hf_folders["llama"], dtype=torch.float64)
    reqs = [Request(prompt_id=f"p{i}", prompt=[5 + i, 9, 14, 3], n=3) for i in range(3)]
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=2, stop_token_ids=(2,))
    ref = RolloutEngine(target, EngineConfig(max_batch=9, max_len=96)).generate(reqs, params)
    spec = SpecConfig(enabled=True, drafter="ngram", depth=2, verify_tokens=2, max_depth=6, max_verify_tokens=6,
                      tuner_arms=["off", "d2k1v2", "d6k1v6"], tuner="cost", tuner_epsilon=0.3)
    engine = RolloutEngine(target, EngineConfig(max_batch=9, max_len=96, spec=spec), NgramDrafter())
    assert isinstance(engine.policy, CostPolicy)
    assert list(tmp_path.glob("pass-costs/*.json"))  # measured once and cached
    out = engine.generate(reqs, params)
    assert [r.tokens for r in out] == [r.tokens for r in ref]
    m = engine.policy.metrics()
    assert 0 <= m["spec/speculated_share"] <= 1 and math.isfinite(m["spec/alpha"])
    again = RolloutEngine(target, EngineConfig(max_batch=9, max_len=96, spec=spec), NgramDrafter())
    assert again.policy.costs == engine.policy.costs  # read from the cache, not measured again


def test_the_cost_tuner_needs_a_draft_arm():
    from engine.spec.config import SpecConfig

    with pytest.raises(ValueError, match="tuner=cost"):
        SpecConfig(enabled=True, drafter="ngram", tuner_arms=["off"], tuner="cost").validate()
