import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.update.learner import mini_batch_cut
from pipeline.shares import (mini_batch_shares, row_shares, shard_shares, split_samples, token_shares,
                             update_balance, update_tokens)

REPO = Path(__file__).resolve().parent.parent


def test_shard_shares_are_the_loaders_contiguous_shards():
    assert shard_shares(6, 3) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="prompts_per_step"):
        shard_shares(5, 2)


def test_token_shares_cover_every_group_once_in_global_order():
    tokens = [5, 900, 30, 40, 800, 10, 20, 60]
    shares = token_shares(tokens, 3)
    assert sorted(g for s in shares for g in s) == list(range(len(tokens)))
    assert all(s == sorted(s) for s in shares)


def test_token_shares_balance_a_long_tail_better_than_shards():
    tokens = [900, 800, 30, 40, 5, 10, 20, 60]
    load = lambda shares: max(sum(tokens[g] for g in s) for s in shares)
    assert load(token_shares(tokens, 2)) < load(shard_shares(len(tokens), 2))
    assert load(token_shares(tokens, 2)) == 935


def test_a_group_of_equal_rewards_weighs_nothing_when_the_update_leaves_it_out():
    assert update_tokens([30, 40], [1.0, 0.0], equal_rewards_free=True) == 70
    assert update_tokens([300, 400], [0.0, 0.0], equal_rewards_free=True) == 0
    assert update_tokens([300, 400], [0.0, 0.0], equal_rewards_free=False) == 700
    # the long all-failed group no longer outweighs the rest: the trained tokens split evenly
    weights = [update_tokens(*g, equal_rewards_free=True) for g in
               [([500, 500], [0.0, 0.0]), ([40, 60], [1.0, 0.0]), ([50, 50], [0.0, 1.0]), ([10, 10], [1.0, 1.0])]]
    shares = token_shares(weights, 2)
    assert sorted(sum(weights[g] for g in s) for s in shares) == [100, 100]


def test_ranks_training_shares_of_different_sizes_gather_every_rank_s_values(tmp_path):
    # A token-balanced share gives ranks different row counts; the step's lengths are gathered from all of them.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "tests.mp.ragged_worker",
           str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [[0.5], [1.5, 1.5]]


def test_groups_that_weigh_nothing_are_spread_over_the_ranks():
    assert token_shares([0, 0, 0, 0], 2) == [[0, 2], [1, 3]]
    assert sorted(len(s) for s in token_shares([90, 0, 0, 0, 0, 0], 3)) == [1, 2, 3]


