"""The job's ranks: torch.distributed from torchrun's environment, and the few collectives the
loop needs on small values (barriers that are timed, per-rank floats, sums).

`python -m launch.train` runs as one process (world size 1, no process group) or under
`torchrun --nproc-per-node=R`: gloo on CPU (127.0.0.1 on one machine); on GPUs NCCL for CUDA tensors and gloo for CPU ones. The
process group is the control plane; bulk tensors go through the actor's backend (DDP / ZeRO)
and the actor's weight sync into the engine.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    """This process within a set of ranks: the whole job (`group` None: the default process group),
    or one role's group of a separated placement (pipeline.placement), where `rank` and `world`
    are the group's and the collectives below run over `group`."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    group: object = None  # a torch.distributed ProcessGroup; None: the default one

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_ranks(device: str = "cpu", timeout_s: float = 1800.0) -> Ranks:
    """Joins the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR...); alone without it.

    Collectives wait at most `timeout_s` (gloo raises after it): a dead peer ends the job."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        # On GPUs NCCL carries CUDA tensors (DDP, ZeRO, weight sync) and gloo the loop's small CPU
        # values (timed barriers, per-rank floats, loss sums): NCCL alone rejects CPU tensors.
        backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(local)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return Ranks(rank=rank, world=world, local_rank=local)


_RUNS = itertools.count()  # runs built in this process: part of their store scope


def run_scope(run_dir: str | Path) -> str:
    """The prefix of a run's keys in the job's store, `tailspec/<run folder>/<n>`: the same on every
    rank (each builds its runs in the same order, once each), distinct from an earlier run of the
    job (the store outlives a run). launch.run.build.build_run takes it once and hands it to every part
    that keeps keys there (idle windows, work queues, push announcements)."""
    return f"tailspec/{Path(run_dir).name}/{next(_RUNS)}"


def job_store(r: Ranks):
    """The job's store (the control plane: idle windows, rank states), or None alone. It is the
    store torchrun's rendezvous made for the default process group, shared by every rank; torch
    exposes it only through `_get_default_store`, read here and nowhere else."""
    if r.world == 1:
        return None
    return dist.distributed_c10d._get_default_store()


def shutdown() -> None:
    """Destroys every process group, first collecting the garbage that may still hold them (a DDP
    reducer, gloo work handles in reference cycles): left to the interpreter's exit, their C++
    destructors ran during finalization and aborted a rank that had finished ("terminate called
    without an active exception"), and torchrun then killed the ranks still reporting."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


def gather_floats(r: Ranks, values: list[float]) -> list[list[float]]:
    """Every rank's `values` (same length on every rank), indexed by rank."""
    if r.world == 1:
        return [list(values)]
    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(r.world)]
    dist.all_gather(out, t, group=r.group)
    return [o.tolist() for o in out]


def gather_objects(r: Ranks, value) -> list:
    """Every rank's picklable `value`, indexed by rank (small values: token lists of a step)."""
    if r.world == 1:
        return [value]
    out = [None] * r.world
    dist.all_gather_object(out, value, group=r.group)
    return out


def all_sum(r: Ranks, value: float) -> float:
    if r.world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=r.group)
    return float(t)


class PeerLost(RuntimeError):
    """A transfer with another rank failed: that rank died, or did not answer within the job's
    collective timeout (pipeline.timeout_s)."""


@contextlib.contextmanager
def transfer(what: str) -> Iterator[None]:
    """Turns a torch.distributed failure inside (gloo raises RuntimeError) into PeerLost naming `what`."""
    try:
        yield
    except PeerLost:
        raise
    except RuntimeError as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PeerLost(f"{what}: {detail}") from e
