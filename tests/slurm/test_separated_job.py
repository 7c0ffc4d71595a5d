"""A real Slurm job in the separated placement (`make test-slurm`): the tiny config on 4 CPU ranks,
2 of them training and 2 rolling out, submitted by the same code path as `make train-7b`
(launch.slurm), run to the end; its training metrics equal those of a colocated 2-rank run of
the same config and seed started with torchrun directly.

Needs root on Debian (it apt-installs slurm-wlm and munge if missing) and starts its own one-node
cluster under a temporary folder (launch.slurm.local), which it stops and removes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.slurm.local import LocalSlurm, SlurmUnavailable
from tests.slurm.test_slurm_job import tiny_job_args

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slurm, pytest.mark.slow]
STEPS = 3
SEPARATED = ["pipeline.placement=separated", "pipeline.actor_ranks=2", "cluster.procs_per_node=4", "trainer.train_shares=shard"]


def train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if k == "step" or k.startswith("train/")} for r in rows if "rollout/batch_size" in r]


@pytest.mark.timeout(900)
def test_a_separated_slurm_job_trains_on_its_actor_ranks_as_the_colocated_run_does(char_model_dir, tmp_path):
    args = tiny_job_args(char_model_dir, tmp_path, steps=STEPS) + SEPARATED
    try:
        cluster = LocalSlurm(tmp_path / "cluster", cpus=2)
        cluster.__enter__()
    except SlurmUnavailable as e:
        pytest.skip(str(e))
    try:
        env = {**cluster.env, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run([sys.executable, "-m", "launch.slurm", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        job = proc.stdout.split("submitted job ")[1].split()[0]
        info = cluster.wait_job(job, timeout_s=600)
        out = (tmp_path / "slurm-logs" / f"tailspec-tiny-{job}.out").read_text()
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out[-3000:])
        script = next((tmp_path / "slurm-logs").glob("tiny-*.sbatch")).read_text()
        assert "# placement: separated: ranks 0-1 train (pipeline.actor_ranks=2), ranks 2-3 roll out" in script
        assert "FAIL" not in out and "the run exited with status 0" in out
    finally:
        cluster.close()
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "cluster")], capture_output=True, text=True).stdout
    assert not leftover.strip(), f"daemons left running: {leftover}"

    run_dir = tmp_path / "runs" / f"tiny-{job}"
    assert all((run_dir / f"rank{r}.log").is_file() for r in range(4))
    separated = train_rows(run_dir)
    assert [r["step"] for r in separated] == list(range(1, STEPS + 1))

    colocated_dir = tmp_path / "colocated"
    train_args = [a for a in args if not a.startswith(("cluster.", "pipeline."))] + [f"run.dir={colocated_dir}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "launch.train", *train_args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    colocated = train_rows(colocated_dir)
    assert separated == colocated  # rewards and losses bit for bit: the actor ranks train the colocated rows
