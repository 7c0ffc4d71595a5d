"""The RL loop: orchestration only; every stage lives in its own module.

One step on every rank of a colocated placement (each rank rolls out, then trains; a separated
placement runs the same stages on separate ranks: pipeline.separated.actor, pipeline.separated.rollout):

    prompts (pipeline.data: this rank's shard of the step)
    -> rollouts (pipeline.rollout.schedule: the engine on this rank's shard or on units taken from a shared
       queue, pipeline.rollout.stage: noise keyed by run seed, RL step, prompt, sample); each rollout
       scored once, as it is made (pipeline.tasks.reward_scoring); DAPO's dynamic sampling rolls
       out more rounds first
    -> idle window (common.idle: wait for the slowest rank, or pre-generate / train the drafter)
    -> the rows this rank trains (pipeline.rollout.schedule.share: its shard, exchanged if made elsewhere)
    -> advantages -> old (and reference) log-probs -> PPO epochs (pipeline.update.learner)
    -> weight sync (engine.load_weights(actor.named_weights(), version=step))
    -> metrics -> eval every N steps -> checkpoint every N steps.

The run's optional parts (bubble drafts, spot training, history drafts, the speculation policy's
state, a drafter that follows the policy's LM head) are step hooks (pipeline.hooks), built by
launch.run.colocated for what the config turns on: the Trainer calls every hook at each moment of
the step (its start, each generation round's requests and rollouts, the idle window's close, the
weight sync, the step's end), reduces their metrics over the ranks as each declares, and saves
their state, without asking which parts the run has.

The engine is a rollout backend (engine.backend.RolloutBackend: native or vLLM) and the loop
reads what it can do from its capabilities: where its log-probs are not exactly the served
policy's (vLLM's numerics, bf16 weight copies) the old log-probs are the actor's and
`train/mismatch_kl` measures the gap; where it returns no hidden states, spot training's
DataBuffer is filled from that same actor forward (`actor_features`, spot.buffer.actor_features). The
backend sleeps from the rollouts' end to the weight sync while the colocated actor works (a no-op
for the native engine). The parts are built and connected by launch.run.build.build_run.

Synchronous by default; `trainer.async_steps: 1` rolls out step t+1 with the
policy before step t's update (one step off-policy) and corrects with a truncated importance
weight min(pi_old / pi_behaviour, is_cap) on each token's advantage.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from common import heap
from common.idle import IdleWindows, IdleWork
from engine.backend import RolloutBackend
from engine.types import Request, RolloutBatch, StepRecord
from pipeline.algorithms import fill_groups, informative_groups
from pipeline.config import RolloutSection, TaskSection, TrainerSection
from pipeline.data import PromptLoader
from pipeline.dist import Ranks, all_sum, gather_floats, gather_objects, job_store
from pipeline.hooks import StepHook, hook_metrics
from pipeline.update.learner import Learner
from pipeline.memory_guard import Action, MemoryGuard, available_share
from pipeline.metrics import phase_peaks
from pipeline.metrics.live_memory import heap_free_bytes, live_rss_bytes, rss_metrics
from pipeline.rollout.stage import ScoredRollouts, StepSampling, held_out_accuracy
from pipeline.checkpoint.state import RunState, checkpoint_dir, save_run
from pipeline.rollout.schedule import RolloutSchedule
from pipeline.rollout.report import RolloutReport, rollout_metrics
from pipeline.tasks import Problem
from pipeline.tasks.reward_scoring import Rewards


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GB (over every phase: pipeline.metrics.phase_peaks)."""
    return phase_peaks.peak_bytes() / 1e9




@dataclass
class StepResult:
    metrics: dict[str, float]
    lengths: list[int]  # this step's response lengths (all ranks; empty on a rollout rank of a separated run)
    rollouts: ScoredRollouts | None  # the rollouts this rank trained on (None on a rollout rank of a separated run)
    decode_steps: list[StepRecord]  # this rank's engine decode steps (none on an actor rank of a separated run)
    stop: str | None = None  # the memory guard stops the run after this step (its message); every rank alike


class StepDriver(Protocol):
    """What launch.run.build's loop drives on every rank: this Trainer (colocated), or a separated
    placement's actor or rollout side (pipeline.separated.actor, pipeline.separated.rollout)."""

    step_index: int  # RL steps completed

    def step(self) -> StepResult: ...

    def evaluate(self) -> float | None:
        """Held-out greedy accuracy on rank 0 (None elsewhere); collective."""

    def save(self) -> None:
        """A run checkpoint of step_index; collective."""


