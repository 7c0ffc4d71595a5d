"""`python -m tests.mp.killed_rank_train ...`: launch.train, where every rank first writes its pid
to <TAILSPEC_TEST_PIDS>/rank{r}.pid, and rank TAILSPEC_TEST_KILL_RANK kills itself (SIGKILL) in
the middle of step TAILSPEC_TEST_KILL_STEP (counted from 1): after its rollouts, before it sends
them. A crash at a known point, not a race with a timer."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pipeline.separated.rollout as separated_rollout

rank = os.environ.get("RANK", "0")
Path(os.environ["TAILSPEC_TEST_PIDS"], f"rank{rank}.pid").write_text(str(os.getpid()))

if rank == os.environ.get("TAILSPEC_TEST_KILL_RANK"):
    _roll_out = separated_rollout.roll_out

    def _roll_out_then_die(engine, tokenizer, problems, params, *args, **kwargs):
        out = _roll_out(engine, tokenizer, problems, params, *args, **kwargs)
        if params.step + 1 == int(os.environ["TAILSPEC_TEST_KILL_STEP"]):
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    separated_rollout.roll_out = _roll_out_then_die

if __name__ == "__main__":
    from launch.train import main

    sys.exit(main())
