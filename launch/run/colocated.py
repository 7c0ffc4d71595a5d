"""`build_colocated(...)`: the parts of a colocated run on this rank (launch.run.build.build_run calls it).

Every rank holds a rollout backend (engine.backend.RolloutBackend, native or vLLM), a
data-parallel replica of the actor and its reference policy, its shard of the data loader, the
step's sampling, and the idle window's work (bubble pre-generation and spot training, run by one
common.idle.ScheduledIdle); the Trainer (pipeline.trainer) runs its steps, each part given exactly
what it uses. Both sides are built by launch.run.parts' functions, which a separated run's ranks
call one per role (launch.run.separated). A resumed run loads each part's state from the checkpoint
before the first sync.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from common.idle import ControlPlane, IdleSchedule, ScheduledIdle
from engine.backend import RolloutBackend
from launch.run.problems import prompt_loader
from launch.run.config import TrainConfig
from launch.run.parts import (RankLog, Run, build_learner, build_memory_guard, build_rollout_side, build_update_side,
                              finish_run, load_data, resume_state)
from pipeline.data import PromptLoader
from pipeline.dist import Ranks, job_store
from pipeline.hooks import IdleWorkHook, StepHook, WeightsFollower, load_hook_states
from pipeline.metrics.live_memory import live_rss_bytes
from pipeline.rollout.schedule import GroupSplit
from pipeline.rollout.stage import StepSampling
from pipeline.trainer import Trainer


def build_colocated(cfg: TrainConfig, r: Ranks, run_dir: Path, log: RankLog, resources: ExitStack, scope: str) -> Run:
    """`scope`: the run's keys in the job's store (pipeline.dist.run_scope)."""
    resident_before = live_rss_bytes()  # what this process held before the run (the memory guard's offset)
    resume, state = resume_state(cfg, r, run_dir, log)
    tokenizer, problems = load_data(cfg, log)
    loader = prompt_loader(cfg, problems.train, world_size=r.world, rank=r.rank, log=log)
    rollout = build_rollout_side(cfg, r, log, resources, tokenizer, problems.task)
    update = build_update_side(cfg, log, resume)
    if resume is not None:
        loader.load_state_dict(state.loader)
    idle_work, idle_hooks, spot = _build_idle(cfg, r, run_dir, log, resources, rollout.engine, tokenizer, loader,
                                              rollout.sampling, resume)
    hooks = rollout.hooks(idle_hooks)
    load_hook_states(hooks, state.components)  # a resumed run's (a fresh start's components are empty)
    learner = build_learner(cfg, r, update, tokenizer, rollout.engine.caps.exact_logprobs,
                            actor_features=spot.actor_features if spot is not None else None)
    trainer = Trainer(cfg.trainer, cfg.rollout, cfg.task, r, rollout.engine, learner, tokenizer, rollout.rewards, loader,
                      problems.held_out, rollout.sampling, run_dir, scope=scope, start_step=state.step,
                      idle_work=idle_work, hooks=hooks, guard=build_memory_guard(cfg, r, log, resident_before),
                      trim_heap=cfg.memory_guard.trim_heap)
    if "length_predictor" in state.components:
        trainer.schedule.load_state_dict(state.components["length_predictor"])
    trainer.sync(version=state.step)  # the engine serves exactly the actor's weights (a resumed run's too)
    return finish_run(cfg, r, run_dir, log, problems, loader, rollout.engine, update.actor, trainer, state,
                      resume is not None, resources)


def _build_idle(cfg: TrainConfig, r: Ranks, run_dir: Path, log: RankLog, resources: ExitStack, engine: RolloutBackend,
                tokenizer, loader: PromptLoader, sampling: StepSampling, resume: Path | None):
    """The idle window's work: bubble pre-generation and / or spot training under one schedule
    (None when neither is on); -> (the work, its step hooks, the spot run or None)."""
    store = job_store(r)
    spot = None
    hooks: list[StepHook] = []
    if cfg.spot.enabled:
        from spot.colocated import build_spot_work

        spot = build_spot_work(cfg.spot, engine, run_name=run_dir.name, rank=r.rank, local_rank=r.local_rank, world=r.world,
                               seed=cfg.run.seed, max_new_tokens=cfg.rollout.max_new_tokens, store=store, resume=resume)
        resources.callback(spot.close)
        log(f"spot training on: node buffer {spot.buffer.name} ({cfg.spot.buffer_mb} MiB), drafter trained in idle windows")
        if spot.actor_features is not None and spot.actor_features.head is not None:  # a drafter served out of process
            hooks.append(WeightsFollower(spot.actor_features.head.follow))  # its embedding and head follow the policy

    bubble = None
    if cfg.bubble.enabled:
        from pipeline.drafts.bubble import BubbleDrafts, BubbleStore, BubbleWork

        bubbles = BubbleStore(cfg.bubble.max_tokens)
        hooks.append(BubbleDrafts(bubbles))
        part = GroupSplit.of(cfg.rollout, r.world, r.rank)  # what this rank rolls out next step
        control = ControlPlane(store, r.rank, r.world) if store is not None else None
        bubble = BubbleWork(engine, lambda: part.next_requests(loader, tokenizer, cfg.task.chat), sampling, bubbles,
                            cfg.bubble, control)

    if spot is None and bubble is None:
        return None, hooks, None
    schedule = IdleSchedule(pregenerate=bubble is not None, train=spot is not None, share=cfg.bubble.share)
    work = ScheduledIdle(schedule, bubble, spot.work if spot is not None else None)
    return work, [IdleWorkHook(work), *hooks], spot
