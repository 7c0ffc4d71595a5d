"""History drafts: the suffix index and its bounded store, the drafter's proposals, its metrics."""

from __future__ import annotations

import json

import pytest
import torch

from engine.sampling import SamplingParams
from engine.spec.drafter import DraftShape
from engine.spec.history import HistoryDrafter, history_counts, history_metrics
from engine.spec.history_index import HistoryStore, SuffixIndex
from engine.types import StepRecord
from tests.test_ngram import make_ctx, row_nodes


def test_index_maps_each_key_to_the_continuations_after_it_latest_last():
    index = SuffixIndex(min_match=2)
    index.add([5, 6, 7, 5, 6, 8])
    index.add([5, 6, 9])
    conts = [index.corpus[p] for p in index.candidates((5, 6), limit=8)]
    assert conts == [7, 8, 9]
    assert [index.corpus[p] for p in index.candidates((5, 6), limit=1)] == [9]
    assert index.candidates((6, 5), limit=8) == []
    assert index.responses() == [[5, 6, 7, 5, 6, 8], [5, 6, 9]]


def test_a_row_one_token_into_its_response_has_a_key_padded_with_start():
    index = SuffixIndex(min_match=3)
    index.add([4, 1, 2])
    from engine.spec.history_index import START

    assert [index.corpus[p] for p in index.candidates((START, START, 4), 4)] == [1]


def test_store_evicts_the_least_recently_used_prompt_past_max_prompts():
    store = HistoryStore(max_prompts=2, min_match=2)
    store.add("a", [[1, 2, 3]])
    store.add("b", [[1, 2, 3]])
    store.add("a", [[4, 5]])  # a is used again: b is now the oldest
    store.add("c", [[6, 7]])
    assert "b" not in store and "a" in store and "c" in store
    assert store.get("a").responses() == [[1, 2, 3], [4, 5]]


def test_store_keeps_its_token_count_within_the_cap():
    store = HistoryStore(max_tokens=30, min_match=2)
    for i in range(10):
        store.add(f"p{i}", [[i] * 8])  # 1 START + 8 tokens + SEP = 10 corpus tokens each
    assert store.num_tokens <= 30 and len(store) == 3
    assert sorted(f"p{i}" for i in range(7, 10)) == sorted(pid for pid, _ in store.state_dict()["prompts"])
    assert store.num_tokens == sum(store.get(f"p{i}").num_tokens for i in range(7, 10))


def test_store_keeps_the_newest_responses_per_prompt():
    store = HistoryStore(max_responses=2, min_match=2)
    store.add("a", [[1, 1], [2, 2]])
    store.add("a", [[3, 3]])
    assert store.get("a").responses() == [[2, 2], [3, 3]]
    assert store.num_tokens == store.get("a").num_tokens
    assert store.predicted_length("a") == 2.0 and store.predicted_length("z") is None


def test_store_state_dict_round_trips_through_json():
    store = HistoryStore(min_match=2)
    store.add("a", [[1, 2, 3], [1, 2, 4]])
    store.add("b", [[7, 8]])
    copy = HistoryStore(min_match=2)
    copy.load_state_dict(json.loads(json.dumps(store.state_dict())))
    assert copy.state_dict() == store.state_dict()
    assert copy.get("a").keys == store.get("a").keys and copy.num_tokens == store.num_tokens


def test_bad_limits_and_state_raise_naming_the_key():
    with pytest.raises(ValueError, match="engine.spec.history_max_tokens"):
        HistoryStore(max_tokens=0)
    with pytest.raises(ValueError, match="malformed"):
        HistoryStore().load_state_dict({"prompts": [["a"]]})


def drafter(store: HistoryStore, depth: int = 4) -> tuple[HistoryDrafter, DraftShape]:
    d = HistoryDrafter(store, max_match=8)
    shape = DraftShape(depth=depth, verify_tokens=depth)
    d.reset(8, 64, SamplingParams(seed=1, step=3), shape)
    return d, shape


def test_drafts_the_continuation_of_the_longest_match_in_the_prompts_history():
    store = HistoryStore(min_match=2)
    store.add("p", [[9, 1, 2, 3, 4, 5, 6], [8, 1, 2, 7, 7, 7]])
    d, shape = drafter(store)
    # The row ends in 9 1 2: the first response matches 3 tokens, the second only 2.
    tree = d.propose(make_ctx([[50]], [[9, 1, 2]], ["p"], depth=4, verify_tokens=4))
    assert row_nodes(tree, 0) == ([3, 4, 5, 6], [-1, 0, 1, 2])


def test_a_draft_stops_at_the_end_of_its_response_and_other_prompts_get_none():
    store = HistoryStore(min_match=2)
    store.add("p", [[1, 2, 3]])
    d, _ = drafter(store)
    tree = d.propose(make_ctx([[50], [50]], [[1, 2], [1, 2]], ["p", "q"]))
    assert row_nodes(tree, 0)[0] == [3]
    assert tree.num_nodes.tolist() == [1, 0]


