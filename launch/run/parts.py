"""What both placements' builders (launch.run.colocated, launch.run.separated) share: the run's data
(`load_data`), its two sides, each built by one function (`build_rollout_side`: the rewards, the
rollout backend, the step's sampling and the hooks of the speculation policy and the history
store; `build_update_side`: the actor and its reference policy; `build_learner` over it), and the
`Run` they return (`finish_run`), with its loop over the steps (evaluation, metrics, checkpoints)
and its release; the rank's log (`RankLog`); the state a resumed run continues from
(`resume_state`). A colocated rank builds both sides, a separated rank the side of its role.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from common.text import load_tokenizer, pad_token, stop_tokens
from engine.backend import RolloutBackend
from engine.backends.factory import build_rollout_engine
from common.config import to_dict
from launch.run.problems import RunProblems, problems_for
from launch.run.config import TrainConfig
from pipeline.actors import Actor, build_actor
from pipeline.algorithms import build_algorithm
from pipeline.checkpoint.keep import retain
from pipeline.data import PromptLoader
from pipeline.dist import Ranks, gather_floats
from pipeline.drafts.history import RunHistory, run_history
from pipeline.hooks import SpecPolicyHook, StepHook
from pipeline.update.learner import Learner, uses_engine_logprobs
from pipeline.memory_guard import MemoryGuard, MemoryGuardStop
from pipeline.metrics import MetricsLogger
from pipeline.metrics.device_memory import cuda_memory_metrics
from pipeline.metrics.records_log import log_step, truncate_after
from pipeline.update.reference import ReferencePolicy
from pipeline.rollout.stage import StepSampling
from pipeline.checkpoint.state import RunState, load_run
from pipeline.tasks import Problem, Task
from pipeline.tasks.reward_scoring import Rewards, build_rewards
from pipeline.trainer import StepDriver, peak_rss_gb


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


@dataclass
class Run:
    cfg: TrainConfig
    ranks: Ranks
    run_dir: Path
    log: RankLog
    task: Task
    held_out: list[Problem]
    held_out_source: str  # names the held-out set in the eval log (launch.run.problems.RunProblems)
    loader: PromptLoader
    engine: RolloutBackend | None  # None on a separated run's actor ranks
    actor: Actor | None  # None on a separated run's rollout ranks
    trainer: StepDriver  # colocated: the Trainer; separated: this rank's side (launch.run.separated)
    logger: MetricsLogger
    start_step: int  # RL steps done before this process (a resumed run's checkpoint)
    resources: ExitStack = field(default_factory=ExitStack)  # closed by close(), last built first

    def train(self) -> dict:
        """Runs the remaining steps: eval before the first, every `trainer.eval_every` steps and at the
        end; metrics every step; checkpoints every `trainer.save_every` steps and at the end, the
        `trainer.keep_checkpoints` latest and the best held-out kept (pipeline.checkpoint.keep)."""
        cfg, r, trainer, log = self.cfg, self.ranks, self.trainer, self.log
        tc = cfg.trainer
        accuracy: dict[int, float] = {}
        with self.logger:
            if self.start_step == 0:
                accuracy[0] = trainer.evaluate()
                if r.main:
                    self.logger.log(0, {"eval/accuracy": accuracy[0]})
                    log(f"held-out greedy accuracy before training: {accuracy[0]:.1%} on {self.held_out_source}")
            t0 = time.perf_counter()
            for _ in range(self.start_step, tc.steps):
                result = trainer.step()
                step = trainer.step_index
                log_step(self.run_dir, step, r.rank, result.decode_steps, result.rollouts)
                log(f"step {step}: peak RSS {peak_rss_gb():.2f} GB on rank {r.rank}")
                metrics = result.metrics | cuda_memory_metrics(r)
                if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
                    acc = trainer.evaluate()
                    if acc is not None:
                        metrics["eval/accuracy"] = accuracy[step] = acc
                self.logger.log(step, metrics, lengths=result.lengths)
                if (tc.save_every and step % tc.save_every == 0) or step == tc.steps or result.stop:
                    trainer.save()
                    if r.main and tc.keep_checkpoints:
                        for folder in retain(self.run_dir, step, accuracy.get(step), tc.keep_checkpoints):
                            log(f"removed checkpoint {folder.name} (trainer.keep_checkpoints={tc.keep_checkpoints}: "
                                "the latest and the best held-out stay)")
                if result.stop:  # the memory guard's, on every rank at this step: resumable from the checkpoint
                    log(result.stop)
                    raise MemoryGuardStop(result.stop)
            train_s = time.perf_counter() - t0
        summary = {"run_dir": str(self.run_dir), "steps": tc.steps, "world_size": r.world, "train_seconds": round(train_s, 1),
                   "heldout_accuracy": {str(k): v for k, v in accuracy.items()}}
        if r.main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            for name in ("dashboard.png", "summary.txt"):
                if (self.run_dir / name).exists():
                    log(f"wrote {self.run_dir / name}")
        return summary

    def close(self) -> None:
        self.resources.close()


def resume_state(cfg: TrainConfig, r: Ranks, run_dir: Path, log: RankLog) -> tuple[Path | None, RunState]:
    """The checkpoint to continue from (None: a fresh start) and its state; rank 0 drops the run
    folder's records of the steps about to be redone."""
    resume = Path(cfg.trainer.resume) if cfg.trainer.resume else None
    if resume is None:
        return None, RunState(step=0, loader={}, engine_version=0)
    state = load_run(resume)
    if r.main:
        truncate_after(run_dir, state.step)
    log(f"resumed from {resume} at step {state.step}")
    return resume, state


