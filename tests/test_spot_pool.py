"""The elastic spot pool: publishing and resuming in one process, bad input named, and three torchrun
agents on a real c10d rendezvous (two start, one joins late, one is SIGKILLed) ending with a drafter."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.checkpoint import load_checkpoint
from engine.spec.eagle import EagleConfig, EagleModel
from pipeline.dist import Ranks
from common.idle import RankState
from spot.buffer.ring import BufferEntry, DataBuffer
from spot.buffer.gate import NodeGate
from spot.buffer.segment import node_segment
from spot.training.features import TokenSequence, capture_features
from spot.pool.elastic import LATEST, PUBLISHED, STOP, PoolConfig, latest_published, published_weights, run_pool
from spot.training.trainer import SpotTrainer, latest_checkpoint
from tests.conftest import REPO


@dataclass
class Inputs:
    target: Path
    drafter: Path
    buffer: str
    out: Path
    feature_size: int

    def config(self, **kw) -> PoolConfig:
        base = dict(target=str(self.target), drafter=str(self.drafter), buffer=self.buffer, out=str(self.out),
                    rows_per_step=4, window=64, log_every=1)
        return PoolConfig(**(base | kw))


def filled_buffer(target, gate_ranks: int = 0) -> tuple[str, DataBuffer]:
    """(a job's buffer name, this node's new segment of it: 12 rows of the target's features (step 1),
    gated by `gate_ranks` ranks); a pool given the name attaches the segment (spot.buffer.segment.node_segment)."""
    job_buffer = f"pooltest-{uuid.uuid4().hex[:8]}"
    g = torch.Generator().manual_seed(0)
    V = target.config.vocab_size
    seqs = [TokenSequence(f"p{i}", 0, [1] + torch.randint(3, V, (20 + 3 * i,), generator=g).tolist(), 5)
            for i in range(12)]
    rows = capture_features(target, seqs)
    buf = DataBuffer.create(node_segment(job_buffer), capacity_bytes=4 << 20,
                            feature_size=rows[0].features.shape[1], gate_ranks=gate_ranks)
    for i, row in enumerate(rows):
        buf.put(BufferEntry(key=f"p{i}/0", step=1, policy_version=1, finished=True, prompt_len=row.prompt_len,
                            tokens=row.tokens, features=row.features))
    return job_buffer, buf


def make_inputs(char_model_dir, tmp_path, gate_ranks: int = 0):
    """A warm (random) drafter for the tiny target and a filled buffer (filled_buffer), unlinked after."""
    target = load_checkpoint(char_model_dir)
    torch.manual_seed(0)
    EagleModel(EagleConfig.for_target(target.config), target).save(tmp_path / "drafter")
    job_buffer, buf = filled_buffer(target, gate_ranks)
    try:
        yield Inputs(char_model_dir, tmp_path / "drafter", job_buffer, tmp_path / "out", buf.feature_size), buf
    finally:
        buf.unlink()


@pytest.fixture
def inputs(char_model_dir, tmp_path):
    yield from (i for i, _ in make_inputs(char_model_dir, tmp_path))


@pytest.fixture
def gated(char_model_dir, tmp_path):
    """inputs whose buffer is gated by one rollout rank, and that buffer (the run's side of the gate)."""
    yield from make_inputs(char_model_dir, tmp_path, gate_ranks=1)


def never() -> bool:
    return False


def test_a_pool_of_one_publishes_versions_and_resumes_where_it_stopped(inputs, char_model_dir):
    res = run_pool(inputs.config(micro_steps=6, publish_every=2, keep_published=2, checkpoint_every=4), Ranks(), never)
    assert (res.outcome, res.micro_steps, res.ran, res.published) == ("finished", 6, 6, 3)
    pub = inputs.out / PUBLISHED
    assert (pub / LATEST).read_text().strip() == "v3"
    assert sorted(p.name for p in pub.iterdir() if p.is_dir()) == ["v2", "v3"]  # keep_published=2
    version, path = latest_published(inputs.out)
    assert (version, path) == (3, pub / "v3")
    drafter = EagleModel.load(path, load_checkpoint(char_model_dir))
    warm = EagleModel.load(inputs.drafter, load_checkpoint(char_model_dir))
    assert not torch.equal(drafter.fc.weight, warm.fc.weight)
    weights = published_weights(path)  # what a rollout rank hands engine.load_drafter_weights
    assert weights.keys() == dict(warm.named_parameters()).keys()
    torch.testing.assert_close(weights["fc.weight"], drafter.fc.weight, rtol=0, atol=0)
    assert json.loads((path / "config.json").read_text())["spot_micro_steps"] == 6
    assert latest_checkpoint(inputs.out / "checkpoints").name == "ckpt-6"  # written at the end

    again = run_pool(inputs.config(micro_steps=8, publish_every=100), Ranks(), never)
    assert (again.micro_steps, again.ran, again.published) == (8, 2, 4)  # resumed at 6; the final publication
    assert json.loads((pub / "v4" / "config.json").read_text())["spot_micro_steps"] == 8


def test_a_preempt_flag_stops_within_one_micro_step_and_checkpoints_without_publishing(inputs):
    calls = []

    def preempted() -> bool:
        calls.append(1)
        return len(calls) > 3

    res = run_pool(inputs.config(checkpoint_every=100, publish_every=100), Ranks(), preempted)
    assert (res.outcome, res.micro_steps, res.published) == ("preempted", 3, None)
    assert latest_checkpoint(inputs.out / "checkpoints").name == "ckpt-3"
    assert latest_published(inputs.out) is None


def test_an_empty_buffer_is_waited_on_until_the_stop_file(inputs, tmp_path, capsys):
    empty = f"pooltest-empty-{uuid.uuid4().hex[:8]}"  # the job's name; the pool attaches this node's segment
    with DataBuffer.create(node_segment(empty), capacity_bytes=1 << 16, feature_size=inputs.feature_size):
        out = inputs.out

        def stop_on_second_look() -> bool:
            if (out / "looked").exists():
                (out / STOP).touch()
            out.mkdir(parents=True, exist_ok=True)
            (out / "looked").touch()
            return False

        res = run_pool(inputs.config(buffer=empty, poll_s=0.01), Ranks(), stop_on_second_look)
    assert (res.outcome, res.ran, res.published) == ("finished", 0, 1)  # the warm drafter, as v1
    assert f"waiting for rows in buffer {node_segment(empty)}" in capsys.readouterr().err


@pytest.mark.parametrize("which", ["target", "drafter", "buffer"])
def test_a_missing_input_is_named(inputs, tmp_path, which):
    cfg = inputs.config(**{which: str(tmp_path / "missing") if which != "buffer" else "tailspec-no-such-buffer"})
    with pytest.raises(FileNotFoundError, match="missing|tailspec-no-such-buffer"):
        run_pool(cfg, Ranks(), never)


def test_a_buffer_that_does_not_appear_within_the_wait_is_named_with_the_flag_to_wait_longer(inputs):
    with pytest.raises(FileNotFoundError, match=r"tailspec-no-such-buffer.*waited 0.05s.*--buffer-wait-s"):
        run_pool(inputs.config(buffer="tailspec-no-such-buffer", buffer_wait_s=0.05, poll_s=0.01), Ranks(), never)


def test_the_cli_names_a_missing_buffer_and_exits_1_without_a_traceback(inputs):
    res = subprocess.run([sys.executable, "-m", "launch.spot_pool", "--target", str(inputs.target), "--drafter",
                          str(inputs.drafter), "--buffer", "tailspec-no-such-buffer", "--out", str(inputs.out)],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
    assert res.returncode == 1
    assert "error:" in res.stderr and "tailspec-no-such-buffer" in res.stderr and "Traceback" not in res.stderr


def test_a_buffer_of_other_features_is_refused(inputs):
    other = f"pooltest-other-{uuid.uuid4().hex[:8]}"
    with DataBuffer.create(node_segment(other), capacity_bytes=1 << 16, feature_size=inputs.feature_size + 1):
        with pytest.raises(ValueError, match=f"features of size {inputs.feature_size + 1}"):
            run_pool(inputs.config(buffer=other), Ranks(), never)


def test_latest_published_is_none_before_the_first_and_refuses_a_dangling_latest(tmp_path):
    assert latest_published(tmp_path) is None
    (tmp_path / PUBLISHED).mkdir()
    (tmp_path / PUBLISHED / LATEST).write_text("v7\n")
    with pytest.raises(ValueError, match="v7"):
        latest_published(tmp_path)


# -- the node gate ---------------------------------------------------------------------------------

def test_a_member_trains_only_while_its_node_is_idle_and_stops_at_the_micro_step_boundary_after_a_flip(
        gated, monkeypatch):
    inputs, buf = gated
    gate, events = NodeGate(buf), []
    micro_step = SpotTrainer.micro_step

    def micro_step_observed(self, rows, **kw):
        events.append(("train", gate.idle()))
        out = micro_step(self, rows, **kw)
        if self.micro_steps == 3:  # generation resumes while micro-step 3 is in flight
            gate.set(0, 2, RankState.GENERATING)
        if self.micro_steps == 5:
            inputs.out.mkdir(parents=True, exist_ok=True)
            (inputs.out / STOP).touch()
        return out

    def preempted() -> bool:  # asked at every meeting and at every look while waiting
        if not gate.idle():
            events.append(("look", False))
            if sum(e == ("look", False) for e in events) in (2, 5):  # a tail window opens after 2 looks, then 3
                gate.set(0, 1 if len(events) < 4 else 2, RankState.IDLE)
        return False

    monkeypatch.setattr(SpotTrainer, "micro_step", micro_step_observed)
    res = run_pool(inputs.config(poll_s=5.0, gate_poll_s=0.001), Ranks(), preempted)
    assert (res.outcome, res.micro_steps, res.trained) == ("finished", 5, 5)
    # before the first IDLE: looks only; micro-steps 1-3 while idle; the flip during 3 stops it at the
    # boundary; it waits (3 looks) until the node is idle again, then trains 4 and 5
    assert events == [("look", False)] * 2 + [("train", True)] * 3 + [("look", False)] * 3 + [("train", True)] * 2
    c = gate.counters()
    assert c.micro_steps == 5 and c.train_s > 0 and c.idle_s >= c.train_s


def test_members_whose_node_generates_add_zero_weight_the_average_is_exactly_the_training_members(
        gated, char_model_dir, tmp_path):
    import torch.multiprocessing as mp

    from tests.mp import free_port
    from tests.mp.pool_member import worker

    inputs, busy = gated  # member 2's buffer: gated by a rank that is generating
    NodeGate(busy).set(0, 1, RankState.GENERATING)
    idle_name, idle = filled_buffer(load_checkpoint(char_model_dir))
    with idle:  # members 0 and 1: ungated, rows
        kw = dict(target=str(inputs.target), drafter=str(inputs.drafter), rows_per_step=4, window=64, log_every=1,
                  warmup_steps=0)
        mp.start_processes(worker, args=(3, free_port(), str(tmp_path), kw, idle_name, inputs.buffer), nprocs=3, join=True,
                           start_method="spawn")
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    assert [g["trained"] for g in got] == [1, 1, 0]
    ref = torch.load(tmp_path / "reference.pt")
    assert len(ref["grads"]) == len(ref["weights"]) > 0
    for g in got:  # every member stepped the two training members' mean gradient, bit for bit
        assert g["grads"].keys() == ref["grads"].keys()
        assert all(torch.equal(g["grads"][i], ref["grads"][i]) for i in ref["grads"])
        assert g["weights"].keys() == ref["weights"].keys()
        assert all(torch.equal(g["weights"][k], ref["weights"][k]) for k in ref["weights"])
    assert not torch.equal(ref["weights"]["fc.weight"], load_file(str(inputs.drafter / "model.safetensors"))["fc.weight"])


# -- three agents under torchrun -------------------------------------------------------------------

PROGRESS = re.compile(r"\[spot-pool (\d+)/(\d+)\] micro-step (\d+) loss ([\d.]+) .* members (\d+)")
START = re.compile(r"\[spot-pool (\d+)/(\d+)\] members (\d+), micro-step (\d+),")
FINISHED = re.compile(r"\[spot-pool (\d+)/(\d+)\] finished at micro-step (\d+) .* weights (\w+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_agent(port: int, inputs: Inputs, log: Path, nnodes: str = "2:3") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=pooltest",
           "--rdzv-conf=join_timeout=60,last_call_timeout=1,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=20",
           "--max-restarts=5", "--monitor-interval=0.5",
           "-m", "launch.spot_pool", "--target", str(inputs.target), "--drafter", str(inputs.drafter),
           "--buffer", inputs.buffer, "--out", str(inputs.out), "--checkpoint-every", "100000", "--publish-every", "5",
           "--rows-per-step", "4", "--window", "64", "--log-every", "1", "--pg-timeout", "20"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # see docs/SPOT_POOL.md: a late joiner hangs without it
    with log.open("w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every process below pid (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def kill_node(proc: subprocess.Popen) -> None:
    """A preempted node without notice: SIGKILL the agent's process group and its workers."""
    below = descendants(proc.pid)
    for kill in [lambda: os.killpg(proc.pid, signal.SIGKILL)] + [lambda p=p: os.kill(p, signal.SIGKILL) for p in below]:
        try:
            kill()
        except ProcessLookupError:
            pass
    proc.wait(timeout=10)


def store_up(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(what: str, check, deadline: float, logs: list[Path]) -> None:
    while not check():
        if time.monotonic() > deadline:
            tail = "\n".join(f"--- {p.name}\n" + p.read_text()[-2500:] for p in logs if p.exists())
            raise AssertionError(f"timed out waiting for {what}\n{tail}")
        time.sleep(0.2)


def matches(pattern: re.Pattern, logs: list[Path]) -> list[tuple]:
    return [m.groups() for p in logs if p.exists() for m in pattern.finditer(p.read_text())]


def version(out: Path) -> int:
    latest = latest_published(out)
    return latest[0] if latest else 0


@pytest.mark.slow
def test_three_members_one_late_one_killed_end_with_a_loadable_drafter(inputs, tmp_path, char_model_dir):
    port, deadline = free_port(), time.monotonic() + 150
    logs = [tmp_path / f"agent-{n}.log" for n in "abc"]
    agents: list[subprocess.Popen] = []
    try:
        agents.append(start_agent(port, inputs, logs[0]))  # a hosts the rendezvous store: it is never killed
        wait_for("agent a's rendezvous store", lambda: store_up(port), deadline, logs)
        agents.append(start_agent(port, inputs, logs[1]))
        wait_for("two members to publish v1", lambda: version(inputs.out) >= 1, deadline, logs)
        agents.append(start_agent(port, inputs, logs[2]))
        wait_for("three members training", lambda: len([m for m in matches(PROGRESS, logs) if m[4] == "3"]) >= 3,
                 deadline, logs)
        v_kill = version(inputs.out)
        kill_node(agents[1])
        wait_for("two versions more after the kill", lambda: version(inputs.out) >= v_kill + 2, deadline, logs)
        (inputs.out / STOP).touch()
        for a in (agents[0], agents[2]):
            assert a.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, logs[agents.index(a)].read_text()[-3000:]
    finally:
        for a in agents:
            if a.poll() is None:
                kill_node(a)
            else:
                for p in descendants(a.pid):
                    os.kill(p, signal.SIGKILL)
    starts = sorted((int(m[3]), int(m[2])) for m in matches(START, logs) if m[0] == "0")  # (micro-step, members)
    worlds = [w for _, w in starts]
    assert worlds[0] == 2 and 3 in worlds and worlds[-1] == 2, starts
    after_join = worlds.index(3)
    assert starts[after_join][0] > 0  # the joiner resumed the two members' checkpoint
    # After the kill the pool resumed at or past every micro-step the three members had completed:
    # only the one in flight was lost (checkpoint_every is far away: a survivor's rescue saved it).
    done_by_three = max(int(m[2]) for m in matches(PROGRESS, logs) if m[4] == "3")
    resumed_after_kill = next(s for s, w in starts[after_join:] if w == 2)
    assert resumed_after_kill >= done_by_three
    finished = matches(FINISHED, logs)
    assert len(finished) == 2 and len({(m[2], m[3]) for m in finished}) == 1  # both replicas, identical weights
    v_end, path = latest_published(inputs.out)
    assert v_end >= v_kill + 2
    drafter = EagleModel.load(path, load_checkpoint(char_model_dir))
    assert json.loads((path / "config.json").read_text())["spot_micro_steps"] == int(finished[0][2])
    assert drafter.fc.weight.isfinite().all()
