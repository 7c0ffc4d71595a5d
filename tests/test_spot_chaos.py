"""Preemption chaos for spot training: an elastic pool's members are SIGKILLed again and again at
random points over one separated RL run (a member's trainer alone, or its whole node: agent and
worker), and replaced. No drafter the run or the pool reads is ever corrupt (publications are
checked against their manifest on load, pool checkpoints against theirs), the pool never goes
back to an earlier state, the RL run equals the run without a pool, and no process or shared
memory segment is left. `make chaos` runs it with 50 kills (TAILSPEC_CHAOS_KILLS)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.checkpoint import load_checkpoint
from engine.spec.eagle import EagleConfig, EagleModel
from spot.pool.elastic import (LEFTOVER, MANIFEST, PUBLISHED, STOP, VERSION, WEIGHTS_FILE, publish, published_weights,
                       remove_leftovers, retire)
from spot.buffer.segment import SHM, node_segment
from spot.training.trainer import CKPT, SpotTrainer, checkpoints
from spot.training.step import DrafterOptim
from tests.conftest import REPO
from tests.mp import free_port
from tests.test_separated import assert_same_run, base, separated, step_rows, torchrun
from tests.test_separated_spot import spot
from tests.test_spot_pool import PROGRESS, START, descendants, kill_node, matches, version, wait_for


def test_a_publication_whose_bytes_differ_from_its_manifest_is_refused_by_name(char_model_dir, tmp_path):
    target = load_checkpoint(char_model_dir)
    torch.manual_seed(0)
    model = EagleModel(EagleConfig.for_target(target.config), target)
    _, folder = publish(model, tmp_path, micro_steps=3, keep=2)
    assert published_weights(folder).keys() == dict(model.named_parameters()).keys()
    weights = folder / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern in the last tensor
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"published drafter {folder}: {WEIGHTS_FILE} is corrupt"):
        published_weights(folder)
    weights.write_bytes(bytes(data[:-100]))  # a short file
    with pytest.raises(ValueError, match=r"is corrupt \(\d+ bytes, manifest.json says \d+"):
        published_weights(folder)
    (folder / MANIFEST).unlink()
    with pytest.raises(ValueError, match="not a whole publication"):
        published_weights(folder)
    retire(folder)  # pruning: a reader then finds no folder (FileNotFoundError: pruned), never a part of one
    assert not folder.exists() and not folder.with_name(folder.name + ".old").exists()
    with pytest.raises(FileNotFoundError):
        published_weights(folder)


def test_what_a_killed_writer_left_below_the_version_written_is_removed_and_the_rest_kept(tmp_path):
    for name in ("v1.tmp", "v2.old", "ckpt-3.tmp", "v5.tmp", "v4"):
        (tmp_path / name).mkdir()
    for name in (".ckpt-2.claim", ".ckpt-6.claim", ".LATEST.tmp"):
        (tmp_path / name).touch()
    remove_leftovers(tmp_path, VERSION, below=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".LATEST.tmp", ".ckpt-2.claim", ".ckpt-6.claim", "ckpt-3.tmp",
                                                          "v4", "v5.tmp"]
    remove_leftovers(tmp_path, CKPT, below=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".LATEST.tmp", ".ckpt-6.claim", "v4", "v5.tmp"]


# -- the chaos run ---------------------------------------------------------------------------------

KILLS = int(os.environ.get("TAILSPEC_CHAOS_KILLS", "8"))
SEED = int(os.environ.get("TAILSPEC_CHAOS_SEED", "0"))
STEPS = 4


def start_agent(port: int, pool: Path, model, drafter, buffer: str, log: Path) -> subprocess.Popen:
    """One pool member (a node): a torchrun agent whose rendezvous store is the test's (is_host=false),
    so any agent may be killed; it restarts its worker after any failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=chaos",
           "--rdzv-conf=is_host=false,join_timeout=120,last_call_timeout=1,close_timeout=5,keep_alive_interval=1,"
           "keep_alive_max_attempt=3,read_timeout=30",
           "--max-restarts=1000", "--monitor-interval=0.2",
           "-m", "launch.spot_pool", "--target", str(model), "--drafter", str(drafter), "--buffer", buffer,
           "--out", str(pool), "--checkpoint-every", "1", "--publish-every", "1", "--keep-published", "2",
           "--keep-checkpoints", "2", "--rows-per-step", "4", "--window", "64", "--log-every", "1", "--pg-timeout", "20"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with log.open("w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def start_run(run_dir: Path, hold: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "TAILSPEC_CPU_TUNE": "0", "TAILSPEC_TEST_HOLD": str(hold)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", "-m",
           "tests.mp.chaos_pool_train", "--config", str(REPO / "configs" / "tiny.yaml"), *base(run_dir), *overrides]
    with (run_dir.parent / "run.log").open("w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def workers(agent: subprocess.Popen) -> list[int]:
    """The agent's worker processes (launch.spot_pool), from /proc."""
    out = []
    for pid in descendants(agent.pid):
        try:
            if b"launch.spot_pool" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            pass
    return out


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds `text` (a run's unique folder)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            pass
    return found


def check_on_disk(pool: Path, model: EagleModel) -> int:
    """Every complete pool checkpoint and every publication reads whole (a corrupt one fails here),
    while the pool may be writing and pruning them; -> the newest complete checkpoint's micro-step."""
    newest = 0
    for n, path in checkpoints(pool / "checkpoints"):
        try:
            trainer = SpotTrainer.resume(path, model, DrafterOptim())
        except FileNotFoundError:  # pruned while read
            continue
        except ValueError as e:  # incomplete is allowed (a kill mid-write: latest_checkpoint skips it); corrupt is not
            assert "incomplete" in str(e), e
            continue
        assert trainer.micro_steps == n
        newest = max(newest, n)
    for folder in (pool / PUBLISHED).glob("v*"):
        if VERSION.fullmatch(folder.name):
            try:
                published_weights(folder)  # ValueError when a byte differs from its manifest, or it has none
            except FileNotFoundError:  # pruned while read
                pass
    return newest


def leftovers(folder: Path, names, newest: int) -> list[Path]:
    """Temporaries of killed writers below the newest version (the next write removes those)."""
    return [p for p in folder.iterdir()
            if (m := LEFTOVER.fullmatch(p.name)) and (v := names.fullmatch(m[1])) and int(v[1]) < newest]


def kill_plan(kills: int, steps: int, rng: random.Random) -> list[list[tuple[str, str, int, float]]]:
    """Per step, for each kill: what (a member's worker, or its node), which member, the micro-steps
    of progress to wait for first, and a delay after that progress (seconds), which lands the kill
    at a random point of a micro-step: in its meeting, its backward, its checkpoint or publication."""
    plan: list[list[tuple[str, str, int, float]]] = [[] for _ in range(steps)]
    for k in range(kills):
        plan[k % steps].append((rng.choice(["worker", "node"]), rng.choice("ab"), rng.randint(1, 3), rng.uniform(0, 0.4)))
    return plan


@pytest.mark.slow
@pytest.mark.timeout(300 + 90 * KILLS)
def test_random_sigkills_of_pool_members_over_a_run_leave_no_corrupt_drafter_the_same_run_and_nothing_behind(
        char_model_dir, char_drafter_dir, tmp_path):
    name = f"chaos-{uuid.uuid4().hex[:8]}"
    pool, hold, run_dir = tmp_path / "pool", tmp_path / "hold", tmp_path / "run"
    hold.mkdir()
    extra = [f"model.path={char_model_dir}", f"trainer.steps={STEPS}", *separated(1), *spot(char_drafter_dir)]
    on = [*extra, "spot.mode=pool", f"spot.pool_dir={pool}", f"spot.buffer_name={name}"]
    rng = random.Random(SEED)
    plan = kill_plan(KILLS, STEPS, rng)
    port, deadline = free_port(), time.monotonic() + 60 + 60 * KILLS
    store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))  # the rendezvous's, outliving every agent
    model = EagleModel.load(char_drafter_dir, load_checkpoint(char_model_dir))
    logs: list[Path] = [tmp_path / "run.log"]
    agents: dict[str, subprocess.Popen] = {}
    killed: list[str] = []

    def start(member: str) -> None:
        log = tmp_path / f"agent-{member}-{len(logs)}.log"
        logs.append(log)
        agents[member] = start_agent(port, pool, char_model_dir, char_drafter_dir, name, log)

    run = start_run(run_dir, hold, *on)

    def running() -> bool:  # a run that failed fails the test now, not at the deadline
        assert run.poll() is None, f"the run ended (exit {run.returncode}):\n{logs[0].read_text()[-4000:]}"
        return True

    try:
        for step, kills in enumerate(plan, 1):
            wait_for(f"the rollout ranks to hold before push {step}",
                     lambda: running() and {f"held-{step}-1", f"held-{step}-2"} <= set(os.listdir(hold)), deadline, logs)
            if step == 1:
                start("a")
                start("b")
            for what, member, progress, delay in kills:
                done = len(matches(PROGRESS, logs))
                wait_for(f"{progress} micro-step(s) of the pool before kill {len(killed) + 1} ({what} {member})",
                         lambda: running() and len(matches(PROGRESS, logs)) >= done + progress and workers(agents[member]),
                         deadline, logs)
                time.sleep(delay)  # not a synchronisation: where in a micro-step the kill lands
                if what == "worker":
                    for pid in workers(agents[member]):
                        os.kill(pid, signal.SIGKILL)
                else:
                    kill_node(agents[member])
                    start(member)
                killed.append(f"{what} {member}")
                check_on_disk(pool, model)
            if kills:  # the pool is whole again before the run moves on (a restart as the run closes finds no buffer)
                done = len([m for m in matches(PROGRESS, logs) if m[4] == "2"])
                wait_for(f"both members training again after step {step}'s kills",
                         lambda: running() and len([m for m in matches(PROGRESS, logs) if m[4] == "2"]) > done, deadline, logs)
            (hold / f"release-{step}").touch()
        assert run.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, logs[0].read_text()[-4000:]
        (pool / STOP).touch()
        for agent in agents.values():
            assert agent.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, "\n".join(
                p.read_text()[-1500:] for p in logs[1:])
    finally:
        for p in [run, *agents.values()]:
            if p.poll() is None:
                kill_node(p)
            else:
                for child in descendants(p.pid):
                    os.kill(child, signal.SIGKILL)
        del store
        segments = [p for p in os.listdir(SHM) if p.startswith(name)]
        for p in segments:  # a run killed above could not unlink its node's segment; a passing run left none
            os.unlink(SHM / p)
    assert len(killed) == KILLS, killed
    assert not processes_naming(str(tmp_path)), "processes of the run or the pool outlived the test"
    assert not segments  # the node's segment and its lock: the run removed them
    newest = check_on_disk(pool, model)
    assert not leftovers(pool / "checkpoints", CKPT, newest) and not leftovers(pool / PUBLISHED, VERSION, version(pool))
    # The pool never went back: each member's (re)starts, in its log's order, resumed at or past the one before.
    starts = [[int(m[3]) for m in matches(START, [log])] for log in logs[1:]]
    assert all(s == sorted(s) for s in starts), starts
    assert sum(map(len, starts)) > KILLS and newest >= max(max(s) for s in starts if s) > 0, starts
    rows = step_rows(run_dir)
    versions = [r["spot/drafter_version"] for r in rows]
    assert versions == sorted(versions) and versions[-1] > 0  # the run loaded the pool's publications
    assert version(pool) >= versions[-1]

    torchrun(3, tmp_path / "no-pool", *extra, "spot.enabled=false")
    assert_same_run(tmp_path / "no-pool", run_dir, steps=STEPS)  # drafts never change a token
    print(json.dumps({"kills": killed, "starts": starts, "versions": versions}))
