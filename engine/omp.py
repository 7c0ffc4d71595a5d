"""The OpenMP default for entry points: call `openmp_default()` before torch is imported.

GOMP_SPINCOUNT=10000 (an existing setting wins): worker threads spin briefly between ops and
then sleep. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) makes a small model's decode step pay for
waking its threads every op; spinning without bound (the ACTIVE policy) starves a process that
shares the cores. Set OMP_WAIT_POLICY=PASSIVE yourself when the cores are shared. The
Makefile exports the same default. libgomp reads it once, when torch loads it: setting it after
`import torch` has no effect, which is why this is a function for entry points, not an import
side effect of the library.
"""

from __future__ import annotations

import os


def openmp_default() -> None:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