def test_split_samples_give_each_rank_an_equal_run_of_every_groups_samples():
    assert [split_samples(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="make rollout.n a multiple of 2"):
        split_samples(3, 2, 0)


def test_group_split_splits_every_group_over_several_ranks_and_leaves_whole_groups_to_one():
    from pipeline.config import RolloutSection
    from pipeline.data import PromptLoader
    from pipeline.rollout.schedule import GroupSplit
    from pipeline.tasks import Problem

    split = RolloutSection(n=4, split_groups=True)
    parts = [GroupSplit.of(split, 2, r) for r in range(2)]
    assert all(p.split for p in parts) and [p.samples for p in parts] == [range(0, 2), range(2, 4)]
    assert GroupSplit.of(split, 1, 0) == GroupSplit(False, range(4))  # one rank: whole groups
    assert GroupSplit.of(RolloutSection(n=4), 2, 1) == GroupSplit(False, range(4))

    class Tok:
        def __call__(self, text):
            return {"input_ids": [len(text)]}

    problems = [Problem(id=f"p{i}", prompt="x" * (i + 1), answer="", response="") for i in range(4)]
    loaders = [PromptLoader(problems, 2, 0, world_size=2, rank=r) for r in range(2)]
    asked = [[(q.prompt_id, q.first_sample, q.n) for q in p.next_requests(loader, Tok(), chat=False)]
             for p, loader in zip(parts, loaders)]
    step = [q.id for q in loaders[0].global_step()]
    assert asked == [[(pid, 0, 2) for pid in step], [(pid, 2, 2) for pid in step]]  # every group of the step, a part each
    whole = [GroupSplit.of(RolloutSection(n=4), 2, r).next_requests(loaders[r], Tok(), chat=False) for r in range(2)]
    assert [[(q.prompt_id, q.n) for q in w] for w in whole] == [[(q.id, 4) for q in loaders[r].peek()] for r in range(2)]
    assert all(loader._taken == 0 for loader in loaders)  # asking does not advance the loader


def _wait(tokens, cells):
    """Tokens the ranks' updates take when every mini-batch waits for its largest rank: cells[rank][k]."""
    return sum(max(sum(tokens[g] for g in rank[k]) for rank in cells) for k in range(len(cells[0])))


def test_mini_batch_shares_balance_each_mini_batch_not_only_the_step():
    tokens = [900, 10, 10, 10, 10, 10, 10, 900]  # the long groups at either end of the step
    cells = mini_batch_shares(tokens, 2, 2)
    assert sorted(g for rank in cells for cell in rank for g in cell) == list(range(8))
    assert [sum(len(rank[k]) for rank in cells) for k in range(2)] == [4, 4]  # equal mini-batches
    assert all(cell and cell == sorted(cell) for rank in cells for cell in rank)
    # the step's token shares cut into even halves of each rank's rows (what the learner did before):
    # rank 0 trains its long group in the first mini-batch, rank 1 in the second, and each waits
    halves = [[s[: (len(s) + 1) // 2], s[(len(s) + 1) // 2:]] for s in token_shares(tokens, 2)]
    assert _wait(tokens, halves) == 1820
    assert _wait(tokens, cells) == 930


def test_mini_batch_shares_with_one_mini_batch_are_token_shares():
    for tokens in ([900, 800, 30, 40, 5, 10, 20, 60], [0, 0, 0, 0], [5, 5, 5, 90, 1, 7]):
        assert [rank[0] for rank in mini_batch_shares(tokens, 2, 1)] == token_shares(tokens, 2)


def test_every_rank_gets_a_group_in_every_mini_batch_even_behind_one_long_group():
    cells = mini_batch_shares([10_000, 0, 0, 0, 0], 2, 2)  # mini-batches of 3 and 2 groups
    assert all(cell for rank in cells for cell in rank)
    assert [sum(len(rank[k]) for rank in cells) for k in range(2)] == [3, 2]
    with pytest.raises(ValueError, match="lower trainer.mini_batches"):
        mini_batch_shares([1], 1, 2)
    assert token_shares([7], 2) == [[0], []]  # fewer groups than ranks: a rank trains none (stealing's plan)


def test_row_shares_train_every_row_once_with_each_mini_batch_balanced_over_the_ranks():
    # one long group (4 x ~800 tokens) and short ones: dealt whole, a rank's part of a mini-batch is
    # the long group against the other's short ones; dealt by rows, the long group's samples split
    rows = [[800, 790, 810, 20], [30, 40, 50, 60], [0, 0, 0, 0], [25, 35, 45, 55]]
    cells = row_shares(rows, 2, 2)
    dealt = sorted(x for rank in cells for cell in rank for x in cell)
    assert dealt == [(g, s) for g in range(4) for s in range(4)]  # every row once
    assert all(cell and cell == sorted(cell) for rank in cells for cell in rank)  # global order, no empty part
    groups_of = [{g for rank in cells for g, _ in rank[k]} for k in range(2)]
    assert [len(g) for g in groups_of] == [2, 2] and not groups_of[0] & groups_of[1]  # whole groups per mini-batch
    load = lambda k, r: sum(rows[g][s] for g, s in cells[r][k])  # noqa: E731
    wait_rows = sum(max(load(k, 0), load(k, 1)) for k in range(2))
    whole = mini_batch_shares([sum(t) for t in rows], 2, 2)
    wait_whole = sum(max(sum(sum(rows[g]) for g in whole[r][k]) for r in range(2)) for k in range(2))
    # the long group's mini-batch waits for two of its long samples on one rank, not all four
    assert wait_rows == 1590 + 170 < wait_whole == 2420 + 160
    with pytest.raises(ValueError, match="lower trainer.mini_batches"):
        row_shares([[5], [6]], 2, 2)  # a mini-batch of one row cannot give both ranks a part


def test_the_learner_cuts_the_rows_where_the_schedule_dealt_the_mini_batches():
    assert [c.tolist() for c in mini_batch_cut(12, [4, 8], 2)] == [[0, 1, 2, 3], list(range(4, 12))]
    assert [c.tolist() for c in mini_batch_cut(12, None, 2)] == [list(range(6)), list(range(6, 12))]
    with pytest.raises(ValueError, match="trainer.mini_batches=3"):
        mini_batch_cut(12, [4, 8], 3)


def test_update_balance_is_the_balanced_update_over_the_one_that_waits_for_the_slowest_rank():
    assert update_balance([[100, 100], [100, 100]]) == 1.0
    assert update_balance([[200, 0], [0, 0]]) == 0.5  # one rank does all the work of the mini-batch
    assert update_balance([[300, 10], [100, 30]]) == pytest.approx((200 + 20) / (300 + 30))
    assert update_balance([[0, 0], [0, 0]]) == 1.0
    rows = [[800, 790, 810, 20], [30, 40, 50, 60], [0, 0, 0, 0], [25, 35, 45, 55]]
    by_rows = update_balance([[sum(rows[g][s] for g, s in cell) for cell in rank] for rank in row_shares(rows, 2, 2)])
    halves = update_balance([[sum(rows[0]), sum(rows[1])], [sum(rows[2]), sum(rows[3])]])  # shards, even halves
    assert by_rows == pytest.approx(1380 / 1760) and halves == pytest.approx(1380 / 2600)  # 0.78 against 0.53
