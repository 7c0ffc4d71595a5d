"""`build_separated(...)`: the parts of a separated run on this rank (launch.run.build_run calls it).

`pipeline.placement=separated pipeline.actor_ranks=K` under one torchrun: ranks 0..K-1 build the
actor (DDP over the actor group), its reference policy and a loader sharded over K ranks (the
colocated run's shards on K ranks); ranks K..W-1 build the rollout backend and a loader of the
whole global step. The first rollout rank tells every rank what its backend can do (whether its
log-probs are exactly the served policy's), which decides the PPO ratio's old log-probs on the
actor ranks. Then actor rank 0 pushes the weights the rollout ranks serve first: the checkpoint's
step on a resumed run, 0 on a fresh one. The placement and its groups: pipeline.placement; the
two sides' loops: pipeline.separated_actor and pipeline.separated_rollout; choosing a placement:
docs/PLACEMENT.md.

With `spot.enabled` the rollout ranks train the drafter in all their idle time (spot.separated,
on a process group of the rollout ranks made here on every rank), and actor rank 0 announces
each weight push in the job's store (common.idle.update), which ends their update windows. With
`spot.mode: pool` an elastic pool (launch.spot_pool, another job on the rollout ranks' nodes)
trains it instead: the rollout ranks fill and gate its buffers and load its publications
(spot.separated_pool, on the same group). With a `history` part in engine.spec.drafter the rollout
ranks keep the run's history store (pipeline.history over the rollout group), as colocated ranks do.
"""

from __future__ import annotations

import datetime
import itertools
from contextlib import ExitStack
from pathlib import Path

import torch.distributed as dist

from common.idle import PushFlag
from common.text import load_tokenizer, pad_token, stop_tokens
from engine.backends.factory import build_rollout_engine
from launch.config import to_dict
from launch.problems import problems_for, prompt_loader
from launch.run_config import TrainConfig
from launch.run_parts import RankLog, Run, resume_state
from pipeline.algorithms import build_algorithm
from pipeline.dist import Ranks, job_store
from pipeline.history import run_history
from pipeline.learner import Learner, uses_engine_logprobs
from pipeline.metrics import MetricsLogger
from pipeline.placement import Placement, build_placement
from pipeline.reference import ReferencePolicy
from pipeline.rollouts import StepSampling
from pipeline.shares import shard_shares
from pipeline.tasks.reward_scoring import build_rewards

_RUNS = itertools.count()  # runs built in this process: part of their push announcements' store scope


