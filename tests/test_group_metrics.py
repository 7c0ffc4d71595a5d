"""A step's metrics count every group and every trained row once, whichever ranks hold them: the
reward and advantage metrics over groups, the update's over the ranks' rows."""

from __future__ import annotations

import pytest
import torch

from engine.types import Rollout, RolloutBatch
from pipeline.algorithms import AlgorithmConfig, build_algorithm
from pipeline.update.learner import UpdatePart, combine_group_metrics, combine_update_metrics, owned_group_metrics
from pipeline.rollout.stage import ScoredRollouts

REWARDS = {"g0": [1.0, 0.0, 0.0, 0.0], "g1": [1.0, 1.0, 1.0, 1.0], "g2": [0.0, 1.0, 1.0, 0.0]}


def part(groups: list[tuple[str, list[int]]], train_rows: list[int]) -> ScoredRollouts:
    """A rank's held groups (prompt id, its samples in this rank's row order) and the rows it trains."""
    rollouts = [Rollout(prompt_id=g, sample=s, prompt_tokens=2, tokens=[5] * (3 + s), logprobs=[0.0] * (3 + s),
                        finish_reason="stop") for g, samples in groups for s in samples]
    rewards = torch.tensor([REWARDS[g][s] for g, samples in groups for s in samples])
    return ScoredRollouts(problems=[None] * len(groups), prompts=[[1, 2]] * len(groups), n=4, rewards=rewards,
                          batch=RolloutBatch(rollouts=rollouts, steps=[], prefill_s=0.0, wall_s=0.0, policy_version=0),
                          train_rows=train_rows, mini_batch_rows=[len(train_rows)])


def test_groups_held_by_two_ranks_count_once_in_the_steps_metrics():
    algo = build_algorithm(AlgorithmConfig(name="grpo"), max_response_len=16)
    # rank 0 trains all of g0 and g1's sample 0; rank 1 the rest of g1 (held in another row order) and g2
    rank0 = part([("g0", [0, 1, 2, 3]), ("g1", [0, 1, 2, 3])], [0, 1, 2, 3, 4])
    rank1 = part([("g1", [1, 2, 3, 0]), ("g2", [0, 1, 2, 3])], [0, 1, 2, 4, 5, 6, 7])
    parts = [owned_group_metrics(algo, rank0), owned_group_metrics(algo, rank1)]
    assert [count for count, _ in parts] == [2, 1]  # g1 is rank 0's: it trains g1's sample 0
    whole = part([("g0", [0, 1, 2, 3]), ("g1", [0, 1, 2, 3]), ("g2", [0, 1, 2, 3])], list(range(12)))
    _, step = owned_group_metrics(algo, whole)
    combined = combine_group_metrics(parts)
    assert combined == pytest.approx(step)
    assert step["train/reward_mean"] == pytest.approx(7 / 12) and step["train/zero_std_groups"] == pytest.approx(1 / 3)
    held0 = part([("g0", [0, 1, 2, 3]), ("g1", [0, 1, 2, 3])], list(range(8)))  # what rank 0 alone would describe
    assert owned_group_metrics(algo, held0)[1]["train/reward_mean"] != pytest.approx(step["train/reward_mean"])


def test_a_rank_that_owns_no_group_adds_nothing():
    assert combine_group_metrics([(0, {}), (2, {"train/reward_mean": 0.5})]) == {"train/reward_mean": 0.5}
    assert combine_group_metrics([(1, {"train/adv_mean": 1.0}), (3, {"train/adv_mean": 0.0})]) == {"train/adv_mean": 0.25}


def test_the_updates_metrics_sum_losses_and_weigh_means_by_each_ranks_tokens():
    # rank 0 trained 30 tokens (10 + 20 over two mini-batches), rank 1 10 (all in the second)
    rank0 = UpdatePart(tokens=40.0, loads=[10.0, 20.0], first={"train/mismatch_kl": 0.1},
                       metrics={"train/loss": 0.3, "train/pg_loss": 0.25, "train/response_tokens": 15.0,
                                "train/pg_clipfrac": 0.2, "train/grad_norm": 2.0})
    rank1 = UpdatePart(tokens=20.0, loads=[0.0, 10.0], first={},
                       metrics={"train/loss": -0.1, "train/pg_loss": -0.05, "train/response_tokens": 5.0,
                                "train/pg_clipfrac": 0.6, "train/grad_norm": 2.0})
    step = combine_update_metrics([rank0, rank1])
    assert step["train/loss"] == pytest.approx(0.2) and step["train/pg_loss"] == pytest.approx(0.2)
    assert step["train/response_tokens"] == 20.0 and step["train/grad_norm"] == 2.0
    assert step["train/pg_clipfrac"] == pytest.approx((30 * 0.2 + 10 * 0.6) / 40)  # rank 0's alone: 0.2
    assert step["train/mismatch_kl"] == pytest.approx(0.1)


def test_ranks_without_a_trained_token_have_no_say_unless_none_had_one():
    idle = UpdatePart(tokens=8.0, loads=[0.0], metrics={"train/entropy": 0.0}, first={})
    busy = UpdatePart(tokens=8.0, loads=[8.0], metrics={"train/entropy": 0.9}, first={})
    assert combine_update_metrics([idle, busy])["train/entropy"] == pytest.approx(0.9)
    assert combine_update_metrics([idle, idle])["train/entropy"] == 0.0
