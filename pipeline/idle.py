"""The idle window: what a rank does between finishing its rollouts and the step barrier.

In a synchronous step every rank waits for the slowest one (the long tail); that wait is the
bubble spot training ([D]) and bubble drafts ([F]) fill. `IdleWork` is the hook they implement:
`work(others_done)` runs preemptible work until `others_done()` is true (every rank has finished
its rollouts) and returns its metrics. With no work plugged in, a rank simply waits at the
barrier. Either way the loop measures the wait per rank (`timing/idle/rank{r}`).

Completion is counted in the job's TCPStore (torch.distributed's default store: the control
plane), so a rank can poll it between micro-steps without a collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch.distributed as dist

from pipeline.dist import Ranks, timed_barrier


class IdleWork(Protocol):
    def work(self, others_done: Callable[[], bool]) -> dict[str, float]: ...


def idle_window(r: Ranks, step: int, work: IdleWork | None) -> tuple[float, dict[str, float]]:
    """Call once this rank's rollouts are done; returns (seconds until all ranks were done, metrics)."""
    t = time.perf_counter()
    if work is None:
        return timed_barrier(r), {}
    if r.world == 1:  # nobody to wait for
        return 0.0, work.work(lambda: True)
    store = dist.distributed_c10d._get_default_store()
    key = f"tailspec/rollouts_done/{step}"
    store.add(key, 1)
    metrics = work.work(lambda: store.add(key, 0) >= r.world)
    timed_barrier(r)
    return time.perf_counter() - t, metrics
