"""`python -m tests.mp.paced_pool_train ...`: launch.train, where every rollout rank, before it
receives the weight push of version TAILSPEC_TEST_HOLD_VERSION, writes <TAILSPEC_TEST_HOLD>/held-<rank>
and waits until <TAILSPEC_TEST_HOLD>/release exists. The run then holds in its update window (its
nodes' gates idle, the step's features in the buffer) while a test changes the spot pool's
membership: a pause at a known point, synchronised by files, not a race with a timer."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pipeline.separated.rollout as separated_rollout

HOLD, VERSION = Path(os.environ["TAILSPEC_TEST_HOLD"]), int(os.environ["TAILSPEC_TEST_HOLD_VERSION"])
_receive = separated_rollout.SeparatedRollout.receive_policy


def receive_when_released(self, version: int):
    if version == VERSION:
        (HOLD / f"held-{os.environ['RANK']}").touch()
        while not (HOLD / "release").exists():
            time.sleep(0.05)
    return _receive(self, version)


separated_rollout.SeparatedRollout.receive_policy = receive_when_released

if __name__ == "__main__":
    from launch.train import main

    sys.exit(main())
