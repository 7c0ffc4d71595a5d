"""The rollout ranks' loop of a separated placement (pipeline.placement): generate, send, load.

One step on rollout rank j (of R), step t counted from 0:

    the step's prompts (the loader's global step: every rank computes it, nothing is sent)
    -> this rank's groups of it, `generation_shares(P, R)[j]`, or with rollout.split_groups its
       part of every group (samples j*n/R .. (j+1)*n/R - 1), rolled out and scored with the step's
       sampling keys (run seed, step, prompt id, sample: the tokens colocated ranks make)
    -> idle window (common.idle: the wait for the slowest rollout rank)
    -> with history drafts, every rollout rank's responses into every rollout rank's history
       store (pipeline.drafts.history, over the rollout group, as colocated ranks do after their window)
    -> a shipment to every actor rank (pipeline.separated.shipment) with this rank's RolloutReport
    -> the weight push of version t+1 (pipeline.separated.weight_sync), then its wait and load times to actor
       rank 0, with the idle work's metrics of the step.

A rollout rank is idle twice a step: in the tail (`windows`: common.idle's window, which runs the
run's IdleWork when it has one, as colocated ranks' windows do) and through the actor's update,
until the push begins. The run's optional parts are step hooks (pipeline.hooks), the colocated
Trainer's: each moment of the step calls every hook, in list order (begin; requests and
rolled_out per generation; collect after the idle window; `updating` through the actor's update,
where idle work (spot training, spot.separated) runs until actor rank 0's announcement of the push,
common.idle.update; weights at every load; end after the push, before the next rollouts; metrics).
The time until the push begins, worked or waited, is the rank's idle time through the update.

`trainer.async_steps=1`: step t+1 is rolled out (with the policy before step t's update) and
sent before the push of version t+1, so generation overlaps the actor's update. Before every
generation the engine must serve the step's expected version (t, or t-1 in async mode, never
before the run's start), or the rank stops with an error: it never rolls out a stale policy.

The first rollout rank also evaluates held-out accuracy (greedy) and sends actor rank 0 the
hooks' metrics of each step and their state for checkpoints (`{hook.name: state}`, the colocated
checkpoint's components). Decode step records stay here (pipeline.metrics.records_log logs them under
this rank).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from common.idle import IdleWindows, IdleWork
from engine.backend import NamedTensors, RolloutBackend
from pipeline.config import RolloutSection, TaskSection, TrainerSection
from pipeline.data import PromptLoader
from pipeline.dist import gather_floats, job_store, transfer
from pipeline.hooks import StepHook, hook_metrics
from pipeline.separated.placement import Placement
from pipeline.rollout.stage import ScoredRollouts, StepSampling, held_out_accuracy, roll_out
from pipeline.checkpoint.state import checkpoint_dir
from pipeline.rollout.schedule import GroupSplit
from pipeline.shares import generation_shares, shard_shares
from pipeline.separated.shipment import pack_shipments, send_shipments
from pipeline.rollout.report import RolloutReport
from pipeline.tasks import Problem
from pipeline.tasks.reward_scoring import Rewards
from pipeline.trainer import StepResult
from pipeline.separated.weight_sync import receive_weights


class SeparatedRollout:
    def __init__(self, trainer_cfg: TrainerSection, rollout_cfg: RolloutSection, task_cfg: TaskSection, placement: Placement,
                 engine: RolloutBackend, tokenizer, rewards: Rewards, loader: PromptLoader, eval_problems: list[Problem],
                 sampling: StepSampling, run_dir: Path, start_step: int, *, scope: str, idle_work: IdleWork | None = None,
                 hooks: Sequence[StepHook] = ()) -> None:
        """`idle_work`: what the tail's idle window runs (None: a barrier over the rollout ranks);
        `hooks`: the run's optional parts (pipeline.hooks), the idle work's among them; `scope`: the
        run's keys in the job's store (pipeline.dist.run_scope)."""
        assert placement.role == "rollout" and placement.rollouts is not None and loader.world_size == 1
        self.idle_work, self.hooks = idle_work, list(hooks)
        self.tc, self.task_cfg, self.p, self.r = trainer_cfg, task_cfg, placement, placement.rollouts
        self.engine, self.tok = engine, tokenizer
        self.rewards = rewards  # the run's (pipeline.tasks.reward_scoring.build_rewards), released by whoever built them
        self.loader, self.eval_problems, self.sampling = loader, eval_problems, sampling
        self.run_dir = Path(run_dir)
        self.start_step = self.step_index = start_step
        P, R = trainer_cfg.prompts_per_step, self.r.world
        part = GroupSplit.of(rollout_cfg, R, self.r.rank)
        # the groups this rank generates, and which of each group's samples
        self.groups = list(range(P)) if part.split else generation_shares(P, R)[self.r.rank]
        self.samples = part.samples
        self.actor_shares = shard_shares(P, len(placement.actor_ranks))
        group = self.r.group
        self.windows = IdleWindows(job_store(placement.job), self.r.rank, self.r.world, f"{scope}/rollout",
                                   barrier=lambda: dist.barrier(group=group))
        self.generated: dict[int, ScoredRollouts] = {}  # by step: generated and sent, its step not yet ended
        self.idle_metrics: dict[str, float] = {}  # the idle windows' of the step (async: and of the next step's)

    @property
    def first(self) -> bool:
        return self.p.job.rank == self.p.first_rollout

    def expected_version(self, step: int) -> int:
        """The policy version step `step`'s rollouts are made with."""
        if self.tc.async_steps:
            return max(step - 1, self.start_step)
        return step

    def receive_policy(self, version: int) -> dict[str, float]:
        """Waits for the push of `version` and serves it, through the hooks' `weights` (refusing any
        other version)."""
        def load(stream: NamedTensors, v: int) -> None:
            for hook in self.hooks:
                stream = hook.weights(stream)
            self.engine.load_weights(stream, version=v)

        with transfer(f"receiving policy version {version} from actor rank 0"):
            return receive_weights(load, version, src=self.p.push_source, group=self.p.push_group)

    def _generate_and_send(self, step: int) -> None:
        want = self.expected_version(step)
        if self.engine.version != want:
            raise ValueError(f"rollout rank {self.p.job.rank}: step {step + 1} must be rolled out with policy version "
                             f"{want}, the engine serves version {self.engine.version}; refusing a stale policy")
        problems = self.loader.next_step()  # the global step (this loader is not sharded)
        for hook in self.hooks:
            hook.begin(step)
        mine = [problems[g] for g in self.groups]

        def prepare(requests):
            for hook in self.hooks:
                requests = hook.requests(step, requests)
            return requests

        t = time.perf_counter()
        scored = roll_out(self.engine, self.tok, mine, self.sampling(step), len(self.samples), self.task_cfg.chat,
                          self.rewards, first_sample=self.samples.start, prepare=prepare)
        rollout_s = time.perf_counter() - t
        for hook in self.hooks:
            hook.rolled_out(step, scored)
        with transfer("waiting for the other rollout ranks"):
            idle_s, metrics = self.windows.run(step, self.idle_work)
        self.idle_metrics.update(metrics)
        for hook in self.hooks:  # every rollout rank is done: a gather over them makes none wait
            hook.collect(step, scored)
        report = RolloutReport.of(scored, rollout_s, idle_s, self.rewards.take_stats())
        with transfer(f"sending step {step + 1}'s rollouts to the actor ranks"):
            send_shipments(pack_shipments(scored, self.groups, self.actor_shares, step, self.p.job.rank, report),
                           self.p.actor_ranks)
        self.generated[step] = scored

    def step(self) -> StepResult:
        step = self.step_index
        if step not in self.generated:  # synchronous, or the first step of an asynchronous run
            self._generate_and_send(step)
        if self.tc.async_steps:
            self._generate_and_send(step + 1)  # with the policy before this step's update, while the actors train
        t = time.perf_counter()
        for hook in self.hooks:  # through the actor's update, until actor rank 0 announces the push
            hook.updating(step + self.tc.async_steps, step + 1)
        worked_s = time.perf_counter() - t  # idle time too: the push had not begun (with what the work had in flight then)
        m = self.receive_policy(step + 1)
        for hook in self.hooks:
            hook.end(step)
        scored = self.generated.pop(step)
        metrics = self.idle_metrics | hook_metrics(self.hooks, scored, lambda mine: gather_floats(self.r, mine))
        self._send([worked_s + m["sync/wait_s"], m["timing/sync"], metrics], "sending the wait for the push")
        self.idle_metrics = {}
        self.step_index = step + 1
        return StepResult(metrics={}, lengths=[], rollouts=None, decode_steps=scored.batch.steps)

    def evaluate(self) -> None:
        """The first rollout rank sends actor rank 0 the held-out greedy accuracy of the served policy."""
        if self.first:
            acc = held_out_accuracy(self.engine, self.tok, self.eval_problems, self.task_cfg, self.sampling, self.rewards)
            self._send(acc, "sending the held-out accuracy")

    def save(self) -> None:
        """The first rollout rank sends actor rank 0 each hook's state for the checkpoint's components
        (the speculation policy's, the history store's, equal on every rollout rank, the idle work's);
        it writes the hooks' files into the checkpoint first, so they are there when actor rank 0
        completes it."""
        if self.first:
            for hook in self.hooks:
                for name, write in hook.checkpoint_files().items():
                    write(checkpoint_dir(self.run_dir, self.step_index) / name)
            self._send({hook.name: hook.state_dict() for hook in self.hooks if hook.name},
                       "sending the engine's state for a checkpoint")

    def _send(self, obj, what: str) -> None:
        with transfer(f"{what} to actor rank 0"):
            dist.send_object_list([obj], dst=self.p.push_source)
