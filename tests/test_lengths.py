"""The length predictor: history, then the running mean; bounded; its state round-trips."""

from __future__ import annotations

import pytest

from pipeline.rollout.lengths import LengthPredictor, correlation, long_first


def test_a_prompt_seen_before_is_predicted_from_its_last_responses_else_the_running_mean():
    p = LengthPredictor()
    assert p.predict("a") == 1.0  # nothing seen yet
    p.observe("a", [100, 120])
    p.observe("b", [10, 10])
    assert p.predict("a") == 110 and p.predict("b") == 10
    assert p.predict("new") == pytest.approx(60.0)
    p.observe("a", [30, 30])  # the latest visit replaces the earlier one
    assert p.predict("a") == 30


def test_the_history_forgets_the_prompts_seen_least_recently():
    p = LengthPredictor(max_prompts=2)
    for pid in ("a", "b", "a", "c"):
        p.observe(pid, [len(pid) * 7])
    assert set(p.history) == {"a", "c"}


def test_the_state_round_trips_through_json_values():
    import json

    p = LengthPredictor()
    p.observe("a", [5, 7])
    q = LengthPredictor()
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.predict("a") == 6 and q.prior == p.prior and list(q.history) == list(p.history)


def test_long_first_orders_by_prediction_and_keeps_ties_in_order():
    assert long_first([5, 9, 5, 1, 9]) == [1, 4, 0, 2, 3]


def test_correlation_is_pearsons_and_undefined_for_constant_predictions():
    assert correlation([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert correlation([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert correlation([4, 4, 4], [1, 2, 3]) is None
