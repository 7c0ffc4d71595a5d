"""`build_colocated(...)`: the parts of a colocated run on this rank (launch.run.build_run calls it).

Every rank holds a rollout backend (engine.backend.RolloutBackend, native or vLLM), a
data-parallel replica of the actor and its reference policy, its shard of the data loader, the
step's sampling, and the idle window's work (bubble pre-generation and spot training, run by one
common.idle.ScheduledIdle); the Trainer (pipeline.trainer) runs its steps, each part given exactly
what it uses. A resumed run loads each part's state from the checkpoint before the first sync.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from common.idle import ControlPlane, IdleSchedule, ScheduledIdle
from common.text import load_tokenizer, pad_token, stop_tokens
from engine.backend import RolloutBackend
from engine.backends.factory import build_rollout_engine
from launch.config import to_dict
from launch.problems import problems_for, prompt_loader
from launch.run_config import TrainConfig
from launch.run_parts import RankLog, Run, resume_state
from pipeline.actors import build_actor
from pipeline.algorithms import build_algorithm
from pipeline.data import PromptLoader
from pipeline.dist import Ranks, job_store
from pipeline.history import run_history
from pipeline.hooks import IdleWorkHook, SpecPolicyHook, StepHook, WeightsFollower, load_hook_states
from pipeline.learner import Learner, uses_engine_logprobs
from pipeline.metrics import MetricsLogger
from pipeline.reference import ReferencePolicy
from pipeline.rollouts import StepSampling
from pipeline.schedule import GroupSplit
from pipeline.tasks.reward_scoring import build_rewards
from pipeline.trainer import Trainer


def build_colocated(cfg: TrainConfig, r: Ranks, run_dir: Path, log: RankLog, resources: ExitStack) -> Run:
    tokenizer = load_tokenizer(cfg.model.path)
    problems = problems_for(cfg, tokenizer)
    for line in problems.summary:
        log(f"data: {line}")
    task, held_out = problems.task, problems.held_out
    loader = prompt_loader(cfg, problems.train, world_size=r.world, rank=r.rank, log=log)
    rewards = build_rewards(cfg.task, task, log)  # before any rollout: a reward that does not load stops the build
    resources.callback(rewards.close)
    log(rewards.summary())
    history = run_history(cfg.engine.spec, r)
    engine = build_rollout_engine(cfg.model.path, cfg.engine, seed=cfg.run.seed,
                                  history=history.store if history is not None else None)
    resources.callback(engine.close)
    if cfg.engine.products == "auto" and engine.caps.bf16_kernels:
        log(f"engine.products=auto: the rollout's products run in "
            f"{'bf16' if cfg.engine.bf16_products() else 'float32'} on this machine")
    sampling = StepSampling.of(cfg.rollout, cfg.run.seed, stop_tokens(engine.model_config, tokenizer))
    actor = build_actor(cfg.actor, cfg.model.path)
    if (schedule := cfg.actor.schedule_summary(cfg.trainer.steps)) is not None:
        log(schedule)
    if cfg.actor.precision == "auto":
        from pipeline.actors.precision import resolve

        log(f"actor.precision=auto: the update runs {resolve(cfg.actor)} on this machine")
    reference = ReferencePolicy(cfg.actor, cfg.model.path) if cfg.algorithm.kl_coef > 0 else None
    resume, state = resume_state(cfg, r, run_dir, log)
    if resume is not None:
        actor.load(resume / "actor")
        loader.load_state_dict(state.loader)
    idle_work, hooks, spot = _build_idle(cfg, r, run_dir, log, resources, engine, tokenizer, loader, sampling, resume)
    if engine.policy is not None:
        hooks.insert(0, SpecPolicyHook(engine.policy))
    if history is not None:
        hooks.append(history)
    load_hook_states(hooks, state.components)  # a resumed run's (a fresh start's components are empty)

    engine_old = uses_engine_logprobs(cfg.trainer, sampling.is_policy, engine.caps.exact_logprobs)
    learner = Learner(cfg.trainer, build_algorithm(cfg.algorithm, cfg.rollout.max_new_tokens), cfg.actor, r, actor,
                      pad_token(tokenizer), engine_old, reference=reference,
                      actor_features=spot.actor_features if spot is not None else None)
    trainer = Trainer(cfg.trainer, cfg.rollout, cfg.task, r, engine, learner, tokenizer, rewards, loader, held_out,
                      sampling, run_dir, start_step=state.step, idle_work=idle_work, hooks=hooks)
    if "length_predictor" in state.components:
        trainer.schedule.load_state_dict(state.components["length_predictor"])
    trainer.sync(version=state.step)  # the engine serves exactly the actor's weights (a resumed run's too)
    logger = MetricsLogger.from_config(run_dir, cfg.metrics, rank=r.rank, run_name=run_dir.name,
                                       resolved_config=to_dict(cfg),
                                       resume_after_step=state.step if resume is not None else -1)  # -1: a fresh start drops an earlier attempt's lines
    return Run(cfg=cfg, ranks=r, run_dir=run_dir, log=log, task=task, held_out=held_out,
               held_out_source=problems.held_out_source, loader=loader, engine=engine, actor=actor, trainer=trainer,
               logger=logger, start_step=state.step, resources=resources)


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
        from pipeline.bubble import BubbleDrafts, BubbleStore, BubbleWork

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
