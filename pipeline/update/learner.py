"""The actor's half of an RL step, the same in every placement: scored rollouts in, one update out.

    rewards -> advantages over whole groups (pipeline.algorithms) -> a TrainBatch of the rows this
    rank trains (pipeline.update.train_batch)
    -> old log-probs (pipeline.update.old_logprobs: the engine's; the update's own forward, detached, for
       the rows it passes before any optimizer step, and one actor forward over the later
       mini-batches' rows; or one actor forward over every row) and reference log-probs
    -> the asynchronous mode's truncated importance weight on the advantages
    -> the step's learning rate (actor.lr_schedule, a function of the step alone)
    -> PPO epochs over mini-batches (the rows the schedule dealt this rank, else even chunks; the
       actor backend's update with the algorithm's loss; rows of advantage 0 left out when no KL
       term reaches them: trainer.skip_zero_advantage)

Its metrics are the step's, over every rank, each counted once: the reward and advantage metrics
over every group (owned_group_metrics), the update's (combine_update_metrics: losses summed, token
means weighted by each rank's tokens; `train/mismatch_kl`, engine against actor, over every row
from the separate pass, else over the first mini-batch's rows that reach the actor, from its
forward before the optimizer step), and `train/update_balance` (pipeline.shares.update_balance
over every rank's tokens in each mini-batch: 1 when no rank waits at a mini-batch's gradient
all-reduce). One gather each, per step.

`ranks` are the data-parallel ranks of the actor (the whole job when colocated, the actor group
when separated: pipeline.placement); loss weights are normalised over the mini-batch of all of
them, as the actor backends expect. The learner knows nothing of engines, prompts or where the
rollouts were made: the loop (pipeline.trainer, pipeline.separated.actor) hands it a rank's
`ScoredRollouts` and pushes the weights afterwards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pipeline.actors.base import ADDITIVE_METRICS, Actor, ActorConfig
from pipeline.algorithms import Algorithm, mismatch_kl
from pipeline.config import TrainerSection
from pipeline.dist import Ranks, all_sum, gather_objects
from pipeline.update.old_logprobs import UpdateLogprobs, old_logprobs_source
from pipeline.records import TrainBatch
from pipeline.update.reference import ReferencePolicy
from pipeline.rollout.stage import ScoredRollouts
from pipeline.shares import update_balance
from pipeline.update.train_batch import gradient_rows, pack_rollouts


def uses_engine_logprobs(trainer_cfg: TrainerSection, samples_policy: bool, exact_logprobs: bool) -> bool:
    """Whether the PPO ratio's old log-probs are the engine's own (trainer.old_logprobs: engine, or
    auto where they are exactly the old policy's: synchronous, sampling from the policy itself,
    a backend with exact log-probs)."""
    tc = trainer_cfg
    if tc.old_logprobs == "engine" and not samples_policy:
        raise ValueError("trainer.old_logprobs=engine needs rollout.temperature=1, top_p=1, top_k=0 (the engine's "
                         "log-probs are those of the sampling distribution); use actor or auto")
    return tc.old_logprobs == "engine" or (tc.old_logprobs == "auto" and samples_policy and not tc.async_steps
                                           and exact_logprobs)


class Learner:
    def __init__(self, trainer_cfg: TrainerSection, algo: Algorithm, actor_cfg: ActorConfig, ranks: Ranks, actor: Actor,
                 pad_id: int, engine_old_logprobs: bool, reference: ReferencePolicy | None = None,
                 actor_features=None) -> None:
        """`algo`: the run's (pipeline.algorithms.build_algorithm); `actor_cfg`: the actor's section, for
        its learning rate schedule; `actor_features`: a spot.buffer.actor_features.ActorFeatures when spot
        training fills its DataBuffer from the actor's old log-prob forward."""
        self.tc, self.algo, self.actor_cfg = trainer_cfg, algo, actor_cfg
        self.r, self.actor, self.pad_id = ranks, actor, pad_id
        self.engine_old_logprobs = engine_old_logprobs
        self.old_source = old_logprobs_source(trainer_cfg, engine_old_logprobs, actor_features is not None)
        self.reference = reference  # when algorithm.kl_coef > 0
        self.actor_features = actor_features
        if algo.kl_coef > 0 and reference is None:
            raise ValueError("algorithm.kl_coef > 0 needs a reference policy (pipeline.update.reference.ReferencePolicy)")
        if actor_features is not None and engine_old_logprobs:
            raise ValueError("spot training from the actor's forward needs trainer.old_logprobs=actor or auto (the "
                             "engine's log-probs would skip the forward that fills the DataBuffer)")
        # Rows of advantage 0 are left out of the forward and backward when they add no gradient.
        self.skip_inert = trainer_cfg.skip_zero_advantage and algo.zero_advantage_is_inert

    @property
    def skips_equal_reward_groups(self) -> bool:
        """Whether a group whose raw rewards are all equal never reaches the actor: its advantages are
        0 (GRPO, RLOO) unless the overlong penalty tells its lengths apart."""
        return self.skip_inert and self.algo.overlong_buffer == 0

    def train(self, scored: ScoredRollouts, step: int) -> tuple[dict[str, float], float, float]:
        """One update on this rank's rollouts of `step`; -> (metrics, seconds of log-probs, seconds of update)."""
        batch, metrics = self.train_batch(scored)
        cuts = mini_batch_cut(batch.size, scored.mini_batch_rows, self.tc.mini_batches)
        t = time.perf_counter()
        if self.old_source == "engine":
            batch.old_logprobs = batch.engine_logprobs.clone()
        elif self.old_source == "update":
            self._later_old_logprobs(batch, cuts[1:])
        else:
            metrics.update(self._actor_old_logprobs(batch, scored, step))
        if self.reference is not None:
            batch.ref_logprobs = self.reference.logprobs(batch.input_ids, batch.attention_mask) * batch.response_mask
        logprob_s = time.perf_counter() - t
        if self.tc.async_steps:
            ratio = (batch.old_logprobs - batch.engine_logprobs).clamp(max=20).exp().clamp(max=self.tc.is_cap)
            batch.advantages = batch.advantages * torch.where(batch.response_mask.bool(), ratio, 0)
        t = time.perf_counter()
        metrics["train/lr"] = self.lr_at(step)
        self.actor.set_lr(metrics["train/lr"])
        metrics.update(self._update(batch, cuts))
        return metrics, logprob_s, time.perf_counter() - t

    def lr_at(self, step: int) -> float:
        """The actor's learning rate in 0-based RL step `step` of this run (ActorConfig.lr_at)."""
        return self.actor_cfg.lr_at(step, self.tc.steps)

    def train_batch(self, scored: ScoredRollouts) -> tuple[TrainBatch, dict[str, float]]:
        """The rows this rank trains (`scored.trained`, in training order), with advantages computed
        over the whole groups `scored` holds, and the step's reward and advantage metrics."""
        n = scored.n
        rewards, _ = self.algo.shape_rewards(scored.rewards, scored.lengths)
        adv, _ = self.algo.advantages(rewards.view(-1, n), None)
        rows = scored.trained
        prompts = row_prompts(scored)
        batch = pack_rollouts([prompts[i] for i in rows], [scored.batch[i].tokens for i in rows],
                              [scored.batch[i].logprobs for i in rows], adv.reshape(-1)[rows], self.pad_id)
        return batch, self._group_metrics(scored)

    def _group_metrics(self, scored: ScoredRollouts) -> dict[str, float]:
        """The reward and advantage stages' train/* metrics over every group of the step, each once
        (`owned_group_metrics` on every rank, `combine_group_metrics` over them: one gather a step)."""
        return combine_group_metrics(gather_objects(self.r, owned_group_metrics(self.algo, scored)))

    def _actor_old_logprobs(self, batch: TrainBatch, scored: ScoredRollouts, step: int) -> dict[str, float]:
        """The actor's recomputed old log-probs into `batch`; the same forward's hidden states fill the
        DataBuffer when spot training reads them from the actor (entries of step t, trained on from
        step t + 1's idle window: spot.buffer.actor_features)."""
        kw = self.actor_features.logprobs_kwargs if self.actor_features is not None else {}
        out = self.actor.logprobs(batch.input_ids, batch.attention_mask, **kw)
        batch.old_logprobs = out.logprobs.cpu() * batch.response_mask
        metrics = mismatch_kl(batch.engine_logprobs, batch.old_logprobs, batch.response_mask)[1]
        if self.actor_features is not None:
            rows, prompts = scored.trained, row_prompts(scored)
            put = self.actor_features.put([scored.batch[i] for i in rows], [prompts[i] for i in rows], batch.input_ids,
                                          out, step)
            metrics["spot/entries_put"] = all_sum(self.r, float(put))  # over all ranks
        return metrics

    def _later_old_logprobs(self, batch: TrainBatch, later: list[torch.Tensor]) -> None:
        """The actor's recomputed old log-probs into `batch` for the rows of the `later` mini-batches
        that go through the actor (old_source update: the first mini-batch's come from its own
        forward, in `_update`); one forward, before any optimizer step."""
        rows = [chunk[self._through_actor(batch.select(chunk))] for chunk in later]
        rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        if len(rows) == 0:
            return
        out = self.actor.logprobs(batch.input_ids[rows], batch.attention_mask[rows])
        batch.old_logprobs[rows] = out.logprobs.cpu() * batch.response_mask[rows]

    def _through_actor(self, mb: TrainBatch) -> torch.Tensor:
        """The rows [k] of mini-batch `mb` that the update passes to the actor."""
        return gradient_rows(mb) if self.skip_inert else torch.arange(mb.size)

    def _update(self, batch: TrainBatch, mini_batches: list[torch.Tensor]) -> dict[str, float]:
        tc = self.tc
        sums: dict[str, float] = {}
        count = 0
        first: dict[str, float] = {}
        tokens = 0.0  # response tokens of the mini-batches
        loads: list[float] = []  # this rank's response tokens through the actor in each mini-batch
        for epoch in range(tc.ppo_epochs):
            for chunk in mini_batches:
                mb = batch.select(chunk)
                mb.loss_weights = self._global_weights(mb.response_mask)  # normalised over every row
                tokens += float(mb.response_mask.sum())
                rows = self._through_actor(mb)
                mb = mb.select(rows)
                loads.append(float(mb.response_mask.sum()))
                # Before any optimizer step the forward's own log-probs are the old policy's.
                on_policy = self.old_source == "update" and count == 0
                kept = UpdateLogprobs(mb) if on_policy and tc.ppo_epochs > 1 else None
                m = self.actor.update(mb, self._loss_fn(on_policy, kept, measure=self.old_source != "actor" and count == 0))
                if kept is not None:  # the same rows' old log-probs in the later epochs
                    assert kept.complete(), "a row of the first mini-batch never reached the loss"
                    batch.old_logprobs[chunk[rows]] = kept.logprobs
                for k in [k for k in m if k.startswith("train/mismatch")]:
                    first[k] = m.pop(k)
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        loads += [0.0] * (tc.ppo_epochs * tc.mini_batches - len(loads))  # the same length on every rank
        parts = gather_objects(self.r, UpdatePart(tokens, loads, {k: v / count for k, v in sums.items()}, first))
        total = sum(p.tokens for p in parts)
        through = sum(sum(p.loads) for p in parts)
        return combine_update_metrics(parts) | {
            "train/skipped_token_share": 1 - through / total if total else 0.0,
            "train/update_balance": update_balance([p.loads for p in parts]),
        }

    def _loss_fn(self, on_policy: bool, kept: UpdateLogprobs | None, measure: bool):
        """The algorithm's loss as the actor's LossFn. on_policy: the micro-batch's old log-probs are
        its own forward's, detached (the ratio is exactly 1), and `kept` keeps them; measure: the
        forward runs before any optimizer step, so train/mismatch_kl compares it with the engine's."""

        def loss_fn(lp, ent, micro):
            if on_policy:
                micro.old_logprobs = lp.detach() * micro.response_mask
                if kept is not None:
                    kept.put(micro, micro.old_logprobs)
            loss, m = self.algo.loss(lp, micro, ent)
            if measure:
                m.update(mismatch_kl(micro.engine_logprobs, lp.detach(), micro.response_mask)[1])
            return loss, m

        return loss_fn

    def _global_weights(self, mask: torch.Tensor) -> torch.Tensor:
        """The algorithm's aggregation weights for this rank's rows, rescaled so that they are
        normalised over the mini-batch of all ranks (token counts for token-mean, rows otherwise)."""
        local = self.algo.loss_weights(mask)
        count = float(mask.sum()) if self.algo.aggregation == "token-mean" else float(mask.shape[0])
        total = all_sum(self.r, count)
        return local * (count / total) if total > 0 else local


