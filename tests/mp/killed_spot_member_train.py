"""`python -m tests.mp.killed_spot_member_train ...`: launch.train, where every rank first writes its
pid to <TAILSPEC_TEST_PIDS>/rank{r}.pid, and rollout rank TAILSPEC_TEST_KILL_RANK kills itself
(SIGKILL) in the middle of its spot training through the actor's update of step
TAILSPEC_TEST_KILL_STEP (counted from 1): as its second micro-step of that update window asks for
rows. A crash at a known point, not a race with a timer."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import spot.separated as separated

rank = os.environ.get("RANK", "0")
Path(os.environ["TAILSPEC_TEST_PIDS"], f"rank{rank}.pid").write_text(str(os.getpid()))

if rank == os.environ.get("TAILSPEC_TEST_KILL_RANK"):
    kill_step = int(os.environ["TAILSPEC_TEST_KILL_STEP"]) - 1
    _through_update, _rows = separated.SeparatedSpotWork.through_update, separated.SeparatedSpotWork._rows
    calls = {"in_update": False, "rows": 0}

    def _through_update_marked(self, window):
        calls["in_update"] = window.step == kill_step
        return _through_update(self, window)

    def _rows_then_die(self, step):
        if calls["in_update"]:
            calls["rows"] += 1
            if calls["rows"] == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        return _rows(self, step)

    separated.SeparatedSpotWork.through_update = _through_update_marked
    separated.SeparatedSpotWork._rows = _rows_then_die

if __name__ == "__main__":
    from launch.train import main

    sys.exit(main())
