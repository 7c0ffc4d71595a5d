"""Work stealing: a step's work units claimed once each through the job's store.

A *unit* is one prompt's n samples (a GRPO group: one prefill, and its samples' lengths agree,
being set by the problem). The step's units are numbered in global order (the loader's global
step, rank 0's shard first) and every rank computes the same *plan*: one list of units per rank
(`plan_units`: the loader shards, or with predicted lengths a token-balanced deal, each list
longest first). `UnitQueue.take` walks this rank's own list, then steals from the other ranks'
lists from their ends (the work their owners would reach last); a unit is taken by whoever first
claims it (`store.add(key/unit, 1) == 1`, atomic), so each is handed out exactly once and no
rank waits for another to take one.

`StealingSource` feeds a rank's engine (an engine.source.RequestSource): while units remain it
keeps about `inflight` rows active, taking the next unit whenever finished rows leave room, so a
rank whose rows finish early takes the units a slower rank has not reached, and no rank idles
while a unit is left. Holding back (rather than admitting every unit at once) is what lets the
other ranks take them. The tokens of a unit do not depend on which rank took it or when: the
sampling noise is keyed by (seed, step, prompt, sample, position).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from engine.types import Request
from pipeline.shares import shard_shares, token_shares


def default_inflight(groups: int, n: int, world: int) -> int:
    """Rows a rank keeps active while units remain, by default: 7/8 of its share of the step's rows
    (at least one unit). Nearly the whole share starts at once, so a rank's batch is about as full
    as a static shard's, and the last eighth stays in the queue for whichever rank frees rows
    first. Holding back more costs on a CPU, where a decode step of half the rows costs little less
    than one of all of them: the held-back units run in a second, thinner wave (docs/BENCHMARKS.md,
    "Tail scheduling", measures the shares)."""
    return max(n, groups * n * 7 // (8 * world))


def plan_units(predicted: Sequence[float], n: int, world: int) -> list[list[int]]:
    """Each rank's units: its loader shard while every prediction is the same (nothing is known of
    the prompts), else the predicted tokens dealt longest first to the least loaded rank
    (pipeline.shares.token_shares), each list longest first (ties in global order)."""
    if len(set(predicted)) <= 1:
        return shard_shares(len(predicted), world)
    deal = token_shares([p * n for p in predicted], world)
    return [sorted(units, key=lambda g: -predicted[g]) for units in deal]


class UnitQueue:
    """The units of one step as `plans` (every rank's list; the same on every rank), taken by
    `rank` (`store`: the job's c10d store, or any object with its `add`; `key`: unique to the run
    and step, the same on every rank)."""

    def __init__(self, store, key: str, plans: Sequence[Sequence[int]], rank: int) -> None:
        self.store, self.key, self.rank = store, key, rank
        self.plans = [list(p) for p in plans]
        world = len(self.plans)
        self.own = 0  # next place in this rank's list
        self.victims = [(rank + k) % world for k in range(1, world)]  # the other ranks, in turn from the next one
        self.back = {v: len(self.plans[v]) for v in self.victims}  # places from the end of each other list not yet tried
        self.stolen = 0  # units taken from other ranks' lists

    def take(self) -> int | None:
        """The next unit this rank claims (its own list first), or None once every unit is taken."""
        mine = self.plans[self.rank]
        while self.own < len(mine):
            unit, self.own = mine[self.own], self.own + 1
            if self._claim(unit):
                return unit
        for v in self.victims:
            while self.back[v] > 0:
                self.back[v] -= 1
                unit = self.plans[v][self.back[v]]
                if self._claim(unit):
                    self.stolen += 1
                    return unit
        return None

    def _claim(self, unit: int) -> bool:
        return self.store.add(f"{self.key}/{unit}", 1) == 1


class StealingSource:
    """An engine.source.RequestSource over a UnitQueue: `requests[i]` is unit i's request. It
    records the units it took (`taken`, in order) and when (`first_at`, `last_at`: clock() of its
    first and last successful take; `empty_at`: when it found the queue empty)."""

    def __init__(self, queue: UnitQueue, requests: Sequence[Request], inflight: int,
                 clock: Callable[[], float] = time.time) -> None:
        if inflight < 1:
            raise ValueError(f"inflight must be >= 1 row, got {inflight}")
        if not requests or len({r.n for r in requests}) != 1:
            raise ValueError("StealingSource needs one or more requests, all with the same n (a step's GRPO groups)")
        self.queue, self.requests, self.inflight, self.clock = queue, list(requests), inflight, clock
        self.taken: list[int] = []
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.empty_at: float | None = None

    def pull(self, active: int, free: int) -> list[Request] | None:
        if self.empty_at is not None:
            return None
        out: list[Request] = []
        rows, room, n = active, free, self.requests[0].n
        # Whole units while they fit the in-flight target and the free slots; an idle engine takes
        # one whatever its size (a group larger than the batch is admitted in chunks).
        while not (out or rows) or (rows + n <= self.inflight and n <= room):
            unit = self.queue.take()
            now = self.clock()
            if unit is None:
                self.empty_at = now
                return out or None
            self.taken.append(unit)
            self.first_at = now if self.first_at is None else self.first_at
            self.last_at = now
            out.append(self.requests[unit])
            rows, room = rows + n, room - n
        return out
