"""The idle window: what a rank does between finishing its rollouts and the step barrier.

In a synchronous step every rank waits for the slowest one (the long tail); that wait is the
bubble spot training ([D]) and bubble drafts ([F]) fill. `IdleWork` is the hook they implement:
`begin(step)` as the step's rollouts start, `rollouts_done(step, batch)` after each of this
rank's generate calls, and `work(window)` once this rank's rollouts are done: preemptible work
until `window.others_done()` is true (every rank has finished its rollouts), returning its
metrics; work that may finish later (spot training's average across ranks, posted as the window
ends) also has `settle()`, which the loop calls after the actor's update and which returns the
rest of its metrics. With no work plugged in, a rank simply waits at the barrier. With work there
is no barrier after it: a rank's window closes once it has seen every rank done and its work has
stopped, and the ranks meet at the step's next collective. Where the actor recomputes the old
log-probs first (a forward with no collective), the last rank goes straight on to it, while an
early rank finishes the micro-step it had in flight (up to a chunk, ~7-13 ms on the tiny config)
inside its own shorter share of that forward (its responses were the shorter ones), off the last
rank's critical path. Where the engine's log-probs serve (the tiny config), the ranks meet at the
update's first collective and that wait is there instead, as it was at the barrier
(`spot/overrun_s` reports it). Either way the loop measures the window per rank
(`timing/idle/rank{r}`: until this rank left it).

Completion is counted in the job's TCPStore (torch.distributed's default store: the control
plane), so a rank can poll it between micro-steps without a collective. Its keys are scoped to
the run (`scope`, pipeline.trainer: the run folder and how many runs this process has made): one
job can run several RL runs in turn (bench.runs), and the store outlives each of them; a count
left by an earlier run's step would end a later run's window before it opened. The last rank to finish
also stores the wall-clock time it did (`window.all_done_at()`), so work can tell the idle time
it filled from any overrun past the end of the window.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from engine.types import RolloutBatch
from pipeline.dist import Ranks, timed_barrier


@dataclass
class IdleWindow:
    step: int
    rank: int
    world: int
    started: float  # time.time() when this rank's rollouts were done
    others_done: Callable[[], bool]  # every rank's rollouts are done (cheap: a store read)
    all_done_at: Callable[[], float]  # time.time() when the last rank was done; blocks until then
    scope: str = "tailspec"  # the run's prefix for keys in the job's store (idle_window)


class IdleWork(Protocol):
    def begin(self, step: int) -> None: ...

    def rollouts_done(self, step: int, batch: RolloutBatch) -> None: ...

    def work(self, window: IdleWindow) -> dict[str, float]: ...


def idle_window(r: Ranks, step: int, work: IdleWork | None, scope: str = "tailspec") -> tuple[float, dict[str, float]]:
    """Call once this rank's rollouts are done; returns (seconds until all ranks were done, metrics).
    `scope` prefixes the store's keys: unique per run within a job, the same on every rank."""
    t = time.perf_counter()
    if work is None:
        return timed_barrier(r), {}
    started = time.time()
    if r.world == 1:  # nobody to wait for
        return 0.0, work.work(IdleWindow(step, 0, 1, started, lambda: True, lambda: started, scope))
    store = dist.distributed_c10d._get_default_store()
    key, at_key = f"{scope}/rollouts_done/{step}", f"{scope}/rollouts_done_at/{step}"
    if store.add(key, 1) == r.world:
        store.set(at_key, repr(started))
    window = IdleWindow(step, r.rank, r.world, started, lambda: store.add(key, 0) >= r.world,
                        lambda: float(store.get(at_key).decode()), scope)
    metrics = work.work(window)
    window.all_done_at()  # work that stopped by itself still closes its window only when every rank is done
    return time.perf_counter() - t, metrics


class IdleSequence:
    """Several kinds of idle work in one window, in order (bubble pre-generation, then spot
    training): each runs until the window ends or it stops by itself; the next one starts then,
    with its own start time (so each reports its own share of the window)."""

    def __init__(self, works: list[IdleWork]) -> None:
        self.works = works

    def begin(self, step: int) -> None:
        for w in self.works:
            w.begin(step)

    def rollouts_done(self, step: int, batch: RolloutBatch) -> None:
        for w in self.works:
            w.rollouts_done(step, batch)

    def settle(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for w in self.works:
            if hasattr(w, "settle"):
                metrics.update(w.settle())
        return metrics

    def work(self, window: IdleWindow) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for i, w in enumerate(self.works):
            part = window if i == 0 else IdleWindow(window.step, window.rank, window.world, time.time(),
                                                    window.others_done, window.all_done_at, window.scope)
            metrics.update(w.work(part))
        return metrics

    # Checkpoints: the parts that have state (spot training) save it.
    def _stateful(self):
        return next((w for w in self.works if hasattr(w, "save")), None)

    def __getattr__(self, name: str):
        if name in ("save", "state_dict", "load_state_dict") and (w := self._stateful()) is not None:
            return getattr(w, name)
        raise AttributeError(name)
