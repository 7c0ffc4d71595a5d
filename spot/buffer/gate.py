"""The node gate: a separated run's rollout ranks tell the node's spot-pool members when they may train.

A pool member (spot.pool.elastic) is a process of another torchrun job: it cannot reach the run's
TCPStore. What it shares with the run's rollout ranks on its node is the node's DataBuffer
segment in /dev/shm, so the gate lives in that segment's header page (`GATE_OFFSET`, after
spot.buffer.segment's header). It holds:

- `ranks`: how many rollout ranks gate the node (0: an ungated buffer, e.g. a colocated run's:
  a member trains whenever the buffer has rows);
- `states[slot]`: each gating rank's last (step, state) (common.idle.states.RankState), one
  int64 word, `step << 4 | code`, code 0 meaning no state (before the first step, after the run);
- `idle`: 1 while every gating rank is in a state that is not generation (`IDLE_STATES`), with
  `since`, the time.time() of the node's last idle/busy transition, and `idle_s`, the node's
  closed idle spans in seconds (cumulative);
- the members' counters: `pool_micro_steps` they trained on the node, `pool_train_s` of those
  micro-steps' seconds within the node's idle spans and `pool_overrun_s` past them.

Writers (a rank setting its state, a member adding a micro-step) hold the buffer's writers' lock
(an fcntl.flock), so a read-modify-write of the node's idle span is never interleaved; a
member's `trainable()` check reads the single aligned word `idle` without a lock (one load). The
clock is time.time(): every process on a node shares it.

Vocabulary: a rank is *idle* in its tail window and through the actor's update; the node is idle
when every gating rank is; a member *trains* a micro-step when its node is idle and the buffer
has rows. This module knows nothing of training or of the run's loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from common.idle.states import RankState

GATE_OFFSET = 512  # bytes into the segment's header page (spot.buffer.segment's header is shorter)
GATE_SLOTS = 64  # gating ranks per node at most
GATE = np.dtype([
    ("ranks", "<i8"), ("idle", "<i8"), ("since", "<f8"), ("idle_s", "<f8"),
    ("pool_micro_steps", "<i8"), ("pool_train_s", "<f8"), ("pool_overrun_s", "<f8"),
    ("states", "<i8", (GATE_SLOTS,)),
])
CODES = {state: i + 1 for i, state in enumerate(RankState)}  # 0: no state
STATES = {code: state for state, code in CODES.items()}
IDLE_STATES = frozenset({RankState.IDLE, RankState.TRAINING, RankState.BARRIER})  # not generating


@dataclass(frozen=True)
class GateCounters:
    """The node's cumulative figures at one moment (`NodeGate.counters`); subtract two for a span."""

    idle_s: float  # the node's idle seconds, the open span up to the moment included
    micro_steps: int  # micro-steps the node's members trained
    train_s: float  # their seconds within the node's idle spans
    overrun_s: float  # their seconds after the node turned busy

    def __sub__(self, other: GateCounters) -> GateCounters:
        return GateCounters(self.idle_s - other.idle_s, self.micro_steps - other.micro_steps,
                            self.train_s - other.train_s, self.overrun_s - other.overrun_s)


class NodeGate:
    """The gate of one DataBuffer (its `gate_fields` record and `writers_lock`); see the module docstring."""

    def __init__(self, buffer, clock: Callable[[], float] = time.time) -> None:
        self.buffer, self.clock = buffer, clock

    @property
    def _g(self) -> np.ndarray:
        return self.buffer.gate_fields

    @property
    def ranks(self) -> int:
        return int(self._g["ranks"])

    def states(self) -> list[tuple[int, RankState] | None]:
        """Each gating rank's (step, state), None where it has none."""
        out = []
        for word in self._g["states"][: self.ranks].tolist():
            out.append((word >> 4, STATES[word & 15]) if word & 15 else None)
        return out

    def set(self, slot: int, step: int, state: RankState | None) -> None:
        """Gating rank `slot` is in `state` at `step` (None: it has none, e.g. its run ended);
        the node's idle span opens or closes when this changes whether every rank is idle."""
        if not 0 <= slot < self.ranks:
            raise ValueError(f"gate slot {slot} is not one of the node's {self.ranks} gating ranks")
        with self.buffer.writers_lock():
            g = self._g
            g["states"][slot] = (step << 4 | CODES[state]) if state is not None else 0
            idle = all(s is not None and s[1] in IDLE_STATES for s in self.states())
            if idle != bool(g["idle"]):
                now = self.clock()
                if not idle:
                    g["idle_s"] += now - float(g["since"])
                g["since"] = now
                g["idle"] = int(idle)

    def idle(self) -> bool:
        """Every gating rank is idle (False on an ungated buffer: no rank says so)."""
        return bool(self._g["idle"])

    def trainable(self) -> bool:
        """A member may train now: the buffer is ungated, or its node is idle and the run that
        owns it is alive (a crashed run leaves its last states behind)."""
        return self.ranks == 0 or (self.idle() and self.buffer.owner_alive())

    def add_training(self, t0: float, t1: float) -> None:
        """A member trained a micro-step from t0 to t1 (this clock): counted within the node's idle
        span up to its end, the rest as overrun. A node that turned busy and idle again within
        the micro-step counts it all as within (only the last transition is kept)."""
        with self.buffer.writers_lock():
            g = self._g
            within = t1 - t0 if g["idle"] else max(0.0, min(t1, float(g["since"])) - t0)
            g["pool_micro_steps"] += 1
            g["pool_train_s"] += within
            g["pool_overrun_s"] += (t1 - t0) - within

    def counters(self) -> GateCounters:
        with self.buffer.writers_lock():
            g = self._g
            open_s = self.clock() - float(g["since"]) if g["idle"] else 0.0
            return GateCounters(float(g["idle_s"]) + open_s, int(g["pool_micro_steps"]), float(g["pool_train_s"]),
                                float(g["pool_overrun_s"]))


def initial_gate(ranks: int, now: float) -> np.ndarray:
    """The gate record of a new segment: `ranks` gating ranks, none with a state yet (busy)."""
    if not 0 <= ranks <= GATE_SLOTS:
        raise ValueError(f"a node's buffer is gated by 0..{GATE_SLOTS} rollout ranks, got {ranks}")
    g = np.zeros((), GATE)
    g["ranks"], g["since"] = ranks, now
    return g
