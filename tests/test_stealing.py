"""The work-stealing queue and the engine source over it, on an in-memory store."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from engine.types import FinishReason, Request, Rollout
from pipeline.rollout.schedule import idle_to_last_start, join_groups
from pipeline.rollout.stealing import StealingSource, UnitQueue, plan_units


def requests(k: int, n: int = 4) -> list[Request]:
    return [Request(prompt_id=f"p{i}", prompt=[3, 4], n=n) for i in range(k)]


def test_each_rank_takes_its_own_list_first_then_steals_from_the_others_ends_and_each_unit_goes_once():
    store = dist.HashStore()
    plans = [[0, 1, 2], [3, 4, 5]]
    a, b = UnitQueue(store, "s/1", plans, 0), UnitQueue(store, "s/1", plans, 1)
    assert [a.take(), a.take(), b.take(), a.take()] == [0, 1, 3, 2]
    assert [a.take(), a.take(), b.take(), b.take(), a.take()] == [5, 4, None, None, None]  # a stole b's last two
    assert a.stolen == 2 and b.stolen == 0
    assert UnitQueue(store, "s/2", plans, 1).take() == 3  # another step's keys start over


def test_plans_are_the_shards_without_predictions_else_a_token_balanced_deal_longest_first():
    assert plan_units([1.0] * 6, 4, 2) == [[0, 1, 2], [3, 4, 5]]
    plans = plan_units([900, 20, 30, 400, 300, 10], 4, 2)
    assert plans == [[0], [3, 4, 2, 1, 5]]  # the longest group alone: it bounds the step anyway


def test_a_source_keeps_about_inflight_rows_and_takes_more_as_rows_finish():
    store = dist.HashStore()
    src = StealingSource(UnitQueue(store, "k", [range(5)], 0), requests(5), inflight=8)
    assert [r.prompt_id for r in src.pull(active=0, free=64)] == ["p0", "p1"]  # 8 rows in flight
    assert src.pull(active=8, free=56) == []
    assert [r.prompt_id for r in src.pull(active=4, free=60)] == ["p2"]  # a group finished: room for one
    assert [r.prompt_id for r in src.pull(active=0, free=64)] == ["p3", "p4"]
    assert src.pull(active=0, free=64) is None and src.empty_at is not None
    assert src.taken == [0, 1, 2, 3, 4]


def test_an_idle_engine_takes_a_unit_even_when_it_exceeds_the_target_or_the_free_slots():
    src = StealingSource(UnitQueue(dist.HashStore(), "k", [range(3)], 0), requests(3, n=8), inflight=2)
    assert [r.prompt_id for r in src.pull(active=0, free=4)] == ["p0"]
    assert src.pull(active=8, free=0) == []


def test_a_rank_that_finishes_early_steals_what_a_busy_rank_has_not_reached():
    store = dist.HashStore()
    reqs = requests(6)
    plans = [[0, 1, 2], [3, 4, 5]]
    busy = StealingSource(UnitQueue(store, "k", plans, 0), reqs, inflight=4)
    quick = StealingSource(UnitQueue(store, "k", plans, 1), reqs, inflight=4)
    busy.pull(0, 64), quick.pull(0, 64)  # one unit each
    for _ in range(4):  # quick's rows keep finishing while busy's one long unit runs
        quick.pull(0, 64)
    assert busy.taken == [0] and quick.taken == [3, 4, 5, 2, 1]  # its own, then busy's from the end
    assert busy.pull(4, 60) == [] and busy.pull(0, 64) is None  # its long unit done: nothing left to take


def test_a_bad_inflight_or_mixed_group_sizes_are_refused():
    q = UnitQueue(dist.HashStore(), "k", [[0]], 0)
    with pytest.raises(ValueError, match="inflight"):
        StealingSource(q, requests(1), inflight=0)
    with pytest.raises(ValueError, match="same n"):
        StealingSource(q, [*requests(1, n=2), *requests(1, n=3)], inflight=4)


def test_idle_to_last_start_counts_a_rank_that_ran_out_before_the_last_unit_started():
    # rank 0 busy from 0 to 10, rank 1 from 0 to 4; the last unit was taken at 8: rank 1 idled 4 of 16 rank-seconds
    assert idle_to_last_start([(0.0, 8.0, 10.0), (0.0, 3.0, 4.0)]) == pytest.approx(0.25)
    assert idle_to_last_start([(0.0, 8.0, 10.0), (0.0, 5.0, 9.0)]) == 0.0


def _rollout(prompt_id: str, sample: int) -> Rollout:
    return Rollout(prompt_id=prompt_id, sample=sample, prompt_tokens=1, tokens=[sample], logprobs=[0.0],
                   finish_reason=FinishReason.STOP)


def test_split_groups_are_joined_in_sample_order_and_a_missing_part_is_an_error():
    # rank 1's parts arrive first: samples 2, 3 of group 0; then rank 0's samples 0, 1
    rows = [(0, 1, [5], [_rollout("p", 2), _rollout("p", 3)], [0.0, 1.0]),
            (0, 0, [5], [_rollout("p", 0), _rollout("p", 1)], [1.0, 0.0])]
    rank, prompt, rollouts, rewards, made_on = join_groups(rows, 4)[0]
    assert (rank, prompt, [r.sample for r in rollouts], rewards) == (0, [5], [0, 1, 2, 3], [1.0, 0.0, 0.0, 1.0])
    assert made_on == [0, 0, 1, 1]  # each sample's generating rank, for the simulator's records
    with pytest.raises(RuntimeError, match=r"group 0 came back with samples \[2, 3\], not 0..3"):
        join_groups(rows[:1], 4)