@dataclass
class UpdatePart:
    """One rank's part of a step's update, for the step's metrics: response tokens of its mini-batch
    rows, tokens through the actor in each mini-batch, the actor's metrics averaged over mini-batches,
    and the first mini-batch's (the engine-against-actor mismatch, measured before any step)."""

    tokens: float
    loads: list[float]
    metrics: dict[str, float]
    first: dict[str, float]


def combine_update_metrics(parts: list[UpdatePart]) -> dict[str, float]:
    """The step's update metrics from every rank's part: additive ones (ADDITIVE_METRICS) summed, the
    gradient norm as every rank computed it, the others (token means) weighted by each rank's
    tokens through the actor (the first mini-batch's by its tokens). Ranks without a trained token
    have no say; if none had one, a plain mean."""
    return _combine([p.metrics for p in parts], [sum(p.loads) for p in parts]) | _combine(
        [p.first for p in parts], [p.loads[0] if p.loads else 0.0 for p in parts])


def _combine(dicts: list[dict[str, float]], weights: list[float]) -> dict[str, float]:
    out = {}
    for k in sorted(set().union(*dicts)):
        have = [(d[k], w) for d, w in zip(dicts, weights) if k in d]
        values = [v for v, _ in have]
        total = sum(w for _, w in have)
        if k in ADDITIVE_METRICS:
            out[k] = sum(values)
        elif k == "train/grad_norm":
            out[k] = values[0]  # the same on every rank
        else:
            out[k] = sum(v * w for v, w in have) / total if total else sum(values) / len(values)
    return out


