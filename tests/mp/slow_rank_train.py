"""`python -m tests.mp.slow_rank_train ...`: launch.train, with rank 1's rollouts DELAY seconds
(TAILSPEC_TEST_DELAY, default 0.3) longer every step, so rank 0 has an idle window of at least
that long in every step.

Without it, the idle windows of a test-sized run are whatever the two ranks' timing noise gives
(1-20 ms on a 2-core host): too short, now and then, for a single spot micro-step.
"""

from __future__ import annotations

import os
import sys
import time

from pipeline.rollout.schedule import RolloutSchedule

DELAY = float(os.environ.get("TAILSPEC_TEST_DELAY", "0.3"))

if os.environ.get("RANK") == "1":
    _generate = RolloutSchedule.generate

    def _slow_generate(self, *args, **kwargs):
        out = _generate(self, *args, **kwargs)
        time.sleep(DELAY)
        return out

    RolloutSchedule.generate = _slow_generate

if __name__ == "__main__":
    from launch.train import main

    sys.exit(main())
