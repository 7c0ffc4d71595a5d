"""`build_run(cfg, ranks) -> Run`: every part of an RL run built once and connected explicitly.

The one place that assembles a run, for `python -m launch.train`, the benches (bench.runs) and
the tests: the rollout backend (engine.backend.RolloutBackend, native or vLLM), the actor and
its reference policy, the data loader, the step's sampling, the idle window's work (bubble
pre-generation and spot training, run by one common.idle.ScheduledIdle), the metrics logger and
the Trainer that runs the steps, each given exactly the parts it uses (launch.run.colocated and
launch.run.separated build each placement's; launch.run.parts holds what both share). `Run.train()` runs the
steps with evaluation, logging and checkpoints; `Run.close()` releases what the run started
(shared memory, process groups, vLLM's processes). `run(cfg, ranks)` does all three.

The run folder holds the resolved config, metrics.jsonl, lengths.jsonl, the W&B offline run,
checkpoints, dashboard.png, summary.txt and summary.json; rank 0 prints and every rank writes its
own log (`rank{r}.log`). `trainer.resume=runs/<run>/checkpoints/step-N` continues a run exactly
where it stopped; `run.dir=runs/<run> trainer.resume=auto` continues from that folder's latest
checkpoint, or starts fresh there if it has none (what a requeued Slurm job does).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

from launch.run.colocated import build_colocated
from common.config import save_config
from launch.run.config import TrainConfig
from launch.run.parts import RankLog, Run
from launch.run.separated import build_separated
from pipeline.dist import Ranks, run_scope
from pipeline.metrics.records_log import truncate_after
from pipeline.checkpoint.state import latest_checkpoint


def run(cfg: TrainConfig, r: Ranks) -> dict:
    """Builds the run, trains it, releases it; returns the summary (also in summary.json)."""
    built = build_run(cfg, r)
    try:
        return built.train()
    finally:
        built.close()


def build_run(cfg: TrainConfig, r: Ranks) -> Run:
    """Every part of the run from its config on this rank (collective: every rank calls it). `cfg` was
    checked as it loaded (TrainConfig.validate, launch.run.capabilities)."""
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
    resources = ExitStack()
    try:
        build = build_separated if cfg.pipeline.separated else build_colocated
        return build(cfg, r, run_dir, log, resources, run_scope(run_dir))
    except BaseException:
        resources.close()
        raise


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