class Trainer:
    def __init__(self, trainer_cfg: TrainerSection, rollout_cfg: RolloutSection, task_cfg: TaskSection, ranks: Ranks,
                 engine: RolloutBackend, learner: Learner, tokenizer, rewards: Rewards, loader: PromptLoader,
                 eval_problems: list[Problem], sampling: StepSampling, run_dir, *, scope: str, start_step: int = 0,
                 idle_work: IdleWork | None = None, hooks: Sequence[StepHook] = (),
                 windows: IdleWindows | None = None, guard: MemoryGuard | None = None, trim_heap: bool = False) -> None:
        """`learner`: the update (its actor is the one trained and synced); `rewards`: the run's
        (pipeline.tasks.reward_scoring.build_rewards), released by whoever built them; `idle_work`: what
        the idle window runs (None: a barrier); `hooks`: the run's optional parts (pipeline.hooks), the
        idle work's among them; `scope`: the run's keys in the job's store (pipeline.dist.run_scope),
        for its idle windows and work queues."""
        self.tc, self.task_cfg, self.r, self.engine, self.tok = trainer_cfg, task_cfg, ranks, engine, tokenizer
        self.learner, self.actor, self.algo = learner, learner.actor, learner.algo
        self.rewards, self.loader, self.eval_problems, self.run_dir = rewards, loader, eval_problems, run_dir
        self.sampling, self.idle_work, self.hooks, self.guard = sampling, idle_work, list(hooks), guard
        self.trim_heap = trim_heap
        self.windows = windows or IdleWindows(job_store(ranks), ranks.rank, ranks.world, scope, barrier=self._barrier)
        self.step_index = start_step
        self.pending: ScoredRollouts | None = None  # async mode: the next step's rollouts, made before this update
        self.schedule = RolloutSchedule(rollout_cfg, trainer_cfg.train_shares, ranks, job_store(ranks), scope,
                                        mini_batches=trainer_cfg.mini_batches,
                                        equal_rewards_free=learner.skips_equal_reward_groups)

    def _barrier(self) -> None:
        if self.r.world > 1:
            dist.barrier()

    # -- one RL step -----------------------------------------------------------------------
    def _roll_out(self, step: int) -> ScoredRollouts:
        """One generation round of `step` on this rank, its requests prepared by the hooks."""

        def prepare(requests: list[Request]) -> list[Request]:
            for hook in self.hooks:
                requests = hook.requests(step, requests)
            return requests

        scored = self.schedule.generate(step, self.engine, self.tok, self.loader, self.sampling(step), self.task_cfg.chat,
                                        self.rewards, prepare)
        for hook in self.hooks:
            hook.rolled_out(step, scored)
        return scored

    def step(self) -> StepResult:
        t_step = time.perf_counter()
        step = self.step_index
        peaks = {"other": phase_peaks.mark()}  # since the last step: the build, evaluation, checkpoints
        t = time.perf_counter()
        for hook in self.hooks:
            hook.begin(step)
        if self.tc.async_steps and self.pending is not None:
            scored = self.pending  # made with the policy before the last update
        else:
            scored = self._fill(step)
        rollout_s = time.perf_counter() - t
        idle_s, idle_metrics = self.windows.run(step, self.idle_work)
        for hook in self.hooks:  # every rank is done: a gather makes no rank wait
            hook.collect(step, scored)
        peaks["rollout"] = phase_peaks.mark()
        t = time.perf_counter()
        scored, schedule_metrics = self.schedule.share(scored)  # the rows this rank trains on (an exchange, if any)
        exchange_s = time.perf_counter() - t
        if self.tc.async_steps:
            self.pending = self._fill(step + 1)  # with this policy, before this step's update
        self.engine.sleep()
        if self.trim_heap:
            heap.trim()  # the rollout's freed temporaries
        metrics, logprob_s, update_s = self.learner.train(scored, step)
        t = time.perf_counter()
        if self.trim_heap:
            heap.trim()  # the update's freed activations
        self.engine.wake_up()
        self.sync(version=step + 1)
        for hook in self.hooks:  # what went on during the update (spot's average: timed in timing/sync)
            hook.end(step)
        sync_s = time.perf_counter() - t
        peaks["update"] = phase_peaks.mark()
        self.step_index = step + 1
        metrics.update(self._step_metrics(scored, rollout_s, idle_s, logprob_s, update_s, sync_s, time.perf_counter() - t_step,
                                          peaks))
        metrics.update(idle_metrics)
        metrics.update(schedule_metrics)
        metrics["timing/exchange"] = exchange_s
        # The version the step's rollouts were made with, and the one the engine serves after the sync.
        metrics["rollout/policy_version"] = float(scored.batch.policy_version)
        metrics["engine/version"] = float(self.engine.version)
        metrics.update(scored.fill_metrics)
        metrics.update(hook_metrics(self.hooks, scored, lambda mine: gather_floats(self.r, mine)))
        # every rank's trained rows (as many as its share: token shares differ by rank)
        mine = scored.lengths[scored.trained].tolist()
        lengths = [int(x) for part in gather_objects(self.r, mine) for x in part]
        stop = self._guard_memory(metrics) if self.guard is not None else None
        return StepResult(metrics=metrics, lengths=lengths, rollouts=scored, decode_steps=scored.batch.steps, stop=stop)

    def _guard_memory(self, metrics: dict[str, float]) -> str | None:
        """The memory guard's verdict on this step's gathered memory (the same on every rank): sheds the
        hooks' optional work, or returns the message to stop with."""
        world = range(self.r.world)
        # this step's own peak (its phases'), not the process's: an earlier run in the process is not this one's
        peaks = [max(metrics[f"mem/peak_gb/{p}/rank{r}"] for p in ("other", "rollout", "update")) for r in world]
        available = [metrics[f"mem/available_share/rank{r}"] for r in world]
        optional = [hook for hook in self.hooks if hook.optional]
        verdict = self.guard.verdict(peaks, available, can_shed=bool(optional))
        if verdict.action is Action.SHED:
            stopped = [name for hook in optional for name in hook.shed()]
            self.guard.shed_done = True
            self.guard.log(f"memory guard: {verdict.reason}: {' and '.join(stopped) or 'nothing'} off from step "
                           f"{self.step_index + 1} (they change no token)")
            metrics["mem/guard_shed"] = 1.0
        elif verdict.action is Action.WARN:
            self.guard.log(f"memory guard: {verdict.reason} (memory_guard.mode={self.guard.cfg.mode})")
        elif verdict.action is Action.STOP:
            return self.guard.stop_message(verdict.reason, self.step_index)
        return None

    def sync(self, version: int) -> None:
        """The actor's weights into the engine, served as `version`, through the hooks' `weights`."""
        named = self.actor.named_weights()
        for hook in self.hooks:
            named = hook.weights(named)
        self.engine.load_weights(named, version=version)

    def _fill(self, step: int) -> ScoredRollouts:
        """The step's rollouts. With dynamic sampling (DAPO), every rank rolls out more rounds of
        prompts until each has `prompts_per_step` groups whose rewards differ (all ranks take the
        same number of rounds, so their data loaders stay in step), and trains on the first of them
        (`fill_groups`); a rank still short after `algorithm.max_sampling_rounds` rounds stops the
        run on every rank with an error."""
        rounds = [self._roll_out(step)]
        if not self.algo.dynamic_sampling:
            return rounds[0]
        want, n = len(rounds[0].problems), rounds[0].n
        while (short := all_sum(self.r, float(_informative(rounds, n) < want))) > 0:
            if len(rounds) == self.algo.max_sampling_rounds:
                raise ValueError(
                    f"dynamic sampling: {int(short)} rank(s) found fewer than {want} prompts whose {n} rewards differ in "
                    f"{len(rounds)} rounds of rollouts at step {step + 1}; raise algorithm.max_sampling_rounds, use "
                    "problems the policy sometimes solves, or set algorithm.dynamic_sampling=false")
            rounds.append(self._roll_out(step))
        groups = ((_Group(part, g), part.rewards[g * n : (g + 1) * n].tolist())
                  for part in rounds for g in range(len(part.problems)))
        kept, metrics = fill_groups(groups, want)
        return _join_groups(kept, rounds, n, metrics | {"train/dynamic_sampling_rounds": float(len(rounds))})

    def _step_metrics(self, scored: ScoredRollouts, rollout_s, idle_s, logprob_s, update_s, sync_s, step_s,
                      peaks: dict[str, int]) -> dict[str, float]:
        # the reward calls made during this step (an asynchronous run's include the next step's rollouts)
        mine = RolloutReport.of(scored, rollout_s, idle_s, self.rewards.take_stats())
        reports = dict(enumerate(gather_objects(self.r, mine)))
        m = {"step": float(self.step_index), "timing/step": step_s, "timing/logprob": logprob_s, "timing/update": update_s,
             "timing/sync": sync_s, "world_size": float(self.r.world)}
        m.update(rollout_metrics(reports))
        rewards = scored.rewards[scored.trained]
        m["reward/std"] = float(rewards.std()) if rewards.numel() > 1 else 0.0
        # by rank: peak, live, glibc's free heap, the host's available share, then each phase's peak
        phases = sorted(peaks)
        memory = gather_floats(self.r, [peak_rss_gb(), live_rss_bytes() / 1e9, heap_free_bytes() / 1e9, available_share(),
                                        *(peaks[p] / 1e9 for p in phases)])
        m.update(rss_metrics([row[1] for row in memory], [row[2] for row in memory]))
        for rank, row in enumerate(memory):
            m[f"mem/available_share/rank{rank}"] = row[3]
            m.update({f"mem/peak_gb/{p}/rank{rank}": gb for p, gb in zip(phases, row[4:])})
        peaks = [row[0] for row in memory]
        m["memory/peak_rss_gb"] = max(peaks)  # the rank nearest to running out
        m.update({f"memory/peak_rss_gb/rank{rank}": gb for rank, gb in enumerate(peaks)})
        return m

    # -- eval and checkpoints --------------------------------------------------------------
    def evaluate(self) -> float | None:
        """Greedy held-out accuracy through the engine (rank 0; None on the others). The others wait
        for it here, so that the wait is not counted as the next step's idle time."""
        accuracy = None
        if self.r.main:
            accuracy = held_out_accuracy(self.engine, self.tok, self.eval_problems, self.task_cfg, self.sampling,
                                         self.rewards)
        self._barrier()
        return accuracy

    def save(self) -> None:
        """A run checkpoint (collective): the actor, the loader's position, each hook's state (history,
        idle work: equal on every rank or rank 0's) and files, the long-first length predictions, and
        the drafter (the engine's, else one a hook trains: a drafter served out of process)."""
        components = {hook.name: hook.state_dict() for hook in self.hooks if hook.name}
        if lengths := self.schedule.state_dict():  # long-first's predictions resume from the lengths seen
            components["length_predictor"] = lengths
        extras = {name: write for hook in self.hooks for name, write in hook.checkpoint_files().items()}
        state = RunState(step=self.step_index, loader=self.loader.state_dict(), engine_version=self.engine.version,
                         components=components)
        drafter = next(iter([*self.engine.drafter_nets(), *(net for hook in self.hooks for net in hook.drafters())]), None)
        save_run(checkpoint_dir(self.run_dir, self.step_index), state, self.actor, drafter, main=self.r.main, extras=extras)


