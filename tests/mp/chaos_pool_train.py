"""`python -m tests.mp.chaos_pool_train ...`: launch.train, where every rollout rank, before it
receives each weight push after a step (versions 1, 2, ...; the initial push, version 0, goes
by), writes <TAILSPEC_TEST_HOLD>/held-<version>-<rank> and waits until
<TAILSPEC_TEST_HOLD>/release-<version> exists. Every step then holds in its update window (the
nodes' gates idle, the step's features in the buffer) while a test kills spot pool members: the
kills spread over the whole run at known points, synchronised by files, not by a timer."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pipeline.separated.rollout as separated_rollout

HOLD = Path(os.environ["TAILSPEC_TEST_HOLD"])
_receive = separated_rollout.SeparatedRollout.receive_policy


def receive_when_released(self, version: int):
    if version == 0:
        return _receive(self, version)
    (HOLD / f"held-{version}-{os.environ['RANK']}").touch()
    while not (HOLD / f"release-{version}").exists():
        time.sleep(0.05)
    return _receive(self, version)


separated_rollout.SeparatedRollout.receive_policy = receive_when_released

if __name__ == "__main__":
    from launch.train import main

    sys.exit(main())