def load_data(cfg: TrainConfig, log: RankLog) -> tuple[object, RunProblems]:
    """The tokenizer and the run's problems, with what the data files held logged."""
    tokenizer = load_tokenizer(cfg.model.path)
    problems = problems_for(cfg, tokenizer)
    for line in problems.summary:
        log(f"data: {line}")
    return tokenizer, problems


@dataclass
class RolloutSide:
    """What a rank that rolls out holds: the run's rewards, the rollout backend, the step's sampling,
    and the step hooks of the backend's speculation policy and of the history store."""

    rewards: Rewards
    engine: RolloutBackend
    sampling: StepSampling
    history: RunHistory | None  # the history drafter's store over the ranks that roll out (None: no history part)

    def hooks(self, idle: list[StepHook]) -> list[StepHook]:
        """The run's step hooks: the speculation policy's (a learning tuner's state) first, the idle
        work's `idle` next, the history store's last (it gathers every rank's rollouts once the step's
        idle window has closed). Called once: each call makes a new policy hook."""
        first: list[StepHook] = [SpecPolicyHook(self.engine.policy)] if self.engine.policy is not None else []
        last: list[StepHook] = [self.history] if self.history is not None else []
        return [*first, *idle, *last]


def build_rollout_side(cfg: TrainConfig, ranks: Ranks, log: RankLog, resources: ExitStack, tokenizer,
                       task: Task) -> RolloutSide:
    """The rollout side on this rank; `ranks`: the ranks that roll out (the job, or a separated run's
    rollout group), over which the history store is kept equal."""
    rewards = build_rewards(cfg.task, task, log)  # before any rollout: a reward that does not load stops the build
    resources.callback(rewards.close)
    log(rewards.summary())
    history = run_history(cfg.engine.spec, ranks)
    engine = build_rollout_engine(cfg.model.path, cfg.engine, seed=cfg.run.seed,
                                  history=history.store if history is not None else None)
    resources.callback(engine.close)
    if cfg.engine.products == "auto" and engine.caps.bf16_kernels:
        log(f"engine.products=auto: the rollout's products run in "
            f"{'bf16' if cfg.engine.bf16_products() else 'float32'} on this machine")
    sampling = StepSampling.of(cfg.rollout, cfg.run.seed, stop_tokens(engine.model_config, tokenizer))
    return RolloutSide(rewards=rewards, engine=engine, sampling=sampling, history=history)


@dataclass
class UpdateSide:
    """What a rank that trains holds: the actor and its frozen reference policy (None without a KL term)."""

    actor: Actor
    reference: ReferencePolicy | None


