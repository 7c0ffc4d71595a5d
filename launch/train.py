"""`python -m launch.train --config configs/tiny.yaml [section.key=value ...]`: an RL run.

Alone or under `torchrun --nproc-per-node=R -m launch.train ...` (gloo on CPU, NCCL on GPU):
each rank holds its own engine (engine.backend: native or vllm, engine.backends.factory) and a
data-parallel replica of the actor, rolls out its shard of every step's prompts, then trains
(pipeline.trainer). Rank 0 prints; every rank writes its own
log (`runs/<run>/rank{r}.log`). The run folder holds the resolved config, metrics.jsonl,
lengths.jsonl, the W&B offline run, checkpoints, dashboard.png, summary.txt and summary.json.
`trainer.resume=runs/<run>/checkpoints/step-N` continues a run exactly where it stopped;
`run.dir=runs/<run> trainer.resume=auto` continues from that folder's latest checkpoint, or starts
fresh there if it has none (what a requeued Slurm job does: launch.sbatch).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from engine.backends.factory import build_rollout_engine
from launch.config import load_config, override_args, require_keys, save_config, to_dict
from launch.run_config import TrainConfig
from pipeline.actors import build_actor
from pipeline.data import PromptLoader
from pipeline.dist import Ranks, init_ranks, shutdown
from pipeline.metrics import MetricsLogger
from pipeline.records_log import log_step, truncate_after
from pipeline.run_state import latest_checkpoint, load_run
from pipeline.tasks import get_task
from pipeline.tasks.eval import EVAL_SEED
from common.text import load_tokenizer
from pipeline.trainer import Trainer


class RankLog:
    """Rank 0 prints; every rank appends to its own file."""

    def __init__(self, run_dir: Path, r: Ranks) -> None:
        self.r, self.path = r, run_dir / f"rank{r.rank}.log"

    def __call__(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        with self.path.open("a") as f:
            f.write(line + "\n")
        if self.r.main:
            print(line, flush=True)


def resolve_resume(cfg: TrainConfig, r: Ranks) -> None:
    """trainer.resume=auto becomes run.dir's latest complete checkpoint (rank 0 looks), or None."""
    if cfg.trainer.resume != "auto":
        return
    found = [latest_checkpoint(cfg.run.dir)]
    if r.world > 1:
        dist.broadcast_object_list(found, src=0)
    cfg.trainer.resume = str(found[0]) if found[0] is not None else None


