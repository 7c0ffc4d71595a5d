"""The elastic spot pool rehearsed (`make rehearse-pool`, configs/rehearse/pool.yaml): the 7B rehearsal in
the separated placement, its drafter trained by a pool with an agent on each of the two nodes
(launch.slurm.sbatch), as a two-node Slurm job on this machine, twice.

Once undisturbed: the pool trains with two members throughout, publishes, and the run loads its
drafters. Once with the second node's pool agent SIGKILLed with its worker as soon as the pool has
trained with both members: the survivor reports the lost member and trains alone; the node's launcher
(launch.pool_job agent), held with SIGSTOP until then, starts the agent again when let go, and the
pool is two again. Drafts never change a token (sampling is noise-indexed, verification exact): the
RL run's metrics per step and its final weights equal the undisturbed job's. Neither job leaves a
process or a DataBuffer segment behind.

Needs root on Debian; the two-node cluster and the inputs are tests/slurm/conftest.py's.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from launch.slurm.rehearse import Job, follow, metrics, submit
from spot.pool.elastic import latest_published
from spot.buffer.segment import SHM
from tests.slurm.test_rehearse import final_weights, job_processes, learned
from tests.test_spot_pool import descendants

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
START = re.compile(r"\[spot-pool \d+/\d+\] members (\d+), micro-step (\d+),")  # each member, at each (re)start
TRAINED = re.compile(r"\[spot-pool \d+/\d+\] micro-step \d+ loss .* members (\d+) ")  # rank 0's progress
LOST = "a member left during micro-step"  # a survivor, when a collective failed (spot.pool.elastic.MemberLost)
RESTARTED = "was killed by signal 9: starting it again"  # launch.pool_job agent


def pool_log(job: Job) -> str:
    """The pool's output: its agents', workers' and launchers' lines (one file per node host name;
    this machine's nodes share one)."""
    return "".join(p.read_text(errors="replace") for p in sorted(job.run_dir.glob("spot-pool-*.log")))


def members(job: Job) -> list[int]:
    """The pool's size at each member's (re)start, in the log's order."""
    return [int(m[0]) for m in START.findall(pool_log(job))]


def trained_by(job: Job, n: int) -> int:
    """Progress lines of the pool's rank 0 while it had `n` members."""
    return [int(m) for m in TRAINED.findall(pool_log(job))].count(n)


def published(pool: Path) -> int:
    latest = latest_published(pool)
    return latest[0] if latest else 0


def pool_processes(job: str, node: str) -> tuple[int, int]:
    """(the launcher, its agent) of the job's pool on `node`, from /proc."""
    launcher = agent = None
    for pid, where in job_processes(job).items():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if where == node and b"launch.pool_job\0agent" in cmd:
            launcher = pid
        elif where == node and b"torch.distributed.run" in cmd and b"launch.spot_pool" in cmd:
            agent = pid
    assert launcher and agent, f"no pool launcher and agent of job {job} on {node}: {job_processes(job)}"
    return launcher, agent


def wait_until(cluster, job: Job, what: str, check, timeout_s: float = 300) -> None:
    info = follow(cluster, job, timeout_s, echo=False, until=check)
    assert check(), (f"job {job.id} ended ({info.get('JobState')}) before {what}", job.out.read_text()[-3000:],
                     pool_log(job)[-3000:])


def left_behind(job: Job) -> tuple[dict, list[str]]:
    """The job's processes that outlived it (Slurm reaps the last for a few seconds) and its segments."""
    deadline = time.monotonic() + 60
    while job_processes(job.id) and time.monotonic() < deadline:
        time.sleep(1)
    return job_processes(job.id), sorted(p.name for p in SHM.glob(f"tailspec-{job.id}-*"))


def completed(cluster, job: Job) -> None:
    info = follow(cluster, job, timeout_s=900, echo=False)
    out = job.out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out[-3000:], pool_log(job)[-3000:])
    assert "the spot pool exited with status 0" in out, out[-3000:]
    assert left_behind(job) == ({}, []), left_behind(job)


@pytest.mark.timeout(2400)
def test_rehearse_pool_a_killed_pool_agent_shrinks_the_pool_it_grows_back_and_the_run_equals_the_undisturbed(
        inputs, cluster):
    whole = submit(cluster, "pool", inputs, [f"spot.pool_dir={inputs / 'pool-whole'}"])
    completed(cluster, whole)
    assert set(members(whole)) == {2} and LOST not in pool_log(whole), pool_log(whole)[-3000:]

    pool = inputs / "pool-killed"
    killed = submit(cluster, "pool", inputs, [f"spot.pool_dir={pool}"])
    t0, sizes_at = time.monotonic(), []
    wait_until(cluster, killed, "the pool training with two members", lambda: trained_by(killed, 2) >= 1, timeout_s=600)
    sizes_at.append((time.monotonic() - t0, "2 members training: kill"))
    launcher, agent = pool_processes(killed.id, cluster.nodes[1])
    os.kill(launcher, signal.SIGSTOP)  # the node's launcher waits: the survivor re-forms the pool alone first
    try:
        for pid in [agent, *descendants(agent)]:
            os.kill(pid, signal.SIGKILL)
        wait_until(cluster, killed, "the survivor alone", lambda: 1 in members(killed))
        sizes_at.append((time.monotonic() - t0, "1 member"))
    finally:
        os.kill(launcher, signal.SIGCONT)
    before = members(killed).count(2)
    wait_until(cluster, killed, "two members again", lambda: members(killed).count(2) >= before + 2)  # each starts
    sizes_at.append((time.monotonic() - t0, "2 members"))
    completed(cluster, killed)
    sizes_at.append((time.monotonic() - t0, f"job done, v{published(pool)} published"))
    print(f"pool of job {killed.id}, seconds after submission: {[(round(t), what) for t, what in sizes_at]}")
    sizes, log = members(killed), pool_log(killed)
    shrunk = sizes.index(1)
    assert sizes[:shrunk] == [2] * shrunk and 2 in sizes[shrunk:], sizes  # two, one, two again
    assert LOST in log and log.count(RESTARTED) == 1, log[-3000:]

    steps = learned(whole.run_dir)
    assert [r["step"] for r in steps if "train/loss" in r] == [1, 2, 3]
    assert any(r.get("train/grad_norm", 0) > 0 for r in steps)  # some step updated the policy
    assert learned(killed.run_dir) == steps  # the same tokens, rewards, losses, whatever the drafter
    a, b = final_weights(whole.run_dir, 3), final_weights(killed.run_dir, 3)
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.equal(a[k], b[k]) for k in a)
    served = {job.id: [r["spot/drafter_version"] for r in metrics(job.run_dir) if "spot/drafter_version" in r]
              for job in (whole, killed)}
    print(f"drafter versions served at steps 1-3, by job: {served}")
    assert all(v == sorted(v) for v in served.values()), served
    assert served[whole.id][-1] > 0, served  # the rollout ranks followed the pool (the killed one's may not have yet)
