"""Which idle work runs when: pre-generation first, for at most a share of the window, then spot
training, then waiting.

`IdleSchedule.phase` is a pure function of the window's clock: the seconds since the window
opened, the window this rank expects (its recent windows' mean), the duration of the work's
last unit (a decode step: no unit starts that would end past the budget) and whether the window
is over. Pre-generation gets `share` of the expected window; with nothing after it, or before any
window has been seen, it gets the whole window. `ScheduledIdle` runs the works by it, each in its
part of the window; the training work is called in every window, also one with no time left,
because its window end posts a collective every rank must join. `shed()` stops both works for the
rest of the run (every rank at the same step boundary, so no rank waits in a collective the others
skip); their state still goes into checkpoints.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.idle.window import IdleWindow
from common.idle.work import IdleWork


class Phase(str, enum.Enum):
    PREGENERATE = "pregenerate"
    TRAIN = "train"
    WAIT = "wait"


@dataclass(frozen=True)
class IdleSchedule:
    pregenerate: bool  # bubble drafts are on
    train: bool  # spot training (or a pool follower) is on
    share: float = 1.0  # of the expected window given to pre-generation, when training follows

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1:
            raise ValueError(f"bubble.share must be in (0, 1], got {self.share}")

    def pregen_budget(self, expected: float | None) -> float | None:
        """Seconds of pre-generation in a window expected to last `expected` (None: until it ends)."""
        if not self.pregenerate:
            return 0.0
        if not self.train or expected is None:
            return None
        return self.share * expected

    def phase(self, elapsed: float, expected: float | None, *, unit_s: float = 0.0, pregen_finished: bool = False,
              window_over: bool = False) -> Phase:
        """The phase `elapsed` seconds into the window; `unit_s`: the last unit of pre-generation's
        duration (the next one would take about as long)."""
        if window_over:
            return Phase.WAIT
        budget = self.pregen_budget(expected)
        if self.pregenerate and not pregen_finished and (budget is None or elapsed + unit_s <= budget):
            return Phase.PREGENERATE
        return Phase.TRAIN if self.train else Phase.WAIT


class ScheduledIdle(IdleWork):
    """The run's idle work: `pregen` (bubble drafts) and `train` (spot training or a pool
    follower), either may be None, run by `schedule`."""

    name = "idle"

    def __init__(self, schedule: IdleSchedule, pregen: IdleWork | None, train: IdleWork | None) -> None:
        if schedule.pregenerate != (pregen is not None) or schedule.train != (train is not None):
            raise ValueError("ScheduledIdle: the schedule's works and the works given differ")
        self.schedule, self.pregen, self.train = schedule, pregen, train
        self.parts = [w for w in (pregen, train) if w is not None]
        self.running = list(self.parts)  # what the moments still call: none once shed

    def begin(self, step: int) -> None:
        for w in self.running:
            w.begin(step)

    def rollouts_done(self, step: int, batch) -> None:
        for w in self.running:
            w.rollouts_done(step, batch)

    def shed(self) -> list[str]:
        """Stops both works for the rest of the run and frees what they hold; -> what stopped."""
        stopped = [name for w, name in ((self.pregen, "bubble drafts"), (self.train, "spot training"))
                   if w is not None and w in self.running]
        for w in self.running:
            w.release()
        self.running = []
        return stopped

    def work(self, window: IdleWindow) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if not self.running:
            return metrics
        if self.pregen is not None:
            budget = self.schedule.pregen_budget(window.expected)
            metrics.update(self.pregen.work(window.part(self._pregen_ends(window), budget)))
        if self.train is not None:
            metrics.update(self.train.work(window.from_now()))
        return metrics

    def _pregen_ends(self, window: IdleWindow) -> Callable[[], bool]:
        """Pre-generation's end, asked before and after every unit of its work."""
        last = [window.clock()]

        def ends() -> bool:
            now = window.clock()
            unit_s, last[0] = now - last[0], now
            phase = self.schedule.phase(now - window.started, window.expected, unit_s=unit_s,
                                        window_over=window.others_done())
            return phase is not Phase.PREGENERATE

        return ends

    def settle(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for w in self.running:
            metrics.update(w.settle())
        return metrics

    def state_dict(self) -> dict:
        return {w.name: w.state_dict() for w in self.parts}

    def load_state_dict(self, state: dict) -> None:
        for w in self.parts:
            if w.name in state:
                w.load_state_dict(state[w.name])

    def checkpoint_files(self) -> dict[str, Callable[[Path], None]]:
        return {k: v for w in self.parts for k, v in w.checkpoint_files().items()}

    def drafter(self):
        return next((d for w in self.parts if (d := w.drafter()) is not None), None)
