"""torchrun worker for tests/test_actors.py: the torch (DDP), DeepSpeed ZeRO-1, ZeRO-2 and ZeRO-3 actors at world size 2.

The LM head computes log-probs HEAD_CHUNK tokens at a time, so every micro-batch's head runs in
several chunks (under ZeRO-3 with its weight partitioned, gathered for the forward and backward).

Each rank trains on its rows of one global batch (5 rows and 1: a long tail) with the loss weights
normalised over the whole batch. Per backend, rank 0 writes to --out the summed loss of every step
(--steps steps, a save, then RESUMED more), the losses of a fresh actor that loads the save and
takes the same RESUMED steps, whether a step after set_lr(0.0) leaves every weight as it was, and the
error a malformed folder gives. At the save point every rank
writes its named_weights to weights-{backend}-rank{r}.pt beside --out, and the resumed actor's, right
after its load, to loaded-{backend}-rank{r}.pt. ZeRO-3 also reports whether a fresh actor's
parameters are partitioned and gather back to the folder's, and, at each named_weights yield after
training, which layers have a non-persistent parameter materialised; at the save point it writes
DeepSpeed's gather of every parameter at once to gathered-zero3-rank{r}.pt.

With --bystanders N the job has 2 + N processes: the actors train on a process group of ranks 0
and 1 (a separated placement's actor ranks) while the others only wait in the job's store for
the end, joining no collective; a collective over the whole job would leave the actor ranks
waiting until the process group's timeout. DeepSpeed actors also report the error of loading a
checkpoint whose files say 3 ranks saved it, with only 2 ranks' files there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pipeline.dist import Ranks, job_store
from pipeline.records import TrainBatch

VOCAB = 101
LINEAR = torch.nn.functional.linear  # before any DeepSpeed import: ZeRO-3 must leave it in place
HEAD_CHUNK = 5  # tokens per chunk of the LM head: a micro-batch of up to 28 tokens runs in several
TRAIN = {"lr": 1e-3, "grad_clip": 0.5, "weight_decay": 0.1,  # weight decay: a wrong decay group changes the losses
         "head_chunk_tokens": HEAD_CHUNK}
BACKENDS = {"torch": {"backend": "torch"}, "zero1": {"backend": "deepspeed", "zero_stage": 1},
            "zero2": {"backend": "deepspeed", "zero_stage": 2}, "zero3": {"backend": "deepspeed", "zero_stage": 3}}
RESUMED = 2  # steps after the save: the second one also sees the restored optimizer state


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


def whole_logits_forward(model, input_ids, attention_mask, *, entropy=False, hidden=False, hidden_layers=None,
                         scored=None):
    """pipeline.actors.forward.policy_forward computed the way it was before the chunked head: the
    model's whole [b, T, V] logits (its head called plainly), then log-softmax over them, kept at the
    `scored` tokens (None: the real ones). The reference the chunked head is compared with."""
    from pipeline.actors.base import LogProbs
    from pipeline.actors.forward import token_entropy, token_logprobs

    assert not hidden and not hidden_layers
    logits = model(input_ids=input_ids, attention_mask=None, use_cache=False).logits  # [b, T, V]
    real = (attention_mask if scored is None else scored * attention_mask).bool()
    return LogProbs(logprobs=token_logprobs(logits, input_ids).masked_fill(~real, 0.0),
                    entropy=token_entropy(logits).masked_fill(~real, 0.0) if entropy else None)


def gathered_weights(actor) -> tuple[dict[str, torch.Tensor], list]:
    """named_weights as copies, and [name, its layer, layers with a non-persistent parameter materialised] per yield.

    Only DeepSpeed ZeRO-3 parameters have `ds_persist` (kept whole on every rank by design); for
    the other backends the trace is empty.
    """
    from pipeline.actors.deepspeed_actor import layer_key

    engine = getattr(actor, "engine", None)
    params = [(n, p) for n, p in engine.module.named_parameters() if hasattr(p, "ds_persist")] if engine else []
    weights, trace = {}, []
    for name, w in actor.named_weights():
        weights[name] = w.detach().clone()
        if params:
            live = sorted({layer_key(n) for n, p in params if p.numel() > 0 and not p.ds_persist})
            trace.append([name, layer_key(name), live])
    return weights, trace


def run(backend: str, model: str, out: Path, steps: int, budget: int, group=None) -> dict:
    import torch.distributed as dist

    from pipeline.actors import ActorConfig, build_actor

    rank = dist.get_rank(group)
    cfg = ActorConfig(**TRAIN, **BACKENDS[backend], micro_batch_tokens=budget)
    # Unequal shards (5 rows and 1): rank 1 runs zero-weight micro-batches to match rank 0's count.
    local = make_batch().select(slice(0, 5) if rank == 0 else slice(5, 6))
    ckpt = out.parent / f"ckpt-{backend}"

    def step(actor) -> float:
        loss = torch.tensor(actor.update(local, pg_loss)["train/loss"], dtype=torch.float64)
        dist.all_reduce(loss, group=group)
        return float(loss)

    actor = build_actor(cfg, model, group)
    result = fresh_zero3(actor, model) if backend == "zero3" else {}
    losses = [step(actor) for _ in range(steps)]
    actor.save(ckpt)
    weights, result["trace"] = gathered_weights(actor)
    torch.save(weights, out.parent / f"weights-{backend}-rank{rank}.pt")
    if backend == "zero3":
        torch.save(gathered_at_once(actor), out.parent / f"gathered-zero3-rank{rank}.pt")
    losses += [step(actor) for _ in range(RESUMED)]
    resumed = build_actor(cfg, model, group)
    resumed.load(ckpt)
    torch.save(gathered_weights(resumed)[0], out.parent / f"loaded-{backend}-rank{rank}.pt")
    result["resumed"] = [step(resumed) for _ in range(RESUMED)]
    still = gathered_weights(resumed)[0]
    resumed.set_lr(0.0)
    step(resumed)
    result["lr_zero_still"] = all(torch.equal(w, still[k]) for k, w in gathered_weights(resumed)[0].items())
    malformed_dir = out.parent / f"{backend}-malformed"
    if rank == 0:
        malformed_dir.mkdir()
    dist.barrier(group=group)
    try:
        resumed.load(malformed_dir)
        result["malformed"] = ""
    except FileNotFoundError as e:
        result["malformed"] = str(e)
    if cfg.backend == "deepspeed":
        result["other_world"] = load_as_if_saved_by_three(resumed, ckpt, out.parent / f"{backend}-three", group)
    return {"losses": losses, **result}


def load_as_if_saved_by_three(actor, ckpt: Path, copy: Path, group) -> str:
    """The error a DeepSpeed actor's load gives for a checkpoint its files say 3 ranks saved, with 2 ranks' files."""
    import shutil

    import torch.distributed as dist

    from pipeline.actors.deepspeed_actor import optimizer_file

    rank = dist.get_rank(group)
    if rank == 0:
        shutil.copytree(ckpt, copy)
    dist.barrier(group=group)
    state = torch.load(copy / optimizer_file(rank), weights_only=False)
    torch.save({**state, "world": 3}, copy / optimizer_file(rank))
    dist.barrier(group=group)  # every rank's file says 3 before any rank reads rank 0's
    try:
        actor.load(copy)
        return ""
    except FileNotFoundError as e:
        return str(e)


def gathered_at_once(actor) -> dict[str, torch.Tensor]:
    """Every parameter, gathered in one deepspeed.zero.GatheredParameters (DeepSpeed's own gather, not named_weights')."""
    import deepspeed

    params = dict(actor.engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().clone() for name, p in params.items()}


def fresh_zero3(actor, model: str) -> dict:
    """Before any step: every parameter is partitioned (empty here), named_weights gathers the folder's, and
    torch.nn.functional.linear is still torch's (other models in the process use it)."""
    from transformers import AutoModelForCausalLM

    partitioned = all(p.numel() == 0 for p in actor.engine.module.parameters())  # outside a gather
    reference = dict(AutoModelForCausalLM.from_pretrained(model).named_parameters())
    named = dict(actor.named_weights())
    match = named.keys() == reference.keys() and all(torch.equal(named[k], reference[k]) for k in named)
    persistent = sorted(n for n, p in actor.engine.module.named_parameters() if p.ds_persist)
    return {"partitioned": partitioned, "weights_match": match, "persistent": persistent,
            "linear_kept": torch.nn.functional.linear is LINEAR}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget", type=int, default=28)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--bystanders", type=int, default=0)
    args = p.parse_args()
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    group = dist.new_group([0, 1]) if args.bystanders else None
    store = job_store(Ranks(rank=dist.get_rank(), world=dist.get_world_size()))
    if dist.get_rank() >= 2:
        store.wait(["actors-done"], datetime.timedelta(seconds=600))
    else:
        results = {b: run(b, args.model, args.out, args.steps, args.budget, group) for b in args.backends}
        if dist.get_rank() == 0:
            args.out.write_text(json.dumps(results))
            store.set("actors-done", "1")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
