"""The BEG-MAB tuner: buckets, exploration, the median choice, state, and lossless use in the engine."""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine.spec.drafter import DraftShape
from engine.spec.tuner import Bandit, TunerPolicy, parse_arm
from engine.types import StepRecord


def test_batch_sizes_fall_into_tlt_buckets():
    b = Bandit(2, [1, 2, 5, 21])
    assert [b.bucket(n) for n in (1, 2, 4, 5, 20, 21, 500)] == [0, 1, 1, 2, 2, 3, 3]


def test_unexplored_arms_come_first_then_the_best_median_wins():
    b = Bandit(3, [1], epsilon=0.0)
    assert [b.choose(0) for _ in range(1)] == [0]
    b.update(0, 0, 5.0)
    assert b.choose(0) == 1
    b.update(0, 1, 9.0)
    assert b.choose(0) == 2
    b.update(0, 2, 7.0)
    for r in (1.0, 100.0):  # arm 2 now has rewards 7, 1, 100: median 7 < arm 1's 9
        b.update(0, 2, r)
    assert b.choose(0) == 1


def test_the_median_ignores_an_outlier_the_mean_would_follow():
    b = Bandit(2, [1], epsilon=0.0)
    for r in (10.0, 10.0, 10.0):
        b.update(0, 0, r)
    for r in (1.0, 1.0, 1000.0):  # mean 334, median 1
        b.update(0, 1, r)
    assert b.best(0) == 0


def test_exploration_share_is_epsilon():
    b = Bandit(4, [1], epsilon=0.2, seed=3)
    for a in range(4):
        b.update(0, a, float(a))
    picks = [b.choose(0) for _ in range(5000)]
    assert b.explored / b.choices == pytest.approx(0.2, abs=0.02)
    assert picks.count(3) / len(picks) == pytest.approx(0.8 + 0.2 / 4, abs=0.02)


def test_exploration_within_a_factor_skips_arms_measured_far_worse():
    b = Bandit(4, [1], epsilon=0.5, seed=3, explore_within=0.7)
    for a, reward in enumerate([100.0, 80.0, 60.0, 10.0]):  # arms 2 and 3 are below 0.7 x the best
        b.update(0, a, reward)
    picks = [b.choose(0) for _ in range(4000)]
    assert set(picks) == {0, 1}
    assert picks.count(1) / len(picks) == pytest.approx(0.5 / 2, abs=0.03)


def test_the_tuner_learns_off_for_large_batches_and_a_draft_for_small_ones():
    """Synthetic cost: speculation emits 3x the tokens at 2x the step time for batch <= 4, at 6x above."""
    arms = [None, DraftShape(depth=4, topk=1, verify_tokens=4)]
    policy = TunerPolicy(arms, [1, 2, 5, 21], epsilon=0.1, seed=0)
    rng = random.Random(0)
    last = None
    for i in range(4000):
        b = rng.choice([1, 3, 12, 64])
        shape = policy.choose(b, last)
        gain, cost = (3.0, 2.0 if b <= 4 else 6.0) if shape is not None else (1.0, 1.0)
        last = StepRecord(index=i, batch_size=b, shape="x", drafted=[0] * b, accepted=[0] * b, emitted=[int(gain)] * b,
                          context_mean=0.0, draft_s=0.0, forward_s=0.01 * cost * rng.uniform(0.9, 1.1), other_s=0.0)
    m = policy.metrics()
    assert (m["spec/arm/bucket0"], m["spec/arm/bucket1"], m["spec/arm/bucket2"], m["spec/arm/bucket3"]) == (1, 1, 0, 0)


def test_state_round_trips_through_json_and_continues_the_same_choices():
    a = Bandit(3, [1, 4], epsilon=0.5, seed=1)
    for i in range(30):
        a.update(i % 2, a.choose(i % 2), float(i % 5))
    b = Bandit(3, [1, 4], epsilon=0.5, seed=99)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [a.choose(i % 2) for i in range(50)] == [b.choose(i % 2) for i in range(50)]


def test_an_arm_label_round_trips_with_its_confidence_stop():
    arm = parse_arm("d16k1v16c0.2")
    assert (arm.depth, arm.topk, arm.verify_tokens, arm.min_confidence) == (16, 1, 16, 0.2)
    assert parse_arm(arm.label) == arm
    assert parse_arm("d4k1v4").label == "d4k1v4"


@pytest.mark.parametrize("bad, match", [("d4k1", "neither 'off'"), ("on", "neither 'off'"), ("d4k2v8c0.3", "chains only")])
def test_bad_arm_labels_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_arm(bad)


def test_the_engine_with_the_tuner_gives_autoregressive_tokens(hf_folders):
    from engine.checkpoint import load_checkpoint
    from engine.config import EngineConfig
    from engine.engine import RolloutEngine
    from engine.sampling import SamplingParams
    from engine.spec.config import SpecConfig
    from engine.spec.ngram import NgramDrafter
    from engine.types import Request

    target = load_checkpoint(hf_folders["llama"], dtype=torch.float64)
    reqs = [Request(prompt_id=f"p{i}", prompt=[5 + i, 9, 14, 3], n=3) for i in range(3)]
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=2, stop_token_ids=(2,))
    ref = RolloutEngine(target, EngineConfig(max_batch=9, max_len=96)).generate(reqs, params)
    spec = SpecConfig(depth=2, verify_tokens=2, max_depth=6, max_verify_tokens=6, tuner_arms=["off", "d2k1v2", "d6k1v6"],
                      tuner_epsilon=0.3)
    engine = RolloutEngine(target, EngineConfig(max_batch=9, max_len=96, spec=spec), NgramDrafter())
    out = engine.generate(reqs, params)
    assert [r.tokens for r in out] == [r.tokens for r in ref]
    assert {r.shape for r in out.steps} == {"off", "d2k1v2", "d6k1v6"}  # every arm was tried
    assert engine.policy.bandit.choices == len(out.steps)
