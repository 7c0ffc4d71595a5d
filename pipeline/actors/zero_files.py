"""The optimizer files of a DeepSpeed actor checkpoint, and reading them back.

Each data-parallel rank that saved the folder wrote `zero_rank{r}.pt`: {"world": the number of
ranks that saved it, "optimizer": that rank's `engine.optimizer.state_dict()`}. Under ZeRO-3,
rank 0 also wrote `zero3_param_shapes.pt`, the parameters' names and shapes in partition order.
The DeepSpeed actor (pipeline.actors.deepspeed_actor) writes and resumes them; launch.export
joins ZeRO-3's. What the states hold, and how they are re-sharded: pipeline.actors.zero_reshard.

Reading is memory-mapped (torch.load(mmap=True)): a rank that re-shards a checkpoint of many
ranks reads the saved pickles whole but only the tensor bytes it takes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.actors.zero_reshard import STAGE

ZERO3_SHAPES = "zero3_param_shapes.pt"  # a ZeRO-3 checkpoint's parameter names and shapes, in partition order


def optimizer_file(rank: int) -> str:
    return f"zero_rank{rank}.pt"


def saved_world_and_stage(folder: Path) -> tuple[int, int]:
    """The number of data-parallel ranks that saved `folder` and their ZeRO stage; FileNotFoundError
    naming the folder and the missing files if any rank's file is not there."""
    first = torch.load(folder / optimizer_file(0), map_location="cpu", weights_only=False, mmap=True)
    world, stage = first["world"], int(first["optimizer"][STAGE])
    missing = [optimizer_file(r) for r in range(world) if not (folder / optimizer_file(r)).is_file()]
    if missing:
        raise FileNotFoundError(f"deepspeed actor checkpoint {folder} was saved by {world} data-parallel ranks and "
                                f"is malformed: missing {', '.join(missing)}")
    return world, stage


def saved_states(folder: Path, world: int) -> list[dict]:
    """Every saved rank's optimizer state dict, in rank order, memory-mapped on the CPU."""
    return [torch.load(folder / optimizer_file(r), map_location="cpu", weights_only=False, mmap=True)["optimizer"]
            for r in range(world)]
