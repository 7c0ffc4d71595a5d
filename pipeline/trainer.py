"""The RL loop: orchestration only; every stage lives in its own module.

One step on every rank (colocated: each rank rolls out, then trains):

    prompts (pipeline.data: this rank's shard of the step)
    -> rollouts (pipeline.rollouts: the engine, noise keyed by run seed, RL step, prompt, sample)
    -> idle window (common.idle: wait for the slowest rank, or pre-generate / train the drafter)
    -> history (pipeline.history: every rank's responses into the history drafter's store)
    -> rewards -> advantages (pipeline.algorithms; DAPO's dynamic sampling refills the batch)
    -> old (and reference) log-probs (the actor)
    -> PPO epochs over mini-batches (the actor's update with the algorithm's loss)
    -> weight sync (engine.load_weights(actor.named_weights(), version=step))
    -> metrics -> eval every N steps -> checkpoint every N steps.

The engine is a rollout backend (engine.backend.RolloutBackend: native or vLLM) and the loop
reads what it can do from its capabilities: where its log-probs are not exactly the served
policy's (vLLM's numerics, bf16 weight copies) the old log-probs are the actor's and
`train/mismatch_kl` measures the gap; where it returns no hidden states, spot training's
DataBuffer is filled from that same actor forward (`actor_features`, spot.actor_features). The
backend sleeps from the rollouts' end to the weight sync while the colocated actor works (a no-op
for the native engine). The parts are built and connected by launch.run.build_run.

Loss weights are normalised over the whole data-parallel mini-batch (all ranks), as the actor
backends expect. Synchronous by default; `trainer.async_steps: 1` rolls out step t+1 with the
policy before step t's update (one step off-policy) and corrects with a truncated importance
weight min(pi_old / pi_behaviour, is_cap) on each token's advantage.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from common.idle import IdleWindows, IdleWork
from common.text import stop_tokens
from engine.backend import RolloutBackend
from engine.sampling import SamplingParams
from engine.types import RolloutBatch
from pipeline.algorithms import build_algorithm, fill_groups, informative_groups, mismatch_kl
from pipeline.data import PromptLoader
from pipeline.dist import Ranks, all_sum, gather_floats, job_store
from pipeline.records import TrainBatch
from pipeline.rollouts import ScoredRollouts, StepSampling, roll_out
from pipeline.run_state import RunState, checkpoint_dir, save_run
from pipeline.tasks import Problem, Task
from pipeline.train_batch import pack_rollouts


_RUNS = itertools.count()  # runs made in this process: part of their idle windows' store scope


@dataclass
class StepResult:
    metrics: dict[str, float]
    lengths: list[int]  # this step's response lengths (all ranks)
    rollouts: ScoredRollouts  # this rank's


class Trainer:
    def __init__(self, cfg, ranks: Ranks, engine: RolloutBackend, actor, tokenizer, task: Task, loader: PromptLoader,
                 eval_problems: list[Problem], run_dir, idle_work: IdleWork | None = None, start_step: int = 0,
                 reference=None, bubbles=None, actor_features=None, sampling: StepSampling | None = None,
                 windows: IdleWindows | None = None, history=None) -> None:
        self.cfg, self.r, self.engine, self.actor, self.tok, self.task = cfg, ranks, engine, actor, tokenizer, task
        self.loader, self.eval_problems, self.run_dir, self.idle_work = loader, eval_problems, run_dir, idle_work
        # Store keys of this run's idle windows: the same on every rank (they make their runs in the
        # same order), distinct from an earlier run of this job (common.idle.window).
        self.windows = windows or IdleWindows(job_store(ranks), ranks.rank, ranks.world,
                                              f"tailspec/{Path(run_dir).name}/{next(_RUNS)}", barrier=self._barrier)
        self.reference = reference  # a ReferencePolicy when algorithm.kl_coef > 0
        self.bubbles = bubbles  # a pipeline.bubble.BubbleStore: drafts pre-generated for the coming steps
        self.bubble_metrics: dict[str, float] = {}
        self.history = history  # a pipeline.history.RunHistory: the history drafter's store, kept across steps
        self.actor_features = actor_features  # a spot.actor_features.ActorFeatures: the buffer from the actor's forward
        if cfg.algorithm.kl_coef > 0 and reference is None:
            raise ValueError("algorithm.kl_coef > 0 needs a reference policy (pipeline.reference.ReferencePolicy)")
        self.algo = build_algorithm(cfg.algorithm, cfg.rollout.max_new_tokens)
        self.step_index = start_step
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.stops = stop_tokens(engine.model_config, tokenizer)
        self.sampling = sampling or StepSampling.of(cfg.rollout, cfg.run.seed, self.stops)
        self.reward = training_reward(cfg.task, task)
        self.pending: ScoredRollouts | None = None  # async mode: the next step's rollouts, made before this update
        tc = cfg.trainer
        if tc.old_logprobs == "engine" and not self.sampling.is_policy:
            raise ValueError("trainer.old_logprobs=engine needs rollout.temperature=1, top_p=1, top_k=0 (the engine's "
                             "log-probs are those of the sampling distribution); use actor or auto")
        self.engine_old_logprobs = tc.old_logprobs == "engine" or (
            tc.old_logprobs == "auto" and self.sampling.is_policy and not tc.async_steps and engine.caps.exact_logprobs)
        if actor_features is not None and self.engine_old_logprobs:
            raise ValueError("spot training from the actor's forward needs trainer.old_logprobs=actor or auto (the "
                             "engine's log-probs would skip the forward that fills the DataBuffer)")

    def _barrier(self) -> None:
        if self.r.world > 1:
            dist.barrier()

    # -- one RL step -----------------------------------------------------------------------
    def _roll_out(self, step: int) -> ScoredRollouts:
        drafts = self.bubbles.take(step) if self.bubbles is not None else None
        problems = self.loader.next_step()
        predicted = self.history.predicted([p.id for p in problems]) if self.history is not None else None
        scored = roll_out(self.engine, self.tok, self.task, problems, self.sampling(step), self.cfg.rollout.n,
                          self.cfg.task.chat, self.reward, drafts=drafts, predicted=predicted)
        if drafts is not None:
            from pipeline.bubble import coverage_metrics, draft_metrics

            self.bubble_metrics = coverage_metrics(drafts, scored.batch.rollouts) | draft_metrics(scored.batch.steps)
        if self.idle_work is not None:
            self.idle_work.rollouts_done(step, scored.batch)
        return scored

    def step(self) -> StepResult:
        t_step = time.perf_counter()
        step = self.step_index
        t = time.perf_counter()
        if self.idle_work is not None:
            self.idle_work.begin(step)
        if self.cfg.trainer.async_steps and self.pending is not None:
            scored = self.pending  # made with the policy before the last update
        else:
            scored = self._fill(step)
        rollout_s = time.perf_counter() - t
        idle_s, idle_metrics = self.windows.run(step, self.idle_work)
        if self.history is not None:  # every rank is done: gathering the responses makes no rank wait
            self.history.remember(scored.batch.rollouts)
        if self.cfg.trainer.async_steps:
            self.pending = self._fill(step + 1)  # with this policy, before this step's update
        batch, metrics = self._train_batch(scored)
        self.engine.sleep()
        t = time.perf_counter()
        if self.engine_old_logprobs:
            batch.old_logprobs = batch.engine_logprobs.clone()
        else:
            metrics.update(self._actor_old_logprobs(batch, scored, step))
        if self.reference is not None:
            batch.ref_logprobs = self.reference.logprobs(batch.input_ids, batch.attention_mask) * batch.response_mask
        logprob_s = time.perf_counter() - t
        if self.cfg.trainer.async_steps:
            ratio = (batch.old_logprobs - batch.engine_logprobs).clamp(max=20).exp().clamp(max=self.cfg.trainer.is_cap)
            batch.advantages = batch.advantages * torch.where(batch.response_mask.bool(), ratio, 0)
        t = time.perf_counter()
        metrics.update(self._update(batch))
        update_s = time.perf_counter() - t
        t = time.perf_counter()
        self.engine.wake_up()
        self.sync(version=step + 1)
        if self.idle_work is not None:  # work of the idle window that went on during the update (spot's average; timed in timing/sync)
            idle_metrics.update(self.idle_work.settle())
        sync_s = time.perf_counter() - t
        self.step_index = step + 1
        metrics.update(self._step_metrics(scored, rollout_s, idle_s, logprob_s, update_s, sync_s, time.perf_counter() - t_step))
        metrics.update(idle_metrics)
        # The version the step's rollouts were made with, and the one the engine serves after the sync.
        metrics["rollout/policy_version"] = float(scored.batch.policy_version)
        metrics["engine/version"] = float(self.engine.version)
        metrics.update(self._mean_over_ranks(self.bubble_metrics))
        metrics.update(scored.fill_metrics)
        if self.history is not None:
            metrics.update(self.history.metrics(scored.batch.steps))
        if self.engine.policy is not None:
            metrics.update(self.engine.policy.metrics())
        lengths = [int(x) for row in gather_floats(self.r, [float(x) for x in scored.lengths.tolist()]) for x in row]
        return StepResult(metrics=metrics, lengths=lengths, rollouts=scored)

    def _actor_old_logprobs(self, batch: TrainBatch, scored: ScoredRollouts, step: int) -> dict[str, float]:
        """The actor's recomputed old log-probs into `batch`; the same forward's hidden states fill the
        DataBuffer when spot training reads them from the actor (entries of step t, trained on from
        step t + 1's idle window: spot.actor_features)."""
        kw = self.actor_features.logprobs_kwargs if self.actor_features is not None else {}
        out = self.actor.logprobs(batch.input_ids, batch.attention_mask, **kw)
        batch.old_logprobs = out.logprobs.cpu() * batch.response_mask
        metrics = mismatch_kl(batch.engine_logprobs, batch.old_logprobs, batch.response_mask)[1]
        if self.actor_features is not None:
            put = self.actor_features.put(scored.batch.rollouts, _row_prompts(scored), batch.input_ids, out, step)
            metrics["spot/entries_put"] = all_sum(self.r, float(put))  # over all ranks
        return metrics

    def sync(self, version: int) -> None:
        """The actor's weights into the engine, served as `version`; the spot drafter's HeadTarget (if
        any) copies the embedding and LM head as they go by."""
        named = self.actor.named_weights()
        if self.actor_features is not None and self.actor_features.head is not None:
            named = self.actor_features.head.follow(named)
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

    def _train_batch(self, scored: ScoredRollouts) -> tuple[TrainBatch, dict[str, float]]:
        n = scored.n
        rewards, metrics = self.algo.shape_rewards(scored.rewards, scored.lengths)
        adv, m = self.algo.advantages(rewards.view(-1, n), None)
        metrics.update(m)
        batch = pack_rollouts(_row_prompts(scored), [r.tokens for r in scored.batch], [r.logprobs for r in scored.batch],
                              adv.reshape(-1), self.pad_id)
        return batch, metrics

    def _update(self, batch: TrainBatch) -> dict[str, float]:
        tc = self.cfg.trainer
        rows = torch.arange(batch.size)
        sums: dict[str, float] = {}
        count = 0
        first: dict[str, float] = {}
        for epoch in range(tc.ppo_epochs):
            for chunk in rows.chunk(tc.mini_batches):
                mb = batch.select(chunk)
                mb.loss_weights = self._global_weights(mb.response_mask)
                measure = self.engine_old_logprobs and count == 0

                def loss_fn(lp, ent, micro, measure=measure):
                    loss, m = self.algo.loss(lp, micro, ent)
                    if measure:  # before any update: the actor's log-probs against the engine's
                        m.update(mismatch_kl(micro.engine_logprobs, lp.detach(), micro.response_mask)[1])
                    return loss, m

                m = self.actor.update(mb, loss_fn)
                for k in [k for k in m if k.startswith("train/mismatch")]:
                    first[k] = m.pop(k)
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        return {k: v / count for k, v in sums.items()} | first

    def _mean_over_ranks(self, m: dict[str, float]) -> dict[str, float]:
        """Means over ranks of per-rank metrics (every rank has the same keys, or none)."""
        if self.bubbles is None:
            return {}
        keys = ["bubble/coverage", "bubble/token_coverage", "bubble/prefix_match", "bubble/accept_len", "bubble/decode_steps_saved"]
        rows = gather_floats(self.r, [m.get(k, float("nan")) for k in keys])
        out = {}
        for i, k in enumerate(keys):
            vals = [row[i] for row in rows if row[i] == row[i]]
            if vals:
                out[k] = sum(vals) if k == "bubble/decode_steps_saved" else sum(vals) / len(vals)  # saved: over all ranks
        return out

    def _global_weights(self, mask: torch.Tensor) -> torch.Tensor:
        """The algorithm's aggregation weights for this rank's rows, rescaled so that they are
        normalised over the mini-batch of all ranks (token counts for token-mean, rows otherwise)."""
        local = self.algo.loss_weights(mask)
        count = float(mask.sum()) if self.algo.aggregation == "token-mean" else float(mask.shape[0])
        total = all_sum(self.r, count)
        return local * (count / total) if total > 0 else local

    def _step_metrics(self, scored: ScoredRollouts, rollout_s, idle_s, logprob_s, update_s, sync_s, step_s) -> dict[str, float]:
        stats = scored.batch.stats
        per_rank = gather_floats(self.r, [rollout_s, idle_s, float(stats.new_tokens), float(scored.rewards.sum()),
                                          float(scored.rewards.numel()), stats.accept_len, float(stats.speculative_steps),
                                          float(stats.accepted), float(stats.drafted), stats.prefill_s])
        m = {"step": float(self.step_index), "timing/step": step_s, "timing/logprob": logprob_s, "timing/update": update_s,
             "timing/sync": sync_s, "world_size": float(self.r.world)}
        tokens = sum(row[2] for row in per_rank)
        rollout_max = max(row[0] for row in per_rank)
        for rank, row in enumerate(per_rank):
            m[f"timing/rollout/rank{rank}"], m[f"timing/idle/rank{rank}"] = row[0], row[1]
            m[f"timing/prefill/rank{rank}"] = row[9]  # the prompts' prefill within the rollout (sim.calibrate)
        # Means over ranks: rollout + idle is the time until every rank was done (with idle work: plus what
        # this rank's work had in flight then; common.idle), about the same on every rank.
        m["timing/rollout"] = sum(row[0] for row in per_rank) / len(per_rank)
        m["timing/rollout_max"] = rollout_max
        m["timing/idle"] = sum(row[1] for row in per_rank) / len(per_rank)
        m["reward/mean"] = sum(row[3] for row in per_rank) / max(sum(row[4] for row in per_rank), 1)
        m["reward/std"] = float(scored.rewards.std()) if scored.rewards.numel() > 1 else 0.0
        m["rollout/tokens_per_s"] = tokens / rollout_max if rollout_max > 0 else 0.0
        m["rollout/batch_size"] = sum(row[4] for row in per_rank)
        drafted, accepted = sum(row[8] for row in per_rank), sum(row[7] for row in per_rank)
        if drafted > 0:
            spec = [row for row in per_rank if row[6] > 0]
            m["spec/accept_len"] = sum(row[5] * row[6] for row in spec) / sum(row[6] for row in spec)
            m["spec/accept_rate"] = accepted / drafted
        return m

    # -- eval and checkpoints --------------------------------------------------------------
    def evaluate(self) -> float | None:
        """Greedy held-out accuracy through the engine (rank 0; the others wait)."""
        acc = None
        if self.r.main:
            r = self.cfg.rollout
            params = SamplingParams(max_new_tokens=self.cfg.task.eval_max_new_tokens or r.max_new_tokens, temperature=0.0,
                                    stop_token_ids=self.stops)
            sink, self.engine.sink = self.engine.sink, None  # held-out rollouts are not training data for anyone
            try:
                scored = roll_out(self.engine, self.tok, self.task, self.eval_problems, params, 1, self.cfg.task.chat)
            finally:
                self.engine.sink = sink
            acc = float(scored.rewards.mean())
        return acc

    def save(self) -> None:
        components = {}
        if self.engine.policy is not None:  # a learning policy (the tuner) resumes where it was
            components["spec_policy"] = self.engine.policy.state_dict()
        if self.history is not None:  # equal on every rank (RunHistory.remember): rank 0's is saved
            components["history"] = self.history.state_dict()
        extras = {}
        if self.idle_work is not None:  # spot training: its trainer's folder and state
            components["idle_work"] = self.idle_work.state_dict()
            extras = self.idle_work.checkpoint_files()
        state = RunState(step=self.step_index, loader=self.loader.state_dict(), engine_version=self.engine.version,
                         components=components)
        drafter = next(iter(self.engine.drafter_nets()), None)
        if drafter is None and self.idle_work is not None:  # a drafter served out of process (vLLM): the spot trainer's copy
            drafter = self.idle_work.drafter()
        save_run(checkpoint_dir(self.run_dir, self.step_index), state, self.actor, drafter, main=self.r.main, extras=extras)


def training_reward(task_cfg, task: Task):
    """The task's correctness reward, plus `task.format_weight` for a \\boxed{} answer (math-verify tasks)."""
    if task_cfg.format_weight == 0:
        return task.reward
    if task.name != "math" and not task_cfg.file:
        raise ValueError(f"task.format_weight needs a math-verify task (task.name=math or task.file), not {task.name!r}")
    from pipeline.tasks.rewards import MathVerifyReward

    scorer = MathVerifyReward(format_weight=task_cfg.format_weight)
    return lambda text, answer: scorer(text, answer)[0]


def _row_prompts(scored: ScoredRollouts) -> list[list[int]]:
    """The prompt of each rollout (row) of the batch: rollouts come n per prompt."""
    return [scored.prompts[i // scored.n] for i in range(len(scored.batch))]


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
