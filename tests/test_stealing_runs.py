"""Work stealing, split groups and long-first admission in the RL loop on two ranks: the same run as
static shards (rewards, losses, lengths of every rollout, final weights), also when one rank
generates every unit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
COMPARED = ("reward/mean", "reward/std", "train/pg_loss", "train/grad_norm", "rollout/response_length/mean",
            "rollout/response_length/max")


def two_ranks(char_model_dir, out: Path, module: str, *overrides) -> Path:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", module,
           "--config", str(REPO / "configs" / "tiny.yaml"), f"model.path={char_model_dir}", f"run.out_dir={out}",
           "task.name=arith", "task.train_problems=4", "task.eval_problems=1", "rollout.n=4", "rollout.max_new_tokens=24",
           "engine.max_batch=16", "engine.max_len=96", "engine.spec.enabled=false", "spot.enabled=false",
           "trainer.steps=2", "trainer.prompts_per_step=4", "trainer.eval_every=0", "actor.lr=1e-3",
           "actor.micro_batch_tokens=256", "metrics.wandb=false", "metrics.dashboard=false", "metrics.console=false",
           "rollout.split_groups=false", *overrides]  # 4 problems, 4 a step: step 2 repeats step 1's prompts, so long-first has a history
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = list(out.iterdir())
    return run_dir


def steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "timing/step" in r]


def rollouts(run_dir: Path) -> dict[tuple, tuple]:
    """(step, prompt, sample) -> (length, reward, the rank that trained it)."""
    rows = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    return {(r["step"], r["prompt_id"], r["sample"]): (r["length"], r["reward"], r["rank"]) for r in rows}


def generated_on(run_dir: Path) -> dict[tuple, int]:
    """(step, prompt, sample) -> the rank that generated it (what the simulator replays per rank)."""
    rows = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    return {(r["step"], r["prompt_id"], r["sample"]): r["gen_rank"] for r in rows}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / "step-2" / "actor" / "model.safetensors"))


def assert_same_run(a: Path, b: Path) -> None:
    ra, rb = steps(a), steps(b)
    assert [[r[k] for k in COMPARED] for r in ra] == [[r[k] for k in COMPARED] for r in rb]
    assert rollouts(a) == rollouts(b)  # each row's length and reward, trained on the same rank
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def static_run(char_model_dir, tmp_path_factory) -> Path:
    return two_ranks(char_model_dir, tmp_path_factory.mktemp("static"), "launch.train")


@pytest.mark.slow
def test_stealing_with_long_first_is_the_same_run_as_static_shards(char_model_dir, static_run, tmp_path):
    run = two_ranks(char_model_dir, tmp_path, "launch.train", "rollout.work_stealing=true", "rollout.long_first=true",
                    "rollout.steal_inflight=4")
    assert_same_run(static_run, run)
    rows = steps(run)
    assert all("rollout/units_stolen" in r and 0 <= r["rollout/idle_to_last_start"] <= 1 for r in rows)
    assert "rollout/length_pred_corr" in rows[1]  # step 2's prompts were seen at step 1
    state = json.loads((run / "checkpoints" / "step-2" / "state.json").read_text())
    assert len(state["components"]["length_predictor"]["history"]) == 4


@pytest.mark.slow
def test_a_rank_that_generates_the_other_ranks_shard_gives_the_same_tokens(char_model_dir, static_run, tmp_path):
    run = two_ranks(char_model_dir, tmp_path, "tests.mp.late_rank_train", "rollout.work_stealing=true")
    rows = steps(run)
    assert [r["rollout/units_stolen"] for r in rows] == [2.0, 2.0]  # rank 1's 2 groups, each step, made on rank 0
    assert_same_run(static_run, run)
    assert set(generated_on(run).values()) == {0}  # the records say so, though rank 1 trained on half
    assert {r for _, _, r in rollouts(run).values()} == {0, 1}
    static = generated_on(static_run)  # its loader shards: each rank makes 2 whole groups a step
    assert sorted(sum(1 for (s, _, _), r in static.items() if s == 1 and r == rank) for rank in (0, 1)) == [8, 8]
    assert all(static[(s, p, k)] == static[(s, p, 0)] for s, p, k in static)


@pytest.mark.slow
def test_split_groups_with_speculation_are_the_same_run_as_whole_groups(char_model_dir, static_run, tmp_path):
    run = two_ranks(char_model_dir, tmp_path, "launch.train", "rollout.split_groups=true", "engine.spec.enabled=true",
                    "engine.spec.drafter=ngram", "engine.spec.tuner_arms=[]", "engine.spec.depth=4",
                    "engine.spec.verify_tokens=4")
    assert_same_run(static_run, run)
    assert not any("rollout/units_stolen" in r for r in steps(run))  # every group is made on both ranks: none stolen
    assert all(rank == sample // 2 for (_, _, sample), rank in generated_on(run).items())  # samples 0-1 on rank 0


@pytest.mark.slow
def test_token_shares_train_every_row_once_with_the_ranks_tokens_balanced(char_model_dir, tmp_path):
    run = two_ranks(char_model_dir, tmp_path, "launch.train", "rollout.work_stealing=true", "trainer.train_shares=tokens",
                    "trainer.mini_batches=1")
    rows = rollouts(run)
    for step in (1, 2):
        mine = [(key, v) for key, v in rows.items() if key[0] == step]
        assert len(mine) == 16  # 4 prompts x 4 samples, each trained once
        live = {p for (_, p, _), _ in mine if len({rw for (_, q, _), (_, rw, _) in mine if q == p}) > 1}
        trained = [(length, r) for (_, p, _), (length, _, r) in mine if p in live]  # the rows the update trains
        tokens = {rank: sum(length for length, r in trained if r == rank) for rank in (0, 1)}
        assert abs(tokens[0] - tokens[1]) <= max((length for length, _ in trained), default=0)  # the greedy deal's bound


@pytest.mark.slow
def test_token_shares_deal_each_mini_batchs_rows_over_the_ranks(static_run):
    # tiny.yaml's trainer: train_shares=tokens, 2 mini-batches; 4 prompts a step -> 2 whole groups a
    # mini-batch, whose 8 rows the ranks share, each rank a part of every mini-batch, in turn
    rows = [json.loads(x) for x in (static_run / "rollouts.jsonl").read_text().splitlines()]
    for step in (1, 2):
        mine = [r for r in rows if r["step"] == step]
        assert sorted((r["prompt_id"], r["sample"]) for r in mine) == sorted({(r["prompt_id"], s) for r in mine for s in range(4)})
        for rank in (0, 1):
            marks = [r["mini_batch"] for r in mine if r["rank"] == rank]
            assert marks == sorted(marks) and set(marks) == {0, 1}
        for k in (0, 1):
            groups = {r["prompt_id"] for r in mine if r["mini_batch"] == k}
            assert len(groups) == 2 and sum(r["mini_batch"] == k for r in mine) == 8  # whole groups
            live = {g for g in groups if len({r["reward"] for r in mine if r["prompt_id"] == g}) > 1}
            load = {rank: sum(r["length"] for r in mine if (r["mini_batch"], r["rank"]) == (k, rank)
                              and r["prompt_id"] in live) for rank in (0, 1)}
            longest = max((r["length"] for r in mine if r["prompt_id"] in live), default=0)
            assert abs(load[0] - load[1]) <= longest  # the longest-first greedy deal's bound, by rows
    assert all(0.5 <= r["train/update_balance"] <= 1.0 for r in steps(static_run))  # logged every step


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["rollout.work_stealing=true", "rollout.split_groups=true"])
def test_stealing_or_split_groups_with_bubble_drafts_and_speculation_are_the_same_run_as_static_shards(
        char_model_dir, static_run, tmp_path, schedule):
    run = two_ranks(char_model_dir, tmp_path, "launch.train", schedule, "engine.spec.enabled=true",
                    "engine.spec.drafter=pregenerated+ngram", "engine.spec.tuner_arms=[]", "engine.spec.depth=4",
                    "engine.spec.verify_tokens=4", "bubble.enabled=true")
    assert_same_run(static_run, run)
    assert all("bubble/coverage" in r for r in steps(run)[1:])  # step 2 had drafts pre-generated in step 1's windows
