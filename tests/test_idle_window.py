"""The idle window's store keys are scoped to the run: a second RL run in the same job (bench.runs
runs several in one process group) opens real windows at the steps the first one already used."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from tests.mp.idle_worker import DELAY, worker
from tests.mp import free_port


def test_a_later_run_of_the_same_job_opens_its_own_windows(tmp_path):
    mp.start_processes(worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    seen = torch.load(tmp_path / "rank0.pt")
    assert len(seen) == 2
    for done_at_open, length in seen:  # rank 1 was still generating in both runs' windows
        assert not done_at_open and length > 0.5 * DELAY, seen