def build_separated(cfg: TrainConfig, r: Ranks, run_dir: Path, log: RankLog, resources: ExitStack) -> Run:
    placement = build_placement(cfg.pipeline, r, cfg.pipeline.timeout_s)
    K = len(placement.actor_ranks)
    shard_shares(cfg.trainer.prompts_per_step, K)  # trainer.prompts_per_step must split over the actor ranks
    log(f"separated placement: rank {r.rank} of {r.world} is {'an actor' if placement.role == 'actor' else 'a rollout'} "
        f"rank ({K} actor, {len(placement.rollout_ranks)} rollout)")
    tokenizer = load_tokenizer(cfg.model.path)
    problems = problems_for(cfg, tokenizer)
    for line in problems.summary:
        log(f"data: {line}")
    task, train_problems, held_out = problems.task, problems.train, problems.held_out
    resume, state = resume_state(cfg, r, run_dir, log)
    engine = actor = None
    push_flag = spot_group = None
    if cfg.spot.enabled:  # collective: every rank makes the rollout ranks' spot group
        push_flag = PushFlag(job_store(r), f"tailspec/{run_dir.name}/{next(_RUNS)}")
        spot_group = dist.new_group(list(placement.rollout_ranks), timeout=datetime.timedelta(seconds=cfg.pipeline.timeout_s))
    if placement.role == "actor":
        from pipeline.actors import build_actor
        from pipeline.separated_actor import SeparatedActor

        loader = prompt_loader(cfg, train_problems, world_size=K, rank=placement.actors.rank, log=log)
        actor = build_actor(cfg.actor, cfg.model.path, group=placement.actors.group)
        if (schedule := cfg.actor.schedule_summary(cfg.trainer.steps)) is not None:
            log(schedule)
        reference = ReferencePolicy(cfg.actor, cfg.model.path) if cfg.algorithm.kl_coef > 0 else None
        if resume is not None:
            actor.load(resume / "actor")
            loader.load_state_dict(state.loader)
        caps = _engine_caps(placement, None)
        samples_policy = StepSampling.of(cfg.rollout, cfg.run.seed, ()).is_policy  # stop tokens change no distribution
        learner = Learner(cfg.trainer, build_algorithm(cfg.algorithm, cfg.rollout.max_new_tokens), cfg.actor, placement.actors,
                          actor, pad_token(tokenizer), uses_engine_logprobs(cfg.trainer, samples_policy, caps.exact_logprobs),
                          reference=reference)
        driver = SeparatedActor(cfg.trainer, cfg.rollout.n, placement, learner, loader, run_dir, state.step,
                                push_flag=push_flag)
        driver.push(state.step)
    else:
        from pipeline.separated_rollout import SeparatedRollout

        loader = prompt_loader(cfg, train_problems, log=log)  # the whole global step
        rewards = build_rewards(cfg.task, task, log)  # before any rollout: a reward that does not load stops the build
        resources.callback(rewards.close)
        log(rewards.summary())
        history = run_history(cfg.engine.spec, placement.rollouts)  # over the rollout ranks: every one keeps the same store
        engine = build_rollout_engine(cfg.model.path, cfg.engine, seed=cfg.run.seed,
                                      history=history.store if history is not None else None)
        resources.callback(engine.close)
        if resume is not None:
            loader.load_state_dict(state.loader)
            if engine.policy is not None and "spec_policy" in state.components:
                engine.policy.load_state_dict(state.components["spec_policy"])
            if history is not None and "history" in state.components:
                history.load_state_dict(state.components["history"])
        _engine_caps(placement, engine)
        sampling = StepSampling.of(cfg.rollout, cfg.run.seed, stop_tokens(engine.model_config, tokenizer))
        idle_work = None
        if cfg.spot.enabled and cfg.spot.mode == "pool":
            from spot.separated_pool import build_separated_pool

            spot = build_separated_pool(cfg.spot, engine, run_name=run_dir.name, group=spot_group,
                                        max_new_tokens=cfg.rollout.max_new_tokens)
            resources.callback(spot.close)
            idle_work = spot.work
            log(f"spot pool: node buffer {spot.buffer.name} ({cfg.spot.buffer_mb} MiB) gated by this node's rollout "
                f"ranks; drafters from {cfg.spot.pool_dir}")
        elif cfg.spot.enabled:
            from spot.separated import build_separated_spot

            spot = build_separated_spot(cfg.spot, engine, run_name=run_dir.name, group=spot_group, store=job_store(r),
                                        seed=cfg.run.seed, max_new_tokens=cfg.rollout.max_new_tokens, resume=resume)
            resources.callback(spot.close)
            if "idle_work" in state.components:
                spot.work.load_state_dict(state.components["idle_work"])
            idle_work = spot.work
            log(f"spot training on the rollout ranks' idle time: node buffer {spot.buffer.name} ({cfg.spot.buffer_mb} MiB)")
        driver = SeparatedRollout(cfg.trainer, cfg.rollout, cfg.task, placement, engine, tokenizer, rewards, loader, held_out,
                                  sampling, run_dir, state.step, idle_work=idle_work, push_flag=push_flag, history=history)
        driver.receive_policy(state.step)
    logger = MetricsLogger.from_config(run_dir, cfg.metrics, rank=r.rank, run_name=run_dir.name,
                                       resolved_config=to_dict(cfg), resume_after_step=state.step if resume is not None else -1)
    return Run(cfg=cfg, ranks=r, run_dir=run_dir, log=log, task=task, held_out=held_out,
               held_out_source=problems.held_out_source, loader=loader, engine=engine, actor=actor, trainer=driver,
               logger=logger, start_step=state.step, resources=resources)


def _engine_caps(placement: Placement, engine):
    """The first rollout rank's backend capabilities, on every rank (collective)."""
    box = [engine.caps if engine is not None and placement.job.rank == placement.first_rollout else None]
    dist.broadcast_object_list(box, src=placement.first_rollout)
    return box[0]

