"""`python -m tests.mp.late_rank_train ...`: launch.train under torchrun, where rank 1 starts taking
work units only once rank 0 has found the step's queue empty, so rank 0 generates every unit
(rank 1's loader shard included): a forced steal. Synchronised by a store key, not by time.
"""

from __future__ import annotations

import os
import sys

import pipeline.rollout.stealing as stealing

if os.environ.get("RANK") in ("0", "1"):
    _take = stealing.UnitQueue.take
    late = os.environ["RANK"] == "1"

    def _ordered_take(self):
        if late:
            self.store.wait([f"{self.key}/rank0_empty"])
        unit = _take(self)
        if unit is None and not late:
            self.store.set(f"{self.key}/rank0_empty", "1")
        return unit

    stealing.UnitQueue.take = _ordered_take

if __name__ == "__main__":
    from launch.train import main

    sys.exit(main())