def test_finished_siblings_of_this_step_draft_and_are_forgotten_at_the_next_step():
    d, shape = drafter(HistoryStore(min_match=2))
    d.finish("p", [1, 2, 3, 4])
    ctx = make_ctx([[50]], [[1, 2]], ["p"])
    assert row_nodes(d.propose(ctx), 0)[0] == [3, 4]
    d.reset(8, 64, SamplingParams(seed=1, step=3), shape)  # the same step: kept
    assert d.propose(ctx).num_nodes.tolist() == [2]
    d.reset(8, 64, SamplingParams(seed=1, step=4), shape)
    assert d.propose(ctx).num_nodes.tolist() == [0]


def test_history_metrics_count_only_the_rows_the_history_part_drafted():
    rec = lambda shape, source, drafted, emitted: StepRecord(  # noqa: E731
        index=0, batch_size=len(drafted), shape=shape, drafted=drafted, accepted=[max(e - 1, 0) for e in emitted],
        emitted=emitted, context_mean=0.0, draft_s=0.0, forward_s=0.0, other_s=0.0, source=source)
    steps = [rec("d4k1v4", [0, 1, 0], [4, 4, 0], [5, 2, 1]), rec("off", None, [0], [1]), rec("d4k1v4", [1], [4], [3])]
    assert history_counts(steps, source=0) == [4.0, 1.0, 5.0]
    m = history_metrics(history_counts(steps, source=0))
    assert m == {"spec/history_coverage": pytest.approx(1 / 4), "spec/history_accept_len": 5.0}
    assert history_metrics(history_counts([steps[1]], source=0)) == {}
    assert history_metrics(history_counts(steps, source=None))["spec/history_coverage"] == pytest.approx(3 / 4)


@pytest.fixture(scope="module")
def target(hf_folders):
    from engine.checkpoint import load_checkpoint

    return load_checkpoint(hf_folders["llama"], dtype=torch.float64)


def test_history_drafts_change_no_token_and_draft_where_the_prompt_recurs(target):
    from engine.spec.compose import FallbackDrafter
    from engine.spec.ngram import NgramDrafter
    from tests.test_spec import engine, requests

    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=5, step=2, stop_token_ids=(2,))
    reference = engine(target).generate(requests(), params)
    store = HistoryStore(min_match=2)
    earlier = engine(target).generate(requests(), SamplingParams(max_new_tokens=40, temperature=1.0, seed=5, step=1,
                                                                 stop_token_ids=(2,)))
    for r in earlier:  # the previous epoch's responses to the same prompts (other noise)
        store.add(r.prompt_id, [r.tokens])
    composed = FallbackDrafter([HistoryDrafter(store), NgramDrafter()])
    batch = engine(target, composed).generate(requests(), params)
    assert [(r.prompt_id, r.sample, r.tokens, r.finish_reason) for r in batch] == \
        [(r.prompt_id, r.sample, r.tokens, r.finish_reason) for r in reference]
    assert [r.logprobs for r in batch] == [pytest.approx(r.logprobs, abs=1e-9) for r in reference]
    assert history_metrics(history_counts(batch.steps, source=0))["spec/history_coverage"] > 0


def test_the_minimum_match_defaults_long_before_a_learned_drafter_and_short_without_one():
    from engine.spec.config import SpecConfig
    from engine.spec.factory import history_store

    assert history_store(SpecConfig(drafter="history+eagle")).min_match == 12
    assert history_store(SpecConfig(drafter="history+ngram")).min_match == 3
    assert history_store(SpecConfig(drafter="history+eagle", history_min_match=5)).min_match == 5
    with pytest.raises(ValueError, match="engine.spec.history_max_match"):
        SpecConfig(drafter="history", history_min_match=40).validate()


@pytest.mark.timeout(120)
def test_two_ranks_hold_equal_stores_with_every_ranks_responses_in_rank_order_and_summed_metrics(tmp_path):
    import torch.multiprocessing as mp

    from tests.mp import free_port
    from tests.mp.history_worker import worker

    mp.start_processes(worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert r0["state"] == r1["state"]  # whichever rank a prompt lands on next epoch drafts from the same store
    prompts = dict((pid, responses) for pid, responses in r0["state"]["prompts"])
    assert prompts["p0"] == [[1] * 4] and prompts["p1"] == [[2] * 6]
    assert prompts["both"] == [[7, 0, 7, 0, 9], [7, 1, 7, 1, 9]]  # rank 0's sample first, then rank 1's
    assert r0["predicted"] == r1["predicted"] == {"p0": 4, "p1": 6, "both": 5}
    # rank 0's history part drafted 1 of 2 rows, rank 1's both: 3 of 4 row-steps, 3 tokens each
    assert r0["metrics"] == r1["metrics"] == {"spec/history_coverage": 0.75, "spec/history_accept_len": 3.0}