def _informative(parts: list[ScoredRollouts], n: int) -> int:
    return sum(int(informative_groups(p.rewards.view(-1, n)).sum()) for p in parts)


@dataclass(frozen=True)
class _Group:
    """One prompt's n rollouts within a round of dynamic sampling."""

    part: ScoredRollouts
    index: int


def _join_groups(groups: list[_Group], rounds: list[ScoredRollouts], n: int, metrics: dict[str, float]) -> ScoredRollouts:
    """The chosen groups as one batch; its step records, prefill and wall time are every round's."""
    counters: dict[str, int] | None = None  # a backend without step records (vLLM): its counters, summed
    for p in rounds:
        if p.batch.counters is not None:
            counters = {k: (counters or {}).get(k, 0) + v for k, v in p.batch.counters.items()}
    batch = RolloutBatch(rollouts=[ro for g in groups for ro in g.part.batch.rollouts[g.index * n : (g.index + 1) * n]],
                         steps=[s for p in rounds for s in p.batch.steps], prefill_s=sum(p.batch.prefill_s for p in rounds),
                         wall_s=sum(p.batch.wall_s for p in rounds), policy_version=rounds[0].batch.policy_version,
                         counters=counters)
    return ScoredRollouts(problems=[g.part.problems[g.index] for g in groups], prompts=[g.part.prompts[g.index] for g in groups],
                          batch=batch, rewards=torch.cat([g.part.rewards[g.index * n : (g.index + 1) * n] for g in groups]),
                          n=n, fill_metrics=metrics)
