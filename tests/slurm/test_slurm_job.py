"""A real Slurm (`make test-slurm`): the tiny config on 2 CPU ranks, submitted by the same code path
as `make train-7b` (launch.slurm), signalled as at its time limit so that it requeues itself,
resumed from its checkpoint, run to the end.

Needs root on Debian (it apt-installs slurm-wlm and munge if missing) and starts its own one-node
cluster under a temporary folder (launch.slurm.local), which it stops and removes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.slurm.local import LocalSlurm, SlurmUnavailable

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def tiny_job_args(model: Path, tmp: Path, steps: int) -> list[str]:
    return ["--config", "configs/tiny.yaml", f"model.path={model}", f"run.out_dir={tmp / 'runs'}",
            "task.train_problems=64", "task.eval_problems=4", "rollout.n=4", "rollout.max_new_tokens=16",
            "engine.max_batch=16", "engine.max_len=96", "engine.spec.enabled=true", "engine.spec.drafter=ngram",
            "engine.spec.depth=4", "engine.spec.verify_tokens=4", "engine.spec.max_active_batch=null",
            "spot.enabled=false", f"trainer.steps={steps}", "trainer.prompts_per_step=4", "trainer.eval_every=0",
            "trainer.save_every=1", "actor.micro_batch_tokens=256", "metrics.wandb=false", "metrics.dashboard=false",
            "cluster.procs_per_node=2", "cluster.cpus_per_task=2", "cluster.exclusive=false", "cluster.time=00:15:00",
            f"cluster.log_dir={tmp / 'slurm-logs'}", f"cluster.python={sys.executable}", "cluster.max_restarts=2"]


def wait_for(path: Path, slurm: LocalSlurm, job: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        state = slurm.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job} is {state} before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s:.0f} s"
        time.sleep(0.5)


@pytest.mark.timeout(900)
def test_a_slurm_job_of_the_tiny_config_trains_is_requeued_resumes_and_completes(char_model_dir, tmp_path):
    try:
        cluster = LocalSlurm(tmp_path / "cluster", cpus=2)
        cluster.__enter__()
    except SlurmUnavailable as e:
        pytest.skip(str(e))
    try:
        env = {**cluster.env, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run([sys.executable, "-m", "launch.slurm", *tiny_job_args(char_model_dir, tmp_path, steps=4)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        job = proc.stdout.split("submitted job ")[1].split()[0]
        run_dir = tmp_path / "runs" / f"tiny-{job}"

        # Once its first checkpoint is written, send the batch script the signal Slurm sends near the
        # time limit (--signal=B:USR1@S): the script requeues its own job.
        wait_for(run_dir / "checkpoints" / "step-1" / "state.json", cluster, job, timeout_s=300)
        signal = subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=cluster.env, capture_output=True, text=True)
        assert signal.returncode == 0, signal.stderr
        info = cluster.wait_job(job, timeout_s=480)
        out = (tmp_path / "slurm-logs" / f"tailspec-tiny-{job}.out").read_text()
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out[-3000:])
        assert info["Restarts"] == "1", info

        assert "preflight (in the job" in out and "FAIL" not in out
        assert f"restart 0 on" in out and f"restart 1 on" in out  # one line per attempt
        assert "time limit near: requeueing job" in out  # the script's USR1 trap did it
        assert "the run exited with status 0" in out
        rank0 = (run_dir / "rank0.log").read_text()
        assert "resumed from" in rank0 and (run_dir / "rank1.log").is_file()

        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [r["step"] for r in rows if "rollout/batch_size" in r]
        assert steps == [1, 2, 3, 4], steps  # no step lost or logged twice across the requeue
        assert all(r["world_size"] == 2 for r in rows if "world_size" in r)
        assert (run_dir / "checkpoints" / "step-4" / "state.json").is_file()
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["steps"] == 4
    finally:
        cluster.close()
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "cluster")], capture_output=True, text=True).stdout
    assert not leftover.strip(), f"daemons left running: {leftover}"
