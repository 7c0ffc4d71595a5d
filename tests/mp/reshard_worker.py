"""torchrun worker for tests/test_zero_reshard.py: actor checkpoints resumed on another number of ranks.

Per backend (tests/mp/actor_worker.py's BACKENDS), in this order:
- with --resume DIR: a fresh actor loads DIR/<backend> (which another number of ranks saved) and
  takes RESUMED steps; rank 0 reports their losses and whether the weights right after the load
  were those the saving run had (DIR/weights-<backend>.pt);
- with --save DIR: STEPS steps, a save to DIR/<backend> (rank 0 writing the weights at that point
  to DIR/weights-<backend>.pt), then RESUMED more steps; rank 0 reports their losses.
With --resume, the ZeRO-3 actor last loads DIR/zero2, and rank 0 reports the error.

Every step trains make_batch()'s whole batch, each rank on its contiguous share of the rows with
loss weights normalised over the whole batch; a step's loss is the sum of the ranks' losses, so
any number of ranks computes the same one, up to float rounding. Rank 0 writes the report to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.distributed as dist

from tests.mp.actor_worker import BACKENDS, RESUMED, TRAIN, make_batch, pg_loss

STEPS = 2  # before the save


def step(actor, rank: int, world: int) -> float:
    rows = torch.tensor_split(torch.arange(6), world)[rank]
    local = make_batch().select(slice(int(rows[0]), int(rows[-1]) + 1))
    loss = torch.tensor(actor.update(local, pg_loss)["train/loss"], dtype=torch.float64)
    dist.all_reduce(loss)
    return float(loss)


def weights(actor) -> dict[str, torch.Tensor]:
    """named_weights as copies (collective under ZeRO-3, which gathers them)."""
    return {name: w.clone() for name, w in actor.named_weights()}


def build(backend: str, model: str):
    from pipeline.actors import ActorConfig, build_actor

    return build_actor(ActorConfig(**TRAIN, **BACKENDS[backend], micro_batch_tokens=28), model)


def resume(backend: str, model: str, folder: Path, rank: int, world: int) -> tuple[dict, object]:
    actor = build(backend, model)
    actor.load(folder / backend)
    loaded = weights(actor)
    saved = torch.load(folder / f"weights-{backend}.pt")
    equal = loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    return {"losses": [step(actor, rank, world) for _ in range(RESUMED)], "loaded_equal": equal}, actor


def save(backend: str, model: str, folder: Path, rank: int, world: int) -> list[float]:
    actor = build(backend, model)
    for _ in range(STEPS):
        step(actor, rank, world)
    actor.save(folder / backend)
    saved = weights(actor)
    if rank == 0:
        torch.save(saved, folder / f"weights-{backend}.pt")
    return [step(actor, rank, world) for _ in range(RESUMED)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--save", type=Path)
    p.add_argument("--resume", type=Path)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    report: dict = {"resumed": {}, "saved": {}}
    actors = {}
    if args.resume:
        for b in args.backends:
            report["resumed"][b], actors[b] = resume(b, args.model, args.resume, rank, world)
        if {"zero2", "zero3"} <= actors.keys():
            try:
                actors["zero3"].load(args.resume / "zero2")
                report["other_stage"] = ""
            except ValueError as e:
                report["other_stage"] = str(e)
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
        for b in args.backends:
            report["saved"][b] = save(b, args.model, args.save, rank, world)
    if rank == 0:
        args.out.write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
