"""A rank of the idle-window scope test: two runs' windows for the same step in one process group.

Rank 1 finishes its "rollouts" DELAY seconds after rank 0, in both runs. Rank 0 records, per run,
whether the others were done as its window opened and how long the window was; <out>/rank0.pt.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from common.idle import IdleWork

DELAY = 0.5


class Probe(IdleWork):
    def __init__(self) -> None:
        self.seen: list[tuple[bool, float]] = []

    def work(self, window) -> dict[str, float]:
        done_at_open = window.others_done()
        self.seen.append((done_at_open, window.all_done_at() - window.started))
        return {}


def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from common.idle import IdleWindows

        probe, store = Probe(), dist.distributed_c10d._get_default_store()
        for scope in ("tailspec/run-a/0", "tailspec/run-b/1"):  # two runs of one job, both at step 1
            dist.barrier()
            if rank == 1:
                time.sleep(DELAY)  # rank 1's rollouts take longer: a workload, not a synchronisation
            IdleWindows(store, rank, world, scope, barrier=dist.barrier).run(1, probe)
        if rank == 0:
            torch.save(probe.seen, os.path.join(out, "rank0.pt"))
    finally:
        dist.destroy_process_group()
