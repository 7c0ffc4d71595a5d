"""Work stealing: a step's work units handed out by one atomic counter in the job's store.

A *unit* is one prompt's n samples (a GRPO group: one prefill, and its samples' lengths agree,
being set by the problem). The step's units are numbered in global order (the loader's global
step, rank 0's shard first) and put in a queue *order* every rank computes alike (long-first by
predicted length, or global order). `UnitQueue.take` is `store.add(key, 1)`: the counter's k-th
increment, on whichever rank, gets the order's k-th unit, so each unit is handed out exactly once
and no rank waits for another to take one.

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


class UnitQueue:
    """The units of one step, in `order`, each handed out once over every rank (`store`: the job's
    c10d store, or any object with its `add`; `key`: unique to the run and step, the same on every rank)."""

    def __init__(self, store, key: str, order: Sequence[int]) -> None:
        self.store, self.key, self.order = store, key, list(order)

    def take(self) -> int | None:
        """The next unit's global index, or None once every unit was taken."""
        k = self.store.add(self.key, 1) - 1
        return self.order[k] if k < len(self.order) else None


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
