"""TailSpec's rollout engine.

Importing it before torch sets one OpenMP default (an existing setting wins): GOMP_SPINCOUNT=10000,
worker threads spin briefly between ops and then sleep. Sleeping at once (OMP_WAIT_POLICY=PASSIVE)
cost ~40% of a small-model decode step on the 2-core machines here; spinning without bound (the
ACTIVE policy) costs >10x when another process shares the cores. Set OMP_WAIT_POLICY=PASSIVE
yourself when the cores are shared.
"""

import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")