def build_update_side(cfg: TrainConfig, log: RankLog, resume: Path | None, group=None) -> UpdateSide:
    """The update side on this rank, its actor restored from `resume`'s checkpoint if any; `group`:
    the actor's data-parallel ranks (None: the job's; a separated run's actor group)."""
    actor = build_actor(cfg.actor, cfg.model.path, group=group)
    if (schedule := cfg.actor.schedule_summary(cfg.trainer.steps)) is not None:
        log(schedule)
    if cfg.actor.precision == "auto":
        from pipeline.actors.precision import resolve

        log(f"actor.precision=auto: the update runs {resolve(cfg.actor)} on this machine")
    reference = ReferencePolicy(cfg.actor, cfg.model.path) if cfg.algorithm.kl_coef > 0 else None
    if resume is not None:
        actor.load(resume / "actor")
    return UpdateSide(actor=actor, reference=reference)


def build_learner(cfg: TrainConfig, ranks: Ranks, side: UpdateSide, tokenizer, exact_logprobs: bool,
                  actor_features=None) -> Learner:
    """The update over `side`'s actor on `ranks` (the actor's data-parallel ranks); `exact_logprobs`:
    whether the rollout backend's log-probs are the served policy's (its caps), which with the run's
    sampling decides whose old log-probs the PPO ratio takes."""
    samples_policy = StepSampling.of(cfg.rollout, cfg.run.seed, ()).is_policy  # stop tokens change no distribution
    return Learner(cfg.trainer, build_algorithm(cfg.algorithm, cfg.rollout.max_new_tokens), cfg.actor, ranks, side.actor,
                   pad_token(tokenizer), uses_engine_logprobs(cfg.trainer, samples_policy, exact_logprobs),
                   reference=side.reference, actor_features=actor_features)


def build_memory_guard(cfg: TrainConfig, r: Ranks, log: RankLog, resident_before: int) -> MemoryGuard | None:
    """The colocated run's memory guard (None with memory_guard.mode=off): each rank held to the memory
    plan's colocated peak on a CPU (launch.memory, as the preflight checks it), to its host's available
    share only on a GPU (whose plan is the device's). `resident_before`: this rank's resident bytes
    before the run was built; what a process held beyond a fresh rank's runtime then (an earlier run in
    the same process: a bench's ways, a test session) is added to its plan. Collective."""
    g = cfg.memory_guard
    if g.mode == "off":
        return None
    from launch.memory.report import CPU_RUNTIME_MB, model_config, on_gpu, plan_for

    if on_gpu(cfg):
        log(f"memory guard ({g.mode}): the host's available memory under {g.min_available:.0%} (a GPU's plan is the device's)")
        return MemoryGuard(g, None, log)
    try:
        role = plan_for(cfg, model_config(cfg, None), ranks=r.world).roles[0]
    except (ValueError, FileNotFoundError) as e:  # a backend the planner does not size
        log(f"memory guard ({g.mode}): no memory plan for this config ({e}); the host's available memory under "
            f"{g.min_available:.0%} only")
        return MemoryGuard(g, None, log)
    held = [max(0.0, row[0] - CPU_RUNTIME_MB * 2**20 / 1e9) for row in gather_floats(r, [resident_before / 1e9])]
    log(f"memory guard ({g.mode}): the plan's {role.peak / 1e9:.2f} GB a rank (python -m launch.memory) "
        f"+{g.over_plan:.0%} (at least {g.over_plan_gb:g} GB), and {g.min_available:.0%} of the host's memory available"
        + (f"; the process held {max(held):.2f} GB more than a fresh rank before the run" if max(held) > 0.1 else ""))
    return MemoryGuard(g, [role.peak / 1e9 + extra for extra in held], log)


def finish_run(cfg: TrainConfig, r: Ranks, run_dir: Path, log: RankLog, problems: RunProblems, loader: PromptLoader,
               engine: RolloutBackend | None, actor: Actor | None, driver: StepDriver, state: RunState,
               resumed: bool, resources: ExitStack) -> Run:
    """The Run over the built parts, with its metrics logger (a fresh start drops an earlier
    attempt's lines: resume_after_step=-1)."""
    logger = MetricsLogger.from_config(run_dir, cfg.metrics, rank=r.rank, run_name=run_dir.name,
                                       resolved_config=to_dict(cfg), resume_after_step=state.step if resumed else -1)
    return Run(cfg=cfg, ranks=r, run_dir=run_dir, log=log, task=problems.task, held_out=problems.held_out,
               held_out_source=problems.held_out_source, loader=loader, engine=engine, actor=actor, trainer=driver,
               logger=logger, start_step=state.step, resources=resources)