def run_dir_for(cfg: TrainConfig, r: Ranks) -> Path:
    """The run folder: run.dir, or chosen by rank 0 (its timestamp) and told to the others; a resumed
    run keeps its folder."""
    if cfg.trainer.resume:
        return Path(cfg.trainer.resume).resolve().parent.parent
    if cfg.run.dir:
        return Path(cfg.run.dir)
    name = [f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"]
    if r.world > 1:
        dist.broadcast_object_list(name, src=0)
    return Path(cfg.run.out_dir) / name[0]


def problems_for(cfg: TrainConfig):
    task = get_task(cfg.task.name)
    if cfg.task.file:
        from pipeline.tasks.math import load_math_file

        train, _ = load_math_file(  # bad rows are reported as file:line by the loader
            cfg.task.file, prompt_field=cfg.task.prompt_field, answer_field=cfg.task.answer_field,
            id_field=cfg.task.id_field, max_bad_share=cfg.task.max_bad_share)
        held = task.make_problems("test", cfg.task.eval_problems, EVAL_SEED)
        return task, train, held
    shape = {k: v for k, v in (("max_digits", cfg.task.max_digits), ("tail", cfg.task.tail)) if v is not None}
    return task, task.make_problems("train", cfg.task.train_problems, cfg.run.seed, **shape), task.make_problems(
        "test", cfg.task.eval_problems, EVAL_SEED)


def run(cfg: TrainConfig, r: Ranks) -> dict:
    resolve_resume(cfg, r)
    run_dir = run_dir_for(cfg, r)
    run_dir.mkdir(parents=True, exist_ok=True)
    if r.world > 1:
        dist.barrier()  # rank 0's look at run.dir (resolve_resume) happens before anyone logs into it
    log = RankLog(run_dir, r)
    if r.main and not cfg.trainer.resume:
        truncate_after(run_dir, -1)  # a fresh start in a fixed run.dir: an earlier attempt's lines go
        save_config(cfg, run_dir / "config.yaml")
    log(f"run {run_dir} on {r.world} rank(s)")
    torch.manual_seed(cfg.run.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    task, train_problems, held_out = problems_for(cfg)
    loader = PromptLoader(train_problems, cfg.trainer.prompts_per_step, cfg.run.seed, world_size=r.world, rank=r.rank)
    engine = build_rollout_engine(cfg.model.path, cfg.engine, seed=cfg.run.seed)
    actor = build_actor(cfg.actor, cfg.model.path)
    reference = None
    if cfg.algorithm.kl_coef > 0:
        from pipeline.reference import ReferencePolicy

        reference = ReferencePolicy(cfg.actor, cfg.model.path)
    start = 0
    if cfg.trainer.resume:
        state = load_run(cfg.trainer.resume)
        if r.main:
            truncate_after(run_dir, state.step)
        actor.load(Path(cfg.trainer.resume) / "actor")
        loader.load_state_dict(state.loader)
        if "spec_policy" in state.components:
            engine.policy.load_state_dict(state.components["spec_policy"])
        start = state.step
        log(f"resumed from {cfg.trainer.resume} at step {start}")
    spot = None
    if cfg.spot.enabled:
        from spot.colocated import build_spot_work

        resume = Path(cfg.trainer.resume) if cfg.trainer.resume else None
        spot = build_spot_work(cfg.spot, engine, run_name=run_dir.name, rank=r.rank, local_rank=r.local_rank,
                               world=r.world, seed=cfg.run.seed, max_new_tokens=cfg.rollout.max_new_tokens, resume=resume)
        if resume is not None and "idle_work" in state.components:
            spot.work.load_state_dict(state.components["idle_work"])
            engine.load_drafter_weights(spot.work.trainer.named_weights(), version=spot.work.drafter_version)
        log(f"spot training on: node buffer {spot.buffer.name} ({cfg.spot.buffer_mb} MiB), drafter trained in idle windows")
    try:
        return _train(cfg, r, run_dir, log, engine, actor, tokenizer, task, loader, held_out, start, reference,
                      spot.work if spot else None, spot.actor_features if spot else None)
    finally:
        if spot is not None:
            spot.close()


def _train(cfg, r, run_dir, log, engine, actor, tokenizer, task, loader, held_out, start, reference, idle_work,
           actor_features) -> dict:
    logger = MetricsLogger.from_config(run_dir, cfg.metrics, rank=r.rank, run_name=run_dir.name,
                                       resolved_config=to_dict(cfg), resume_after_step=start if cfg.trainer.resume else -1)  # -1: a fresh start drops an earlier attempt's lines
    bubbles = None
    if cfg.bubble.enabled:
        idle_work, bubbles = _with_bubbles(cfg, r, engine, tokenizer, loader, idle_work, lambda step: trainer.sampling(step))
    trainer = Trainer(cfg, r, engine, actor, tokenizer, task, loader, held_out, run_dir, start_step=start,
                      reference=reference, idle_work=idle_work, bubbles=bubbles, actor_features=actor_features)
    trainer.sync(version=start)  # the engine serves exactly the actor's weights (a resumed run's too)
    tc = cfg.trainer
    accuracy = {}
    with logger:
        if start == 0:
            accuracy[0] = trainer.evaluate()
            if r.main:
                logger.log(0, {"eval/accuracy": accuracy[0]})
                log(f"held-out greedy accuracy before training: {accuracy[0]:.1%} on {len(held_out)} problems")
        t0 = time.perf_counter()
        for _ in range(start, tc.steps):
            result = trainer.step()
            step = trainer.step_index
            log_step(run_dir, step, r.rank, result.rollouts)
            metrics = result.metrics
            if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
                acc = trainer.evaluate()
                if acc is not None:
                    metrics["eval/accuracy"] = accuracy[step] = acc
            logger.log(step, metrics, lengths=result.lengths)
            if (tc.save_every and step % tc.save_every == 0) or step == tc.steps:
                trainer.save()
        train_s = time.perf_counter() - t0
    summary = {"run_dir": str(run_dir), "steps": tc.steps, "world_size": r.world, "train_seconds": round(train_s, 1),
               "heldout_accuracy": {str(k): v for k, v in accuracy.items()}}
    if r.main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        for name in ("dashboard.png", "summary.txt"):
            if (run_dir / name).exists():
                log(f"wrote {run_dir / name}")
    return summary


def _with_bubbles(cfg: TrainConfig, r: Ranks, engine, tokenizer, loader, spot_work, sampling_for):
    """Bubble pre-generation first in every idle window, then spot training if it is on."""
    from common.control import ControlPlane
    from engine.types import Request
    from pipeline.bubble import BubbleStore, BubbleWork
    from pipeline.idle import IdleSequence
    from pipeline.rollouts import encode_problem

    store = BubbleStore(cfg.bubble.max_tokens)

    def requests_for() -> list[Request]:  # this rank's shard of the next step
        return [Request(prompt_id=p.id, prompt=encode_problem(tokenizer, p, cfg.task.chat), n=cfg.rollout.n)
                for p in loader.peek()]

    control = ControlPlane(dist.distributed_c10d._get_default_store(), r.rank, r.world) if r.world > 1 else None
    bubble = BubbleWork(engine, requests_for, sampling_for, store, cfg.bubble, control)
    return (IdleSequence([bubble, spot_work]) if spot_work is not None else bubble), store


def main(argv: list[str] | None = None) -> int:
    overrides, rest = override_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__.splitlines()[0],
                                     epilog="Any section.key=value argument overrides the config file.")
    parser.add_argument("--config", default="configs/tiny.yaml")
    args = parser.parse_args(rest)
    try:
        cfg = load_config(TrainConfig, args.config, overrides)
        require_keys(cfg, args.config)
        r = init_ranks(cfg.actor.device)
        try:
            run(cfg, r)
        finally:
            shutdown()
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
