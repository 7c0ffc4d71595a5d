"""Actor checkpoint folders: written atomically by all ranks together, checked before loading.

A folder holds what a backend needs to resume bit for bit (model, optimizer) plus each rank's
torch RNG state (`rng_rank{r}.pt`). Writing is collective: rank 0 owns the temporary folder
(common.atomic.atomic_folder), every rank writes its files into it, and it is renamed into place
only after all have finished. Loading first checks the files a backend names, so a malformed or
partial folder fails with its path and the missing names instead of deep inside torch. A folder
resumes on another number of ranks than saved it as far as the backend allows (load_rng: the RNG).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from common.atomic import atomic_folder


def rank_and_world(group=None) -> tuple[int, int]:
    """This rank and the size of `group` (None: the default process group); (0, 1) alone."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


@contextlib.contextmanager
def collective_folder(path: str | Path, group=None) -> Iterator[Path]:
    """Every rank of `group` (None: all) enters with the same target; each gets the shared
    temporary folder to write into. The group's rank 0 owns it."""
    rank, world = rank_and_world(group)
    if world == 1:
        with atomic_folder(path) as tmp:
            yield tmp
        return
    if rank == 0:
        with atomic_folder(path) as tmp:
            dist.broadcast_object_list([str(tmp)], group=group, group_src=0)
            yield tmp
            dist.barrier(group=group)  # the others have written their files
    else:
        box = [None]
        dist.broadcast_object_list(box, group=group, group_src=0)
        yield Path(box[0])
        dist.barrier(group=group)
    dist.barrier(group=group)  # the folder is in place before anyone reads it


def require_files(path: str | Path, names: list[str], what: str) -> Path:
    """Raises FileNotFoundError naming the folder and every missing file; names may be 'a|b' (either)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{what} checkpoint folder {path} does not exist")
    missing = [n for n in names if not any((path / alt).exists() for alt in n.split("|"))]
    if missing:
        raise FileNotFoundError(f"{what} checkpoint folder {path} is malformed: missing {', '.join(missing)}")
    return path


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def save_rng(folder: Path, rank: int) -> None:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    torch.save(state, folder / rng_file(rank))


def load_rng(folder: Path, rank: int) -> None:
    """Restores this rank's torch RNG state from `folder`; a rank the saving run did not have (a
    resume on more ranks) restores rank 0's.

    Rank 0's because a run's ranks start from equal states (launch.run.build seeds torch with run.seed on
    each), and a new rank's is then one the run has had; the run's sampling and data order are keyed
    and never read this state (pipeline.rollout.stage, pipeline.data), so it moves no result.
    """
    file = folder / rng_file(rank)
    state = torch.load(file if file.is_file() else folder / rng_file(0), weights_only=True)
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
