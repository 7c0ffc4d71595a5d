"""One rank's idle window per RL step, opened from counts in the job's store.

A rank's window opens when its rollouts are done and closes when every rank's are (and its work
has stopped). There is no barrier after it: the ranks meet at the step's next collective. The
store (torch.distributed's TCPStore: the control plane) counts finished ranks under keys scoped
to the run (`scope`: one job may run several RL runs in turn, and the store outlives each), so a
rank polls it between units of work without a collective. The last rank to finish also stores
the time it did, so work can tell the idle time it filled from any overrun past the window's end.

`IdleWindow.make_dummy` builds a window in memory on any clock: a schedule's logic is tested in
one process; multi-process tests are for the store.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class IdleWindow:
    step: int
    rank: int
    world: int
    started: float  # clock() when this rank's rollouts were done (or, for a part of the window, when the part began)
    others_done: Callable[[], bool]  # every rank's rollouts are done (cheap: a store read); a part's own end
    all_done_at: Callable[[], float]  # clock() when the last rank was done; blocks until then
    opened_last: bool  # every other rank was done when this rank's window opened
    expected: float | None = None  # the window this rank expects: its recent windows' mean (None: none seen yet)
    scope: str = "tailspec"  # the run's prefix for keys in the job's store
    clock: Callable[[], float] = time.time
    budget: float | None = None  # a part's seconds at most (None: until the window ends)

    def elapsed(self) -> float:
        return self.clock() - self.started

    def from_now(self) -> IdleWindow:
        """The rest of this window, as a part of work that starts now."""
        return dataclasses.replace(self, started=self.clock())

    def part(self, ends: Callable[[], bool], budget: float | None) -> IdleWindow:
        """A part of this window starting now and ending when `ends()` (which includes the window's
        own end), planned to take at most `budget` seconds (None: the rest of the window)."""
        return dataclasses.replace(self, started=self.clock(), others_done=ends, budget=budget)

    @classmethod
    def make_dummy(cls, *, clock: Callable[[], float], ends_at: float, wait: Callable[[float], None], step: int = 1,
                   rank: int = 0, world: int = 2, started: float | None = None, expected: float | None = None,
                   opened_last: bool = False) -> IdleWindow:
        """A window in memory: the other ranks are done once clock() >= ends_at; `all_done_at()`
        calls `wait(ends_at)` (on a fake clock: advance it) and returns ends_at."""

        def all_done_at() -> float:
            if clock() < ends_at:
                wait(ends_at)
            return ends_at

        return cls(step=step, rank=rank, world=world, started=clock() if started is None else started,
                   others_done=lambda: clock() >= ends_at, all_done_at=all_done_at, opened_last=opened_last,
                   expected=expected, scope="dummy", clock=clock)


class IdleWindows:
    """Opens this rank's window of each step and remembers its length: the next one's `expected`
    is the mean of the last `memory` (which rank finishes last changes from step to step, so one
    window alone predicts the next badly). `store` is the job's store (None alone); `barrier()` is
    what a rank with no idle work does instead (a collective); `scope` is unique per run within a
    job, the same on every rank."""

    def __init__(self, store, rank: int, world: int, scope: str, barrier: Callable[[], None],
                 clock: Callable[[], float] = time.time, memory: int = 4) -> None:
        self.store, self.rank, self.world, self.scope = store, rank, world, scope
        self.barrier, self.clock = barrier, clock
        self.lengths: deque[float] = deque(maxlen=memory)  # this rank's last windows, seconds

    @property
    def expected(self) -> float | None:
        return sum(self.lengths) / len(self.lengths) if self.lengths else None

    def open(self, step: int) -> IdleWindow:
        started = self.clock()
        if self.world == 1:  # nobody to wait for
            return IdleWindow(step, 0, 1, started, lambda: True, lambda: started, True, self.expected, self.scope, self.clock)
        key, at_key = f"{self.scope}/rollouts_done/{step}", f"{self.scope}/rollouts_done_at/{step}"
        last = self.store.add(key, 1) == self.world
        if last:
            self.store.set(at_key, repr(started))
        return IdleWindow(step, self.rank, self.world, started, lambda: self.store.add(key, 0) >= self.world,
                          lambda: float(self.store.get(at_key).decode()), last, self.expected, self.scope, self.clock)

    def run(self, step: int, work) -> tuple[float, dict[str, float]]:
        """Call once this rank's rollouts are done, with its IdleWork (or None: a barrier); returns
        (seconds until every rank was done and the work had stopped, the work's metrics)."""
        t = time.perf_counter()
        if work is None:
            self.barrier()
            return time.perf_counter() - t, {}
        window = self.open(step)
        metrics = work.work(window)
        self.lengths.append(max(0.0, window.all_done_at() - window.started))  # work that stopped by itself waits for the end
        return time.perf_counter() - t, metrics
