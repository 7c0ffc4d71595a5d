"""The idle window: what a rank does between finishing its rollouts and the step's next collective.

In a synchronous RL step every rank waits for the slowest one (the long tail). That wait is the
*idle window* that bubble drafts (pre-generating the next step) and spot training (the drafter,
on idle ranks) fill. This package holds all of it and nothing of the works themselves:

- `window`: an `IdleWindow` (this rank's view: when it opened, whether every rank is done, when
  the last one was) and `IdleWindows`, which opens one per step from counts in the job's store;
  `IdleWindow.make_dummy` builds one in memory, on any clock, for tests of a schedule;
- `work`: `IdleWork`, the hook a kind of work implements (no-op defaults);
- `schedule`: which work runs when (pre-generation for at most `share` of the expected window,
  then spot training, then waiting), a pure function of the window's clock, and the
  `ScheduledIdle` that runs it;
- `states`: every rank's state in the store (GENERATING, IDLE, PREGENERATING, TRAINING, BARRIER);
- `rules`: when a rank puts its stashed features into the DataBuffer;
- `update`: a separated placement's rollout rank waiting through the actor's update (an
  `UpdateWindow`), ended by actor rank 0's announcement of its next push (`PushFlag`).

It lives in `common` because both the loop (pipeline) and the works (spot) use it, and neither
imports the other.
"""

from common.idle.rules import HELD_STEPS, stashes_to_hold
from common.idle.schedule import IdleSchedule, Phase, ScheduledIdle
from common.idle.states import ControlPlane, RankState
from common.idle.update import PushFlag, UpdateWindow
from common.idle.window import IdleWindow, IdleWindows
from common.idle.work import IdleWork

__all__ = ["HELD_STEPS", "ControlPlane", "IdleSchedule", "IdleWindow", "IdleWindows", "IdleWork", "Phase", "PushFlag",
           "RankState", "ScheduledIdle", "UpdateWindow", "stashes_to_hold"]
