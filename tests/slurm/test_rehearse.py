"""The cluster rehearsals (`make rehearse-7b`, `make rehearse-32b`; launch.slurm.rehearse) as two-node Slurm
jobs on this machine, and a node lost mid-step.

configs/7b.yaml's rehearsal runs twice: once straight through, once with the second node's processes
killed with SIGKILL in its second step (as a node crash or the OOM killer does). The killed job ends
by itself, leaving no process and no DataBuffer segment on either node; `scontrol requeue` restarts
it and it resumes from its checkpoint (trainer.resume=auto): every step's learning metrics and the
final weights equal the uninterrupted job's. configs/32b.yaml's rehearsal (separated placement,
DAPO) runs straight through.

Needs root on Debian (it apt-installs slurm-wlm and munge if missing). The two-node cluster and the
inputs are tests/slurm/conftest.py's, shared with the pool's rehearsal (test_rehearse_pool.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from launch.slurm.rehearse import Job, follow, metrics, submit
from spot.buffer.segment import SHM

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
# The metrics of what is learned: the same rows, rewards, losses and updates. Speculation's and spot
# training's figures depend on the idle time a run happens to have (its drafter trains in it), and
# timing / memory on the machine; the tokens do not (sampling is noise-indexed).
LEARNED = ("train/", "reward/mean", "reward/correct", "reward/boxed", "rollout/response_len", "eval/accuracy")


def learned(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k == "step" or k.startswith(LEARNED)}
            for r in metrics(run_dir) if "rollout/batch_size" in r or "eval/accuracy" in r]


def job_processes(job: str) -> dict[int, str]:
    """pid -> SLURMD_NODENAME of every process of Slurm job `job` on this host (the job's tasks)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = dict(x.split("=", 1) for x in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in x)
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
        if env.get("SLURM_JOB_ID") == job:
            out[int(pid)] = env.get("SLURMD_NODENAME", "")
    return out


def kill_node(job: str, node: str) -> list[int]:
    """SIGKILL every process of the job on `node`, as a node that crashes."""
    pids = [pid for pid, where in job_processes(job).items() if where == node]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def segments(run: str) -> list[str]:
    return sorted(p.name for p in SHM.glob(f"tailspec-{run}*"))


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Every tensor of the actor's checkpoint at `step` (each rank's ZeRO shard and its optimizer)."""
    out = {}

    def walk(prefix, x):
        if isinstance(x, torch.Tensor):
            out[prefix] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(f"{prefix}/{i}", v)

    for path in sorted((run_dir / "checkpoints" / f"step-{step}" / "actor").glob("zero_rank*.pt")):
        walk(path.name, torch.load(path, map_location="cpu", weights_only=False))
    return out


@pytest.mark.timeout(1500)
def test_rehearse_7b_two_nodes_a_killed_node_ends_the_job_cleanly_and_the_requeued_job_equals_the_uninterrupted(
        inputs, cluster):
    assert cluster.nodes == [f"{cluster.host}-n1", f"{cluster.host}-n2"]
    whole = submit(cluster, "7b", inputs)
    info = follow(cluster, whole, timeout_s=600, echo=False)
    out = whole.out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out[-3000:])
    steps = learned(whole.run_dir)
    assert [r["step"] for r in steps if "train/loss" in r] == [1, 2, 3]
    assert any(r.get("train/grad_norm", 0) > 0 for r in steps)  # some step updated the policy
    rank_logs = "".join((whole.run_dir / f"rank{r}.log").read_text() for r in range(2))
    for node in cluster.nodes:  # one rank per node, each with its node's own DataBuffer segment
        assert f"tailspec-rehearse-7b-{whole.id}-{node} " in rank_logs
    assert (whole.run_dir / "dashboard.png").is_file() and list((whole.run_dir / "wandb").glob("offline-run-*"))

    killed = submit(cluster, "7b", inputs)
    follow(cluster, killed, timeout_s=600, echo=False,
           until=lambda: (killed.run_dir / "checkpoints" / "step-1" / "state.json").is_file())
    assert kill_node(killed.id, cluster.nodes[1]), "no process of the job on the second node"
    info = follow(cluster, killed, timeout_s=300, echo=False)
    assert info["JobState"] in ("FAILED", "NODE_FAIL"), info
    deadline = time.monotonic() + 60
    while job_processes(killed.id) and time.monotonic() < deadline:  # Slurm reaps the first node's tasks
        time.sleep(1)
    assert not job_processes(killed.id), f"processes left: {job_processes(killed.id)}"
    assert not segments(f"rehearse-7b-{killed.id}"), segments(f"rehearse-7b-{killed.id}")
    out = killed.out.read_text()
    # the killed rank's segment, by the job's cleanup step (the nodes share this host's /dev/shm, so one node's
    # step may remove both nodes' segments: the first node's too when Slurm killed its rank before it could)
    removed = re.findall(r"removed \d+ DataBuffer segment\(s\) of dead owners: (.*)", out)
    assert f"tailspec-rehearse-7b-{killed.id}-{cluster.nodes[1]}" in ", ".join(removed).split(", "), out[-3000:]

    requeue = subprocess.run(["scontrol", "requeue", killed.id], env=cluster.env, capture_output=True, text=True)
    assert requeue.returncode == 0, requeue.stderr
    info = follow(cluster, killed, timeout_s=600, echo=False)
    out = killed.out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out[-3000:])
    assert "restart 1 on" in out and "resumed from" in (killed.run_dir / "rank0.log").read_text()
    assert learned(killed.run_dir) == steps  # every step, logged once, as the uninterrupted job's
    a, b = final_weights(whole.run_dir, 3), final_weights(killed.run_dir, 3)
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not segments("rehearse-7b-")


@pytest.mark.timeout(900)
def test_rehearse_32b_two_nodes_one_trains_one_rolls_out(inputs, cluster):
    job: Job = submit(cluster, "32b", inputs)
    info = follow(cluster, job, timeout_s=600, echo=False)
    out = job.out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out[-3000:])
    script = next(job.out.parent.glob("rehearse-32b-*.sbatch")).read_text()
    assert "# placement: separated: ranks 0-0 train (pipeline.actor_ranks=1), ranks 1-1 roll out" in script
    assert [r["step"] for r in learned(job.run_dir) if "train/loss" in r] == [1, 2, 3]
    assert "FAIL" not in out and "the run exited with status 0" in out
