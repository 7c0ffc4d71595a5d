"""RolloutSchedule: where and in what order a step's rollouts are generated, and which rank trains which.

Chosen once from the config (`rollout.work_stealing`, `rollout.split_groups`, `rollout.long_first`,
`trainer.train_shares`):

- *generation*: each rank rolls out its loader shard (static); or ranks take the step's units
  (a prompt's n samples) as their rows free up, their own planned units first, then the others'
  not yet taken (pipeline.rollout.stealing, through the job's store); or every rank generates its part of
  every group (split groups: rank r of w takes samples r*n/w .. (r+1)*n/w - 1 of each prompt, Seer's
  divided rollout), so the step's longest group runs on every rank at once and the ranks finish
  together, at the cost of every rank prefilling every prompt. With `long_first` a rank's own
  requests, or the plan (a token-balanced deal, each list longest first), follow the predicted
  lengths (pipeline.rollout.lengths: a prompt's history, else the running mean).
- *training share*: which rows each rank trains (pipeline.shares: its loader shard's groups, or a
  token-balanced share of each mini-batch's rows, its mini-batches in turn, holding the whole
  groups of those rows for their advantages), a function of the whole step's batch only. Where rows were generated
  elsewhere than they are trained, `share` exchanges them (all_gather_object over the process
  group) after the idle window: every rank then holds its share (whole groups in global order,
  with the rows it trains, its mini-batches in turn), the same rows,
  bits and order whichever rank generated them, so stealing or split groups on or off is the same
  run. Split groups are joined there, their samples in order.

`generate` returns this rank's generated rollouts (what the idle work's feature sink saw);
`share`, called after the idle window (the exchange is a collective), the rollouts it trains on
and the step's scheduling metrics: `rollout/units_stolen` (units generated off their loader
shard's rank), `rollout/length_pred_corr` (Pearson's r of predicted and actual group lengths,
where predictions differ), `rollout/idle_to_last_start` (idle share of the ranks' seconds from
their rollout's start until the step's last unit was taken).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.backend import RolloutBackend
from engine.sampling import SamplingParams
from engine.types import Request, RolloutBatch
from pipeline.dist import Ranks
from pipeline.rollout.lengths import LengthPredictor, correlation, long_first
from pipeline.rollout.stage import ScoredRollouts, requests_for, score
from pipeline.shares import row_shares, shard_shares, split_samples, update_tokens
from pipeline.rollout.stealing import StealingSource, UnitQueue, default_inflight, plan_units
from pipeline.tasks import Problem
from pipeline.tasks.reward_scoring import Rewards


@dataclass(frozen=True)
class GroupSplit:
    """Which samples of a step's groups a rank generates: with rollout.split_groups over w > 1 ranks,
    its part of every group (rank r: samples r*n/w .. (r+1)*n/w - 1, Seer's divided rollout);
    otherwise all n samples of the groups it takes. Colocated ranks, a separated run's rollout
    ranks and bubble pre-generation all read it from here."""

    split: bool
    samples: range

    @classmethod
    def of(cls, rollout_cfg, world: int, rank: int) -> GroupSplit:
        split = rollout_cfg.split_groups and world > 1
        return cls(split, split_samples(rollout_cfg.n, world, rank) if split else range(rollout_cfg.n))

    def next_requests(self, loader, tokenizer, chat: bool) -> list[Request]:
        """This rank's requests of the loader's next step, without advancing it: its part of every
        group, or whole groups of its shard."""
        problems = loader.global_step() if self.split else loader.peek()
        return requests_for(tokenizer, problems, len(self.samples), chat, first_sample=self.samples.start)


@dataclass
class _Plan:
    """One step's schedule: its global problems, their predicted lengths, this rank's source."""

    problems: list[Problem]  # the global step, in global order
    predicted: list[float] | None  # per problem (long_first)
    source: StealingSource | None = None
    started: float = field(default_factory=time.time)
    ended: float = 0.0


class RolloutSchedule:
    def __init__(self, rollout_cfg, train_shares: str, ranks: Ranks, store, scope: str, mini_batches: int = 1,
                 equal_rewards_free: bool = False) -> None:
        """`equal_rewards_free`: the update leaves out a group whose rewards are all equal (advantage 0:
        pipeline.update.learner), so token shares weigh such a group 0 and balance the tokens it trains on."""
        self.r, self.store, self.scope = ranks, store, scope
        self.equal_rewards_free = equal_rewards_free
        self.stealing, self.n = rollout_cfg.work_stealing and ranks.world > 1, rollout_cfg.n
        self.inflight = rollout_cfg.steal_inflight
        part = GroupSplit.of(rollout_cfg, ranks.world, ranks.rank)
        self.split, self.samples = part.split, part.samples
        self.train_shares, self.mini_batches = train_shares, mini_batches
        self.exchanges = self.stealing or self.split or train_shares == "tokens"
        self.lengths = LengthPredictor() if rollout_cfg.long_first else None
        self.plan: _Plan | None = None

    def generate(self, step: int, engine: RolloutBackend, tokenizer, loader, params: SamplingParams, chat: bool,
                 rewards: Rewards, prepare: Callable[[list[Request]], list[Request]] = list) -> ScoredRollouts:
        """This rank's rollouts of the step (its shard, or the units it took), scored once each by
        `rewards`; advances the loader. `prepare`: this call's requests -> the requests the engine
        takes (the step hooks attach drafts and predicted lengths: pipeline.hooks), never another
        token."""
        problems = loader.global_step()
        mine = loader.next_step()
        predicted = [self.lengths.predict(p.id) for p in problems] if self.lengths is not None else None
        self.plan = plan = _Plan(problems, predicted)
        if self.stealing:
            plans = plan_units(predicted or [1.0] * len(problems), self.n, self.r.world)
            requests = prepare(requests_for(tokenizer, problems, self.n, chat))
            queue = UnitQueue(self.store, f"{self.scope}/steal/{step}", plans, self.r.rank)
            plan.source = StealingSource(queue, requests, self._inflight(len(problems)))
            batch = engine.generate([], params, source=plan.source)
            taken = [problems[i] for i in plan.source.taken]
            local = score(tokenizer, taken, [requests[i].prompt for i in plan.source.taken],
                          _grouped(batch, taken, range(self.n)), self.n, rewards, step)
        elif self.split:
            part = len(self.samples)
            requests = prepare(requests_for(tokenizer, problems, part, chat, first_sample=self.samples.start))
            local = score(tokenizer, problems, [r.prompt for r in requests],
                          self._generate(engine, requests, params, problems, predicted, self.samples), part, rewards, step)
        else:
            requests = prepare(requests_for(tokenizer, mine, self.n, chat))
            mine_predicted = [self.lengths.predict(p.id) for p in mine] if self.lengths is not None else None
            local = score(tokenizer, mine, [r.prompt for r in requests],
                          self._generate(engine, requests, params, mine, mine_predicted, range(self.n)), self.n, rewards,
                          step)
        plan.ended = time.time()
        return local

    @staticmethod
    def _generate(engine: RolloutBackend, requests, params: SamplingParams, problems: list[Problem],
                  predicted: list[float] | None, samples: range) -> RolloutBatch:
        """The requests' rollouts in the problems' order, then sample order; with predicted lengths
        (long_first) admitted longest first."""
        if predicted is None:
            return engine.generate(requests, params)
        order = long_first(predicted)
        return _grouped(engine.generate([requests[i] for i in order], params), problems, samples)

    def _inflight(self, groups: int) -> int:
        """Rows a rank keeps active while units remain: rollout.steal_inflight, or default_inflight's."""
        return self.inflight or default_inflight(groups, self.n, self.r.world)

    def share(self, local: ScoredRollouts) -> tuple[ScoredRollouts, dict[str, float]]:
        """The rollouts this rank trains on (whole groups in global order; with token shares, the rows
        it trains in `train_rows`, its mini-batches in turn), and the step's scheduling metrics."""
        plan = self.plan
        assert plan is not None, "share() follows generate()"
        index = {p.id: i for i, p in enumerate(plan.problems)}
        if not self.exchanges:
            if self.lengths is None:
                return local, {}
            by_group: dict[int, list[int]] = {}
            for part in self._all([(index[ro.prompt_id], len(ro.tokens)) for ro in local.batch.rollouts]):
                for i, length in part:
                    by_group.setdefault(i, []).append(length)
            return local, self._observe(by_group)
        mine = [(index[p.id], self.r.rank, *_unit(local, j)) for j, p in enumerate(local.problems)]
        parts = self._all((mine, (plan.started, plan.source.last_at if plan.source else None, plan.ended)))
        units = join_groups([row for rows, _ in parts for row in rows], self.n)
        G, world = len(plan.problems), self.r.world
        train_rows = mini_batch_rows = None  # where the deal split groups over the ranks (row_shares)
        if self.train_shares == "tokens":
            lengths = [[len(ro.tokens) for ro in units[g][2]] for g in range(G)]
            weights = [lengths[g] if update_tokens(lengths[g], units[g][3], self.equal_rewards_free) else [0] * self.n
                       for g in range(G)]
            cells = row_shares(weights, world, self.mini_batches)[self.r.rank]
            chosen = sorted({g for cell in cells for g, _ in cell})  # the whole groups of this rank's rows
            at = {g: j * self.n for j, g in enumerate(chosen)}
            train_rows = [at[g] + s for cell in cells for g, s in cell]
            mini_batch_rows = [len(cell) for cell in cells]
        else:
            chosen = shard_shares(G, world)[self.r.rank]
        batch = RolloutBatch(rollouts=[ro for g in chosen for ro in units[g][2]], steps=local.batch.steps,
                             prefill_s=local.batch.prefill_s, wall_s=local.batch.wall_s,
                             policy_version=local.batch.policy_version, counters=local.batch.counters)
        scored = ScoredRollouts(problems=[plan.problems[g] for g in chosen], prompts=[units[g][1] for g in chosen],
                                batch=batch, rewards=torch.tensor([x for g in chosen for x in units[g][3]]), n=self.n,
                                generated_on=[k for g in chosen for k in units[g][4]], train_rows=train_rows,
                                mini_batch_rows=mini_batch_rows)
        home = {g: k for k, s in enumerate(shard_shares(G, world)) for g in s}
        metrics = {} if self.split else {"rollout/units_stolen": float(sum(home[g] != units[g][0] for g in range(G)))}
        if self.stealing:
            metrics["rollout/idle_to_last_start"] = idle_to_last_start([t for _, t in parts])
        return scored, metrics | self._observe({g: [len(ro.tokens) for ro in units[g][2]] for g in range(G)})

    def _all(self, mine):
        """Every rank's `mine`, by rank (all_gather_object; alone: [mine])."""
        if self.r.world == 1:
            return [mine]
        every = [None] * self.r.world
        dist.all_gather_object(every, mine)
        return every

    def _observe(self, lengths: dict[int, list[int]]) -> dict[str, float]:
        """The step's lengths (by global group) into the predictor, the same on every rank; the
        correlation of the step's predictions with them."""
        plan = self.plan
        if self.lengths is None:
            return {}
        actual = []
        for g, p in enumerate(plan.problems):
            self.lengths.observe(p.id, lengths[g])
            actual.append(sum(lengths[g]) / len(lengths[g]))
        r = correlation(plan.predicted, actual)
        return {} if r is None else {"rollout/length_pred_corr": r}

    def state_dict(self) -> dict:
        return self.lengths.state_dict() if self.lengths is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.lengths is not None and state:
            self.lengths.load_state_dict(state)


def idle_to_last_start(times: list[tuple[float, float | None, float]]) -> float:
    """The idle share of the ranks' seconds from each one's rollout start until the step's last unit
    was taken (on any rank): a rank is busy until its rollout ended."""
    last = max(t for _, t, _ in times if t is not None)
    span = sum(max(0.0, last - start) for start, _, _ in times)
    busy = sum(max(0.0, min(end, last) - start) for start, _, end in times)
    return 1.0 - busy / span if span > 0 else 0.0


def join_groups(rows, n: int) -> dict[int, tuple]:
    """Group index -> (the rank that generated it, its prompt, its n rollouts in sample order, their
    rewards, the rank that generated each) from every rank's (group, rank, prompt, rollouts,
    rewards); the parts of a split group are joined (its rank: the one with sample 0)."""
    parts: dict[int, list[tuple]] = {}
    for i, rank, prompt, rollouts, rewards in rows:
        parts.setdefault(i, []).extend((ro.sample, ro, reward, rank, prompt) for ro, reward in zip(rollouts, rewards))
    units = {}
    for i, samples in parts.items():
        samples.sort(key=lambda x: x[0])
        if [x[0] for x in samples] != list(range(n)):
            raise RuntimeError(f"group {i} came back with samples {[x[0] for x in samples]}, not 0..{n - 1}: a rank "
                               "generated a part of it twice or not at all")
        units[i] = (samples[0][3], samples[0][4], [x[1] for x in samples], [x[2] for x in samples],
                    [x[3] for x in samples])
    return units


def _unit(scored: ScoredRollouts, j: int) -> tuple:
    """Group j of `scored`: (its prompt, its n rollouts, their rewards as floats)."""
    n = scored.n
    return scored.prompts[j], scored.batch.rollouts[j * n:(j + 1) * n], scored.rewards[j * n:(j + 1) * n].tolist()


def _grouped(batch: RolloutBatch, problems: list[Problem], samples: range) -> RolloutBatch:
    """The batch with its rollouts in `problems`' order, then sample order (generate returns them in admission order)."""
    by_key = {(ro.prompt_id, ro.sample): ro for ro in batch.rollouts}
    rollouts = [by_key[(p.id, k)] for p in problems for k in samples]
    return RolloutBatch(rollouts=rollouts, steps=batch.steps, prefill_s=batch.prefill_s, wall_s=batch.wall_s,
                        policy_version=batch.policy_version, counters=batch.counters)
