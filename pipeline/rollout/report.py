"""A step's rollout metrics from one report per generating rank, whichever placement made them.

A `RolloutReport` is what one rank's rollouts of a step were (its seconds generating and idle,
tokens, rewards, its reward calls, speculation counts); `rollout_metrics` turns the reports of every
generating rank, keyed by global rank, into the step's `timing/rollout*`, `timing/idle*`,
`reward/mean`, `reward/errors`, `reward/timeouts` and a reward's own `reward/<key>` metrics
(pipeline.tasks.reward_scoring), `rollout/*` and `spec/accept_*` metrics. Colocated ranks gather
theirs (pipeline.trainer); the rollout ranks of a separated placement send theirs with their
rollouts (pipeline.separated.shipment).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.tasks.reward_scoring import RewardStats, reward_metrics


@dataclass(frozen=True, kw_only=True)
class RolloutReport:
    rollout_s: float  # generating (and scoring) this rank's rollouts
    idle_s: float  # waiting for the others (colocated: the slowest rank; separated: also the actor's update)
    new_tokens: float
    reward_sum: float
    rollouts: float
    accept_len: float  # mean tokens per speculative row-step
    speculative_steps: float
    accepted: float
    drafted: float
    prefill_s: float  # the prompts' prefill within rollout_s
    rewards: RewardStats = field(default_factory=RewardStats)  # the reward calls this rank made

    @classmethod
    def of(cls, scored, rollout_s: float, idle_s: float, rewards: RewardStats) -> RolloutReport:
        """scored: a pipeline.rollout.stage.ScoredRollouts of this rank: its tokens and rewards are those of
        the rows it trains (`trained`: each row of the step on one rank), its speculation counts those
        of the passes it ran; `rewards`: the reward calls it made (wherever their rows are trained)."""
        stats = scored.batch.stats
        rows = scored.trained
        return cls(rollout_s=rollout_s, idle_s=idle_s, new_tokens=float(sum(len(scored.batch[i].tokens) for i in rows)),
                   reward_sum=float(scored.rewards[rows].sum()), rollouts=float(len(rows)),
                   accept_len=stats.accept_len, speculative_steps=float(stats.speculative_steps),
                   accepted=float(stats.accepted), drafted=float(stats.drafted), prefill_s=stats.prefill_s,
                   rewards=rewards)


def rollout_metrics(reports: dict[int, RolloutReport]) -> dict[str, float]:
    """The step's rollout metrics from every generating rank's report (global rank -> report)."""
    rows = list(reports.values())
    m: dict[str, float] = {}
    for rank, r in reports.items():
        m[f"timing/rollout/rank{rank}"], m[f"timing/idle/rank{rank}"] = r.rollout_s, r.idle_s
        m[f"timing/prefill/rank{rank}"] = r.prefill_s  # the prompts' prefill within the rollout (sim.calibrate)
    rollout_max = max(r.rollout_s for r in rows)
    tokens = sum(r.new_tokens for r in rows)
    # Means over ranks: rollout + idle is the time until every rank was done (with idle work: plus what
    # this rank's work had in flight then; common.idle), about the same on every rank.
    m["timing/rollout"] = sum(r.rollout_s for r in rows) / len(rows)
    m["timing/rollout_max"] = rollout_max
    m["timing/idle"] = sum(r.idle_s for r in rows) / len(rows)
    # Each rank's rollout against the slowest's: the share of the generation phase it was busy.
    for rank, r in reports.items():
        m[f"rollout/busy_share/rank{rank}"] = r.rollout_s / rollout_max if rollout_max > 0 else 1.0
    m["rollout/busy_share"] = m["timing/rollout"] / rollout_max if rollout_max > 0 else 1.0
    m["reward/mean"] = sum(r.reward_sum for r in rows) / max(sum(r.rollouts for r in rows), 1)
    m.update(reward_metrics(r.rewards for r in rows))
    m["rollout/tokens_per_s"] = tokens / rollout_max if rollout_max > 0 else 0.0
    m["rollout/batch_size"] = sum(r.rollouts for r in rows)
    drafted, accepted = sum(r.drafted for r in rows), sum(r.accepted for r in rows)
    if drafted > 0:
        spec = [r for r in rows if r.speculative_steps > 0]
        m["spec/accept_len"] = sum(r.accept_len * r.speculative_steps for r in spec) / sum(r.speculative_steps for r in spec)
        m["spec/accept_rate"] = accepted / drafted
    return m
