"""torchrun worker for tests/test_actors.py: the torch (DDP) and DeepSpeed ZeRO-2 actors at world size 2.

Each rank trains on its rows of one global batch (5 rows and 1: a long tail) with the loss weights
normalised over the whole batch; the summed loss of every step goes to --out (rank 0), with the
loss after a save -> load into a fresh actor, and the error a malformed folder gives; then
ZeRO-3's layer-by-layer gathered weights and first loss.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pipeline.records import TrainBatch

VOCAB = 101


def make_batch(rows: int = 6, width: int = 14, seed: int = 0) -> TrainBatch:
    """Right-padded rows of varied length, a 3-token prompt, ±1 advantages, token-mean loss weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, width), generator=g)
    lengths = torch.randint(6, width + 1, (rows,), generator=g)
    cols = torch.arange(width)
    attention = (cols < lengths[:, None]).long()
    response = attention * (cols >= 3).long()
    ids = ids * attention
    adv = torch.where(torch.rand(rows, generator=g) < 0.5, -1.0, 1.0)[:, None] * response
    return TrainBatch(input_ids=ids, attention_mask=attention, response_mask=response,
                      old_logprobs=torch.zeros(rows, width), advantages=adv,
                      loss_weights=response / response.sum())


def pg_loss(logprobs, entropy, micro: TrainBatch):
    """A policy-gradient surrogate weighted by the micro-batch's loss weights."""
    ratio = torch.exp(logprobs - micro.old_logprobs)  # [b, T]
    loss = (-micro.advantages * ratio * micro.loss_weights).sum()
    resp = micro.response_mask.bool()
    return loss, {"train/ratio_mean": float(ratio.detach()[resp].mean()) if resp.any() else 0.0}


def run(backend: str, model: str, ckpt: Path, steps: int, budget: int) -> dict:
    import torch.distributed as dist

    from pipeline.actors import ActorConfig, build_actor

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ActorConfig(backend=backend, lr=1e-3, grad_clip=0.5, micro_batch_tokens=budget, zero_stage=2)
    # Unequal shards (5 rows and 1): rank 1 runs zero-weight micro-batches to match rank 0's count.
    local = make_batch().select(slice(0, 5) if rank == 0 else slice(5, 6))

    def step(actor) -> float:
        loss = torch.tensor(actor.update(local, pg_loss)["train/loss"], dtype=torch.float64)
        dist.all_reduce(loss)
        return float(loss)

    actor = build_actor(cfg, model)
    losses = [step(actor) for _ in range(steps)]
    actor.save(ckpt)
    losses.append(step(actor))
    resumed = build_actor(cfg, model)
    resumed.load(ckpt)
    resumed_loss = step(resumed)
    malformed_dir = ckpt.parent / f"{backend}-malformed"
    if rank == 0:
        malformed_dir.mkdir()
    dist.barrier()
    try:
        resumed.load(malformed_dir)
        malformed = ""
    except FileNotFoundError as e:
        malformed = str(e)
    return {"losses": losses, "resumed": resumed_loss, "malformed": malformed}


def zero3(model: str) -> dict:
    """ZeRO-3: named_weights gathers the partitioned parameters back to the folder's; one step's loss."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from pipeline.actors import ActorConfig, build_actor

    rank = dist.get_rank()
    actor = build_actor(ActorConfig(backend="deepspeed", zero_stage=3, lr=1e-3, grad_clip=0.5, micro_batch_tokens=28),
                        model)
    reference = dict(AutoModelForCausalLM.from_pretrained(model).named_parameters())
    named = dict(actor.named_weights())
    partitioned = all(p.numel() == 0 for p in actor.engine.module.parameters())  # outside a gather
    loss = torch.tensor(actor.update(make_batch().select(slice(0, 5) if rank == 0 else slice(5, 6)), pg_loss)["train/loss"],
                        dtype=torch.float64)
    dist.all_reduce(loss)
    return {"weights_match": named.keys() == reference.keys() and all(torch.equal(named[k], reference[k]) for k in named),
            "partitioned": partitioned, "first_loss": float(loss)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget", type=int, default=28)
    args = p.parse_args()
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {b: run(b, args.model, args.out.parent / f"ckpt-{b}", args.steps, args.budget) for b in ("torch", "deepspeed")}
    results["zero3"] = zero3(args.model)
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
