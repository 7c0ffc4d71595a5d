"""The update window: a separated placement's rollout rank waiting through the actor's update.

In a separated placement (pipeline.placement) a rollout rank, once it has sent a step's
rollouts, has nothing to do until actor rank 0 pushes the next policy version: the whole
actor update is idle time on the rollout side. The window opens when the rank has sent its
rollouts and closes when the push of `version` is announced. The announcement is a control
plane key in the job's store (`PushFlag`): actor rank 0 sets `<scope>/push/<version>` to its
clock just before the push's first collective, so a rollout rank polls it between units of
work (a store check, no collective) and knows when the idle time it filled ended. Participation
per window is decided by the key alone: every rollout rank works until it sees it, no rendezvous.

`UpdateWindow.make_dummy` builds a window in memory on any clock, for tests of the work's logic.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class UpdateWindow:
    step: int  # the RL step whose rollouts this rank has just sent (its last tail window's step)
    version: int  # the policy version whose push ends the window
    started: float  # clock() when the rank had sent its rollouts
    pushed: Callable[[], bool]  # the push of `version` is announced (cheap: a store check)
    pushed_at: Callable[[], float]  # clock() at the announcement; blocks until there is one
    clock: Callable[[], float] = time.time

    @classmethod
    def make_dummy(cls, *, clock: Callable[[], float], pushed_at: float, wait: Callable[[float], None], step: int = 1,
                   version: int = 2, started: float | None = None) -> UpdateWindow:
        """A window in memory: the push is announced once clock() >= pushed_at; `pushed_at()` calls
        `wait(pushed_at)` (on a fake clock: advance it) and returns it."""

        def at() -> float:
            if clock() < pushed_at:
                wait(pushed_at)
            return pushed_at

        return cls(step=step, version=version, started=clock() if started is None else started,
                   pushed=lambda: clock() >= pushed_at, pushed_at=at, clock=clock)


class PushFlag:
    """The push announcements of one run in the job's store (a torch.distributed Store); `scope`
    is unique per run within the job and the same on every rank."""

    def __init__(self, store, scope: str, clock: Callable[[], float] = time.time) -> None:
        self.store, self.scope, self.clock = store, scope, clock

    def key(self, version: int) -> str:
        return f"{self.scope}/push/{version}"

    def announce(self, version: int) -> None:
        """Actor rank 0, just before pushing `version`: the rollout ranks' update windows end."""
        self.store.set(self.key(version), repr(self.clock()))

    def announced(self, version: int) -> bool:
        return self.store.check([self.key(version)])

    def announced_at(self, version: int) -> float:
        """The announcement's clock(); blocks until it is made (the store's get waits for the key)."""
        return float(self.store.get(self.key(version)).decode())

    def window(self, step: int, version: int) -> UpdateWindow:
        """The update window opening now on a rollout rank that has sent step `step`'s rollouts."""
        return UpdateWindow(step=step, version=version, started=self.clock(), pushed=lambda: self.announced(version),
                            pushed_at=lambda: self.announced_at(version), clock=self.clock)
