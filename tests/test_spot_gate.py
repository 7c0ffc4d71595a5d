"""The node gate in a DataBuffer's header: a node is idle only while every gating rank is, its idle
seconds and its members' training are counted on one clock, and a gate whose run died is closed."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from common.idle import RankState
from spot.buffer.ring import DataBuffer
from spot.buffer.gate import GATE_SLOTS, NodeGate
from spot.buffer.segment import SHM, segment_name
from tests.conftest import REPO


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def name():
    name = segment_name(f"gatetest-{uuid.uuid4().hex[:8]}")
    yield name
    if (SHM / name).exists():
        (SHM / name).unlink()


def test_the_node_is_idle_only_while_every_gating_rank_is_and_its_idle_spans_are_counted(name):
    clock = Clock()
    with DataBuffer.create(name, capacity_bytes=1 << 16, feature_size=4, gate_ranks=2) as buf:
        gate = NodeGate(buf, clock)
        assert gate.ranks == 2 and gate.states() == [None, None] and not gate.idle() and not gate.trainable()
        gate.set(0, 1, RankState.IDLE)
        assert not gate.idle()  # rank 1 has no state yet
        clock.now += 5
        gate.set(1, 1, RankState.IDLE)
        assert gate.idle() and gate.trainable() and gate.states() == [(1, RankState.IDLE), (1, RankState.IDLE)]
        clock.now += 3
        gate.set(0, 1, RankState.BARRIER)  # still not generating: the span goes on
        assert gate.idle()
        clock.now += 2
        assert gate.counters().idle_s == 5.0  # the open span, up to now
        gate.set(1, 2, RankState.GENERATING)
        assert not gate.idle() and gate.states()[1] == (2, RankState.GENERATING)
        clock.now += 100
        assert gate.counters().idle_s == 5.0  # busy time is not idle time
        gate.set(1, 2, RankState.IDLE)
        clock.now += 1
        gate.set(0, 2, None)  # the run closed on rank 0: busy, for good
        assert not gate.idle() and gate.counters().idle_s == 6.0
        with pytest.raises(ValueError, match="gate slot 2"):
            gate.set(2, 1, RankState.IDLE)


def test_a_members_micro_step_counts_within_the_idle_span_up_to_its_end_and_the_rest_as_overrun(name):
    clock = Clock()
    with DataBuffer.create(name, capacity_bytes=1 << 16, feature_size=4, gate_ranks=1) as buf:
        gate = NodeGate(buf, clock)
        gate.set(0, 1, RankState.IDLE)  # at 1000
        gate.add_training(1000.0, 1002.0)  # the node still idle: all within
        clock.now = 1003.0
        gate.set(0, 2, RankState.GENERATING)
        gate.add_training(1002.0, 1004.5)  # generation resumed at 1003: 1 s within, 1.5 s past
        gate.add_training(1004.5, 1005.0)  # begun after the flip (it was in the pipe): all overrun
        c = gate.counters()
        assert (c.micro_steps, c.train_s, c.overrun_s, c.idle_s) == (3, 3.0, 2.0, 3.0)
        before = c
        clock.now = 1010.0
        gate.set(0, 3, RankState.IDLE)
        clock.now = 1012.0
        gate.add_training(1010.0, 1011.0)
        d = gate.counters() - before
        assert (d.micro_steps, d.train_s, d.overrun_s, d.idle_s) == (1, 1.0, 0.0, 2.0)


def test_an_ungated_buffer_is_always_trainable_and_too_many_gating_ranks_are_refused(name):
    with DataBuffer.create(name, capacity_bytes=1 << 16, feature_size=4) as buf:
        gate = NodeGate(buf)
        assert gate.ranks == 0 and gate.trainable() and not gate.idle()
    with pytest.raises(ValueError, match=f"0..{GATE_SLOTS} rollout ranks"):
        DataBuffer.create(name, capacity_bytes=1 << 16, feature_size=4, gate_ranks=GATE_SLOTS + 1)


def test_a_gate_whose_run_died_is_not_trainable_though_its_ranks_said_idle(name):
    # The creator sets its rank idle and dies without cleaning up (os._exit skips atexit).
    code = ("import os; from common.idle import RankState; from spot.buffer.ring import DataBuffer; from spot.buffer.gate import "
            f"NodeGate; b = DataBuffer.create({name!r}, capacity_bytes=1 << 16, feature_size=4, gate_ranks=1); "
            "NodeGate(b).set(0, 1, RankState.IDLE); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True,
                   timeout=120)
    buf = DataBuffer.attach(name)
    try:
        gate = NodeGate(buf)
        assert gate.idle() and not buf.owner_alive() and not gate.trainable()
    finally:
        buf.close()