def owned_group_metrics(algo: Algorithm, scored: ScoredRollouts) -> tuple[int, dict[str, float]]:
    """(groups owned, the reward and advantage metrics over them) of this rank's part of a step.

    Ranks may hold the same group (under trainer.train_shares=tokens a rank holds the whole groups
    of the rows it trains), so a rank describes only the groups it *owns*: those whose lowest
    sample it trains, one rank each, as every row is trained on exactly one rank.
    """
    n, trained = scored.n, set(scored.trained)
    owned = [g for g in range(len(scored.batch) // n)
             if min(range(g * n, (g + 1) * n), key=lambda i: scored.batch[i].sample) in trained]
    if not owned:
        return 0, {}
    rows = torch.tensor([g * n + j for g in owned for j in range(n)])
    rewards, metrics = algo.shape_rewards(scored.rewards[rows], scored.lengths[rows])
    metrics.update(algo.advantages(rewards.view(-1, n), None)[1])
    return len(owned), metrics


def combine_group_metrics(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """The step's metrics from every rank's `owned_group_metrics`: each is a mean over its owned
    groups (or their rows, n a group), so the step's is their mean weighted by groups owned."""
    total = sum(count for count, _ in parts)
    keys = sorted({k for count, m in parts if count for k in m})
    return {k: sum(count * m[k] for count, m in parts if count) / total for k in keys}


def row_prompts(scored: ScoredRollouts) -> list[list[int]]:
    """The prompt of each rollout (row) of the batch: rollouts come n per prompt."""
    return [scored.prompts[i // scored.n] for i in range(len(scored.batch))]


def mini_batch_cut(rows: int, sizes: list[int] | None, mini_batches: int) -> list[torch.Tensor]:
    """A rank's rows of each mini-batch: `sizes` rows each, as the schedule dealt them (balanced over
    the ranks in each mini-batch: pipeline.shares.row_shares), else (None) `mini_batches` even
    chunks of the rows."""
    index = torch.arange(rows)
    if sizes is None:
        return list(index.chunk(mini_batches))
    if len(sizes) != mini_batches or sum(sizes) != rows:
        raise ValueError(f"the rollouts came as mini-batches of {sizes} rows ({rows} in all); the trainer takes "
                         f"trainer.mini_batches={mini_batches}")
    return list(index.split(sizes))
