"""A separated run (actor ranks + rollout ranks under one torchrun) learns exactly what the
colocated run learns, and survives the loss of a rollout rank through its checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
LEARNED = ("reward/mean", "reward/std", "train/pg_loss", "train/loss", "train/grad_norm", "train/mismatch_kl",
           "rollout/response_length/mean", "rollout/response_length/max")
# The random model never earns the task's reward; DAPO's overlong penalty (the last 12 of 16 tokens)
# gives samples of different lengths different rewards, so the actor has advantages to learn from.
LENGTH_REWARD = ["algorithm.overlong_buffer=12"]
SPEC = {"off": ["engine.spec.enabled=false"],
        "on": ["engine.spec.drafter=ngram", "engine.spec.depth=4", "engine.spec.verify_tokens=4"]}


def base(run_dir: Path) -> list[str]:
    return [f"run.dir={run_dir}", "task.train_problems=64", "task.eval_problems=4", "rollout.n=4",
            "rollout.max_new_tokens=16", "engine.max_batch=16", "engine.max_len=96", "engine.spec.tuner_arms=[]",
            "spot.enabled=false", "trainer.prompts_per_step=4", "trainer.mini_batches=2", "trainer.eval_every=0",
            "actor.lr=1e-3", "actor.micro_batch_tokens=256", "metrics.wandb=false", "metrics.dashboard=false",
            # separated trains the loader's shards; each group generated whole unless a test splits it
            "metrics.console=false", "trainer.train_shares=shard", "rollout.split_groups=false"]


def torchrun(procs: int, run_dir: Path, *overrides: str, module: str = "launch.train", env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "TAILSPEC_CPU_TUNE": "0", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", "-m", module,
           "--config", str(REPO / "configs" / "tiny.yaml"), *base(run_dir), *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, failure_report(proc.stderr)
    return proc


def failure_report(stderr: str) -> str:
    """The first error lines of every rank (a root cause is printed before the other ranks' broken
    collectives bury it), then the end of stderr."""
    first = [line for line in stderr.splitlines() if "Error" in line or "error:" in line][:30]
    return "first error lines:\n" + "\n".join(first) + "\n...\n" + stderr[-3000:]


def separated(actors: int) -> list[str]:
    return ["pipeline.placement=separated", f"pipeline.actor_ranks={actors}"]


def step_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "timing/step" in r]


def rollouts(run_dir: Path, by_rank: bool = True) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    keys = ("step", "rank", "prompt_id", "sample", "length", "finish_reason", "reward")
    return sorted(tuple(r[k] for k in keys if by_rank or k != "rank") for r in rows)


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / f"step-{step}" / "actor" / "model.safetensors"))


def evals(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]


def assert_same_run(a: Path, b: Path, steps: int, final_weights: bool = True) -> None:
    """Same metrics, rollouts, held-out accuracy and (final_weights) actor weights after `steps`."""
    rows_a, rows_b = step_rows(a), step_rows(b)
    assert len(rows_a) == len(rows_b) == steps
    for x, y in zip(rows_a, rows_b):
        assert {k: x.get(k) for k in LEARNED} == {k: y.get(k) for k in LEARNED}, x["step"]
    assert rollouts(a) == rollouts(b)
    assert evals(a) == evals(b) and evals(a)
    if not final_weights:
        return
    wa, wb = weights(a, steps), weights(b, steps)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.timeout(300)
# split true: each rollout rank makes half of every group; temperature 0.8: the old log-probs of the
# first mini-batch are the update's own forward's, the second's one actor pass (pipeline.update.old_logprobs)
@pytest.mark.parametrize("split, temperature", [("false", "1.0"), ("true", "1.0"), ("false", "0.8")])
def test_one_actor_and_two_rollout_ranks_equal_the_one_rank_colocated_run_bit_for_bit(char_model_dir, tmp_path,
                                                                                      monkeypatch, split, temperature):
    from common.config import load_config
    from launch.run.build import run
    from launch.run.config import TrainConfig
    from pipeline.dist import Ranks

    monkeypatch.setenv("TAILSPEC_CPU_TUNE", "0")
    extra = [f"model.path={char_model_dir}", "trainer.steps=2", *SPEC["off"], f"rollout.split_groups={split}",
             f"rollout.temperature={temperature}"]
    run(load_config(TrainConfig, REPO / "configs" / "tiny.yaml", [*base(tmp_path / "colocated"), *extra]), Ranks())
    torchrun(3, tmp_path / "separated", *extra, *separated(1))
    assert_same_run(tmp_path / "colocated", tmp_path / "separated", steps=2)
    row = step_rows(tmp_path / "separated")[-1]
    # per-role timings: the rollout ranks (1, 2) generate and wait, the actor receives, updates and pushes
    assert {"timing/rollout/rank1", "timing/rollout/rank2", "timing/update_idle/rank2", "timing/receive",
            "timing/update", "timing/sync"} <= row.keys() and "timing/rollout/rank0" not in row
    assert row["timing/idle/rank2"] >= row["timing/update_idle/rank2"] > 0 and row["sync/tensors"] > 0
    assert row["engine/version"] == 2 and row["rollout/policy_version"] == 1
    made = [json.loads(line) for line in (tmp_path / "separated" / "rollouts.jsonl").read_text().splitlines()]
    assert {r["rank"] for r in made} == {0} and {r["gen_rank"] for r in made} == {1, 2}  # trained on 0, made on 1-2
    if split == "true":
        assert all(r["gen_rank"] == 1 + r["sample"] * 2 // (max(x["sample"] for x in made) + 1) for r in made)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_actor_and_two_rollout_ranks_equal_the_two_rank_colocated_run_bit_for_bit(char_model_dir, tmp_path):
    model = f"model.path={char_model_dir}"
    torchrun(2, tmp_path / "colocated", model, "trainer.steps=2", *SPEC["off"])
    torchrun(4, tmp_path / "separated", model, "trainer.steps=2", *SPEC["off"], *separated(2))
    assert_same_run(tmp_path / "colocated", tmp_path / "separated", steps=2)
    assert "timing/rollout/rank3" in step_rows(tmp_path / "separated")[-1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deepspeed_zero2_on_two_actor_ranks_equals_the_two_rank_colocated_run_bit_for_bit(char_model_dir, tmp_path):
    extra = [f"model.path={char_model_dir}", "trainer.steps=2", *SPEC["off"], *LENGTH_REWARD,
             "actor.backend=deepspeed", "actor.zero_stage=2"]
    torchrun(2, tmp_path / "colocated", *extra)
    torchrun(4, tmp_path / "separated", *extra, *separated(2))
    assert_same_run(tmp_path / "colocated", tmp_path / "separated", steps=2)
    assert all(row["train/grad_norm"] > 0 for row in step_rows(tmp_path / "separated"))  # the actor learned
    assert step_rows(tmp_path / "separated")[-1]["sync/tensors"] > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deepspeed_zero3_on_one_actor_rank_equals_its_colocated_twin_and_resumes_mid_run_to_the_same_results(
        char_model_dir, tmp_path):
    # ZeRO-3 checkpoints hold the partitions, not a Hugging Face folder: the runs are compared by
    # their metrics, rollouts and held-out accuracy (steps 2 and 3 roll out with the weights pushed
    # after steps 1 and 2; the accuracy is the final push's).
    extra = [f"model.path={char_model_dir}", "trainer.steps=3", "trainer.save_every=1", *SPEC["off"], *LENGTH_REWARD,
             "actor.backend=deepspeed", "actor.zero_stage=3"]
    torchrun(1, tmp_path / "colocated", *extra)
    torchrun(3, tmp_path / "separated", *extra, *separated(1))
    assert_same_run(tmp_path / "colocated", tmp_path / "separated", steps=3, final_weights=False)
    assert all(row["train/grad_norm"] > 0 for row in step_rows(tmp_path / "separated"))  # the actor learned
    shutil.copytree(tmp_path / "separated", tmp_path / "resumed")
    torchrun(3, tmp_path / "resumed", *extra, *separated(1),
             f"trainer.resume={tmp_path / 'resumed' / 'checkpoints' / 'step-1'}")
    assert_same_run(tmp_path / "separated", tmp_path / "resumed", steps=3, final_weights=False)
    assert "resumed from" in (tmp_path / "resumed" / "rank0.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("spec, mode", [("on", "sync"), ("off", "async"), ("on", "async")])
def test_separated_equals_colocated_with_speculation_and_one_step_asynchrony(char_model_dir, tmp_path, spec, mode):
    extra = [f"model.path={char_model_dir}", "trainer.steps=3", *SPEC[spec],
             *(["trainer.async_steps=1"] if mode == "async" else [])]
    torchrun(2, tmp_path / "colocated", *extra)
    torchrun(4, tmp_path / "separated", *extra, *separated(2))
    assert_same_run(tmp_path / "colocated", tmp_path / "separated", steps=3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_actor_rank_trains_the_same_rollouts_with_losses_within_float32_reduction_order(char_model_dir, tmp_path):
    extra = [f"model.path={char_model_dir}", "trainer.steps=3", *SPEC["off"]]
    torchrun(2, tmp_path / "colocated", *extra)
    torchrun(3, tmp_path / "one-actor", *extra, *separated(1))
    two, one = tmp_path / "colocated", tmp_path / "one-actor"
    assert rollouts(two, by_rank=False) == rollouts(one, by_rank=False)
    for x, y in zip(step_rows(two), step_rows(one), strict=True):
        assert x["reward/mean"] == y["reward/mean"]
        assert y["train/grad_norm"] == pytest.approx(x["train/grad_norm"], rel=1e-5)
    wa, wb = weights(two, 3), weights(one, 3)
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-7) for k in wa)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_rollout_rank_ends_the_job_and_a_resume_continues_as_if_uninterrupted(char_model_dir, tmp_path):
    extra = [f"model.path={char_model_dir}", "trainer.steps=4", "trainer.save_every=1", *SPEC["off"], *separated(2)]
    pids = tmp_path / "pids"
    pids.mkdir()
    killed = torchrun(4, tmp_path / "run", *extra, module="tests.mp.killed_rank_train", check=False,
                      env={"TAILSPEC_TEST_PIDS": str(pids), "TAILSPEC_TEST_KILL_RANK": "3", "TAILSPEC_TEST_KILL_STEP": "3"})
    assert killed.returncode != 0
    assert "rank      : 3" in killed.stderr and "SIGKILL" in killed.stderr, killed.stderr[-3000:]  # torchrun names it
    for pid in (int(f.read_text()) for f in pids.iterdir()):  # every rank is gone (none left waiting on a peer)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert len(list(pids.iterdir())) == 4
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-1", "step-2"]

    torchrun(4, tmp_path / "run", *extra, "trainer.resume=auto")
    torchrun(4, tmp_path / "uninterrupted", *extra)
    assert_same_run(tmp_path / "uninterrupted", tmp_path / "run", steps=4)


HISTORY = ("spec/history_coverage", "spec/history_accept_len")


def history_rows(run_dir: Path) -> list[dict]:
    return [{k: row.get(k) for k in HISTORY} for row in step_rows(run_dir)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_history_drafts_on_the_rollout_ranks_draft_as_the_colocated_run_and_resume_with_their_store(
        char_model_dir, tmp_path):
    # 8 problems, 4 a step: the prompts of steps 1-2 recur at steps 3-4, drafted from their earlier responses.
    extra = [f"model.path={char_model_dir}", "trainer.steps=4", "trainer.save_every=1", "task.train_problems=8",
             "engine.spec.drafter=history+ngram", "engine.spec.depth=4", "engine.spec.verify_tokens=4",
             "engine.spec.history_min_match=2", *LENGTH_REWARD]
    torchrun(2, tmp_path / "colocated", *extra)
    torchrun(4, tmp_path / "separated", *extra, *separated(2))
    assert_same_run(tmp_path / "colocated", tmp_path / "separated", steps=4)
    drafted = history_rows(tmp_path / "separated")
    assert drafted == history_rows(tmp_path / "colocated")  # the same store: history drafted the same row-steps
    assert drafted[3]["spec/history_coverage"] > drafted[0]["spec/history_coverage"], drafted  # a recurring step
    # Resumed after step 2, the rollout ranks draft steps 3-4 from the store the checkpoint kept.
    shutil.copytree(tmp_path / "separated", tmp_path / "resumed")
    torchrun(4, tmp_path / "resumed", *extra, *separated(2),
             f"trainer.resume={tmp_path / 'resumed' / 'checkpoints' / 'step-2'}")
    assert history_rows(tmp_path / "resumed") == drafted
    assert_same_run(tmp_path / "separated", tmp_path / "resumed", steps=4)
