"""`IdleWork`: the hook a kind of idle-window work implements (bubble pre-generation, spot training).

The loop calls, on every rank and every step, in this order:

    begin(step)                   as the step's rollouts start
    rollouts_done(step, batch)    after each of this rank's generate calls
    work(window) -> metrics       once this rank's rollouts are done: preemptible work until
                                  `window.others_done()`; returns without waiting for the window
                                  to close and without collectives on the default group
    through_update(window)        separated placement, rollout ranks only: once this rank has sent
                                  its rollouts, preemptible work until `window.pushed()` (the
                                  actor's next push is announced; common.idle.update), then it may
                                  post a collective on its own process group
    settle() -> metrics           after the actor's update: what finished later (an average across
                                  ranks posted as the window ended), collectives allowed

and, for checkpoints, `state_dict` / `load_state_dict` and `checkpoint_files` (files written
beside the checkpoint, by subfolder); `release()` frees what the work holds once it is shed for the
rest of the run (pipeline.memory_guard; the loop calls none of the moments after it). Every
method has a no-op default.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from common.idle.update import UpdateWindow
    from engine.types import RolloutBatch


class IdleWork:
    name = "idle"  # its key in a checkpoint's state and in a schedule

    def begin(self, step: int) -> None:
        pass

    def rollouts_done(self, step: int, batch: RolloutBatch) -> None:
        pass

    def work(self, window) -> dict[str, float]:
        return {}

    def through_update(self, window: UpdateWindow) -> None:
        pass

    def settle(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def checkpoint_files(self) -> dict[str, Callable[[Path], None]]:
        """Subfolder name -> a function writing this work's files into that folder of a checkpoint."""
        return {}

    def release(self) -> None:
        pass

    def drafter(self) -> torch.nn.Module | None:
        """The drafter network this work trains, when it holds one (checkpoints save it where the
        rollout backend holds no drafter in this process)."""
        return None
