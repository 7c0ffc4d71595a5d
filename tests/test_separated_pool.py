"""A separated run follows an elastic spot pool on its rollout ranks' nodes: the pool's members
(torchrun agents of their own job) train from the node's buffer while the node's rollout ranks are
idle, one of them is SIGKILLed, the survivor continues after rendezvous, the rollout ranks load a
drafter it published, and the run learns exactly what it learns without a pool."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from spot.buffer.segment import SHM, node_segment
from tests.test_separated import REPO, assert_same_run, base, separated, step_rows, torchrun
from tests.test_separated_spot import spot
from tests.test_spot_pool import (PROGRESS, START, STOP, Inputs, descendants, free_port, kill_node, matches,
                                  start_agent, store_up, version, wait_for)


def start_run(procs: int, run_dir, hold, *overrides: str) -> subprocess.Popen:
    """tests.mp.paced_pool_train under torchrun: the run holds before the push of version 2."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "TAILSPEC_CPU_TUNE": "0", "TAILSPEC_TEST_HOLD": str(hold), "TAILSPEC_TEST_HOLD_VERSION": "2"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", "-m",
           "tests.mp.paced_pool_train", "--config", str(REPO / "configs" / "tiny.yaml"), *base(run_dir), *overrides]
    with (run_dir.parent / "run.log").open("w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_separated_run_follows_an_elastic_pool_that_loses_a_member_and_learns_what_it_learns_without_one(
        char_model_dir, char_drafter_dir, tmp_path):
    name = f"pooltest-{uuid.uuid4().hex[:8]}"  # the job's buffer; each node's segment is node_segment(name)
    pool, hold = tmp_path / "pool", tmp_path / "hold"
    hold.mkdir()
    extra = [f"model.path={char_model_dir}", "trainer.steps=4", *separated(1), *spot(char_drafter_dir)]
    on = [*extra, "spot.mode=pool", f"spot.pool_dir={pool}", f"spot.buffer_name={name}"]
    inputs = Inputs(char_model_dir, char_drafter_dir, name, pool, 0)
    port, deadline = free_port(), time.monotonic() + 600
    logs = [tmp_path / f"agent-{n}.log" for n in "ab"] + [tmp_path / "run.log"]
    run = start_run(3, tmp_path / "run", hold, *on)
    agents: list[subprocess.Popen] = []
    try:
        # The run's rollout ranks (1, 2) hold in step 2's update window: the buffer has steps 1 and 2's
        # features and the node's gate says idle.
        wait_for("the rollout ranks to hold before push 2", lambda: {"held-1", "held-2"} <= set(os.listdir(hold)),
                 deadline, logs)
        agents.append(start_agent(port, inputs, logs[0], nnodes="1:2"))  # a hosts the rendezvous store
        wait_for("agent a's rendezvous store", lambda: store_up(port), deadline, logs)
        agents.append(start_agent(port, inputs, logs[1], nnodes="1:2"))
        wait_for("two members training and a publication",
                 lambda: len([m for m in matches(PROGRESS, logs) if m[4] == "2"]) >= 3 and version(pool) >= 1,
                 deadline, logs)
        alone_before = len([m for m in matches(START, logs) if m[2] == "1"])
        kill_node(agents[1])
        wait_for("the survivor to resume alone",
                 lambda: len([m for m in matches(START, logs) if m[2] == "1"]) > alone_before, deadline, logs)
        v_resumed = version(pool)
        wait_for("a publication by the survivor", lambda: version(pool) > v_resumed, deadline, logs)
        v_after = version(pool)
        (hold / "release").touch()
        assert run.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, logs[2].read_text()[-4000:]
        (pool / STOP).touch()
        assert agents[0].wait(timeout=max(1.0, deadline - time.monotonic())) == 0, logs[0].read_text()[-3000:]
    finally:
        for p in [run, *agents]:
            if p.poll() is None:
                kill_node(p)
            else:
                for child in descendants(p.pid):
                    os.kill(child, 9)
    assert not (SHM / node_segment(name)).exists()  # the run removed its node's segment
    starts = [(int(m[3]), int(m[2])) for m in matches(START, logs[:2]) if m[0] == "0"]  # (micro-step, members)
    assert 2 in [w for _, w in starts] and starts[-1][1] == 1, starts
    # the survivor resumed at or past every micro-step the two had completed: only the one in flight was lost
    done_by_two = max(int(m[2]) for m in matches(PROGRESS, logs[:2]) if m[4] == "2")
    assert starts[-1][0] >= done_by_two
    rows = step_rows(tmp_path / "run")
    versions = [r["spot/drafter_version"] for r in rows]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and versions == sorted(versions)
    assert versions[1] == 0 and min(versions[2:]) >= v_after > 0  # loaded after the kill, the survivor's
    assert rows[1]["spot/micro_steps"] > 0 and 0 < rows[1]["spot/train_s"] <= 2 * rows[1]["spot/idle_s"]
    assert all(r["spot/drafter_micro_steps"] > 0 for r in rows[2:])

    torchrun(3, tmp_path / "no-pool", *extra, "spot.enabled=false")
    assert_same_run(tmp_path / "no-pool", tmp_path / "run", steps=4)  # drafts never change a token
