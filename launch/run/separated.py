"""`build_separated(...)`: the parts of a separated run on this rank (launch.run.build.build_run calls it).

`pipeline.placement=separated pipeline.actor_ranks=K` under one torchrun: ranks 0..K-1 build the
update side (launch.run.parts.build_update_side: the actor, DDP over the actor group, and its
reference policy) and a loader sharded over K ranks (the colocated run's shards on K ranks); ranks
K..W-1 build the rollout side (launch.run.parts.build_rollout_side, as a colocated rank does, with
the same step hooks) and a loader of the whole global step. The first rollout rank tells every rank what its backend can do (whether its
log-probs are exactly the served policy's), which decides the PPO ratio's old log-probs on the
actor ranks. Then actor rank 0 pushes the weights the rollout ranks serve first: the checkpoint's
step on a resumed run, 0 on a fresh one. The placement and its groups: pipeline.placement; the
two sides' loops: pipeline.separated.actor and pipeline.separated.rollout; choosing a placement:
docs/PLACEMENT.md.

With `spot.enabled` the rollout ranks train the drafter in all their idle time (spot.separated,
on a process group of the rollout ranks made here on every rank), and actor rank 0 announces
each weight push in the job's store (common.idle.update), which ends their update windows. With
`spot.mode: pool` an elastic pool (launch.spot_pool, another job on the rollout ranks' nodes)
trains it instead: the rollout ranks fill and gate its buffers and load its publications
(spot.pool.separated_follower, on the same group). With a `history` part in engine.spec.drafter the rollout
ranks keep the run's history store (pipeline.drafts.history over the rollout group), as colocated ranks do.
"""

from __future__ import annotations

import datetime
from contextlib import ExitStack
from pathlib import Path

import torch.distributed as dist

from common.idle import PushFlag
from engine.backend import BackendCapabilities, RolloutBackend
from launch.run.problems import prompt_loader
from launch.run.config import TrainConfig
from launch.run.parts import (RankLog, Run, build_learner, build_rollout_side, build_update_side, finish_run, load_data,
                              resume_state)
from pipeline.dist import Ranks, job_store
from pipeline.hooks import UpdateIdleWorkHook, load_hook_states
from pipeline.separated.placement import Placement, build_placement
from pipeline.shares import shard_shares


def build_separated(cfg: TrainConfig, r: Ranks, run_dir: Path, log: RankLog, resources: ExitStack, scope: str) -> Run:
    """`scope`: the run's keys in the job's store (pipeline.dist.run_scope)."""
    placement = build_placement(cfg.pipeline, r, cfg.pipeline.timeout_s)
    K = len(placement.actor_ranks)
    shard_shares(cfg.trainer.prompts_per_step, K)  # trainer.prompts_per_step must split over the actor ranks
    actor_rank = placement.actors is not None
    log(f"separated placement: rank {r.rank} of {r.world} is {'an actor' if actor_rank else 'a rollout'} "
        f"rank ({K} actor, {len(placement.rollout_ranks)} rollout)")
    if cfg.memory_guard.mode != "off":
        log(f"memory guard ({cfg.memory_guard.mode}): watches colocated runs only; a separated run's roles are "
            "planned before it starts (python -m launch.memory) but not guarded while it runs")
    tokenizer, problems = load_data(cfg, log)
    resume, state = resume_state(cfg, r, run_dir, log)
    push_flag = spot_group = None
    if cfg.spot.enabled:  # collective: every rank makes the rollout ranks' spot group
        push_flag = PushFlag(job_store(r), scope)
        spot_group = dist.new_group(list(placement.rollout_ranks), timeout=datetime.timedelta(seconds=cfg.pipeline.timeout_s))
    if actor_rank:
        from pipeline.separated.actor import SeparatedActor

        loader = prompt_loader(cfg, problems.train, world_size=K, rank=placement.actors.rank, log=log)
        update = build_update_side(cfg, log, resume, group=placement.actors.group)
        if resume is not None:
            loader.load_state_dict(state.loader)
        learner = build_learner(cfg, placement.actors, update, tokenizer, _engine_caps(placement, None).exact_logprobs)
        driver = SeparatedActor(cfg.trainer, cfg.rollout.n, placement, learner, loader, run_dir, state.step,
                                push_flag=push_flag)
        driver.push(state.step)
        engine, actor = None, update.actor
    else:
        from pipeline.separated.rollout import SeparatedRollout

        loader = prompt_loader(cfg, problems.train, log=log)  # the whole global step
        rollout = build_rollout_side(cfg, placement.rollouts, log, resources, tokenizer, problems.task)
        if resume is not None:
            loader.load_state_dict(state.loader)
        _engine_caps(placement, rollout.engine)
        idle_work = _build_spot(cfg, r, run_dir, log, resources, rollout.engine, spot_group, resume)
        idle_hooks = [] if idle_work is None else [UpdateIdleWorkHook(idle_work, push_flag)]
        hooks = rollout.hooks(idle_hooks)
        load_hook_states(hooks, state.components)  # a resumed run's (a fresh start's components are empty)
        driver = SeparatedRollout(cfg.trainer, cfg.rollout, cfg.task, placement, rollout.engine, tokenizer,
                                  rollout.rewards, loader, problems.held_out, rollout.sampling, run_dir, state.step,
                                  scope=scope, idle_work=idle_work, hooks=hooks)
        driver.receive_policy(state.step)
        engine, actor = rollout.engine, None
    return finish_run(cfg, r, run_dir, log, problems, loader, engine, actor, driver, state, resume is not None, resources)


def _build_spot(cfg: TrainConfig, r: Ranks, run_dir: Path, log: RankLog, resources: ExitStack, engine: RolloutBackend,
                spot_group, resume: Path | None):
    """The rollout ranks' idle work: spot training on them (spot.separated) or following an elastic
    pool (spot.pool.separated_follower), both over `spot_group`; None without spot.enabled."""
    if not cfg.spot.enabled:
        return None
    if cfg.spot.mode == "pool":
        from spot.pool.separated_follower import build_separated_pool

        spot = build_separated_pool(cfg.spot, engine, run_name=run_dir.name, group=spot_group,
                                    max_new_tokens=cfg.rollout.max_new_tokens)
        resources.callback(spot.close)
        log(f"spot pool: node buffer {spot.buffer.name} ({cfg.spot.buffer_mb} MiB) gated by this node's rollout "
            f"ranks; drafters from {cfg.spot.pool_dir}")
        return spot.work
    from spot.separated import build_separated_spot

    spot = build_separated_spot(cfg.spot, engine, run_name=run_dir.name, group=spot_group, store=job_store(r),
                                seed=cfg.run.seed, max_new_tokens=cfg.rollout.max_new_tokens, resume=resume)
    resources.callback(spot.close)
    log(f"spot training on the rollout ranks' idle time: node buffer {spot.buffer.name} ({cfg.spot.buffer_mb} MiB)")
    return spot.work


def _engine_caps(placement: Placement, engine: RolloutBackend | None) -> BackendCapabilities:
    """The first rollout rank's backend capabilities, on every rank (collective)."""
    box = [engine.caps if engine is not None and placement.job.rank == placement.first_rollout else None]
    dist.broadcast_object_list(box, src=placement.first_rollout)
    return box[0]
