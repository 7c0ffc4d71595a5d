"""A run's rewards: rollouts' texts in, scores out, with the failures counted and bounded.

`build_rewards(task_cfg, task)` decides once where the rewards run: a named reward
(`task.reward`: math_verify, exact, a plug-in; pipeline.tasks.reward_plugins) in a pool of
`task.reward_workers` processes with a deadline of `task.reward_timeout_s` per call
(pipeline.tasks.reward_pool); the task's own reward (`task.reward: null`, the synthetic tasks'
`#### N` comparisons, the math task's math-verify with its own signal timeouts, which work here
because scoring runs in the rank's main thread) in this process, as does any reward with
`task.reward_workers: 0` (for one that cannot be pickled, or to debug one), without deadlines.

`Rewards.score` scores one batch of rows (a rank's rollouts of a step, or of one round of
dynamic sampling), each row once. A call that raises or runs past its deadline scores 0 and is
counted (`RewardStats`: `reward/errors`, `reward/timeouts` of the step, summed over ranks); the
run's first few failures are logged with the row's prompt id, sample and response. When more
than `task.max_reward_error_share` of a batch's calls fail, the batch is an error naming that
key and one failing row: a batch, not the run so far, so that a reward which breaks mid-run stops
it at once; each rank decides on its own batches. A score that is not a finite number (or
outside a built-in's bounds), or a result that is not a number or a dict with `score`, is a
ValueError naming the row: a broken reward stops the run rather than train on garbage.

`score_held_out` scores held-out rows with the held-out reward (no format bonus); its failures
score 0 and obey the same share, and are logged, not counted in the step's metrics.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.tasks.reward_plugins import RewardFunction, reward_functions
from pipeline.tasks.reward_pool import InProcessRunner, Outcome, RewardPool

LOGGED_FAILURES = 5  # failures logged in full per run and rank; later ones are only counted
RESERVED = frozenset({"score", "mean", "std", "errors", "timeouts"})  # reward/<key> the run logs itself

_TRAIN, _HELD_OUT = 0, 1  # the runner's functions


@dataclass(frozen=True)
class RewardRow:
    """One rollout to score and where it came from."""

    prompt_id: str
    sample: int
    prompt: str
    response: str
    answer: str
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class RewardStats:
    """A rank's reward calls over some batches: how many, how many failed, and the plug-in's metrics
    (summed over the calls that returned them, with their counts, for means over ranks)."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, other: RewardStats) -> None:
        self.calls += other.calls
        self.errors += other.errors
        self.timeouts += other.timeouts
        for k, v in other.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
            self.counts[k] = self.counts.get(k, 0) + other.counts[k]


def reward_metrics(stats: Iterable[RewardStats]) -> dict[str, float]:
    """`reward/errors` and `reward/timeouts` summed over ranks' stats, and each plug-in metric's mean
    over the calls that returned it, as `reward/<key>`."""
    total = RewardStats()
    for s in stats:
        total.add(s)
    m = {"reward/errors": float(total.errors), "reward/timeouts": float(total.timeouts)}
    m.update({f"reward/{k}": total.sums[k] / total.counts[k] for k in sorted(total.sums)})
    return m


class Rewards:
    """The training and held-out rewards of a run on one rank, run by `runner`
    (a RewardPool or an InProcessRunner over [train, held_out])."""

    def __init__(self, train: RewardFunction, held_out: RewardFunction, runner: RewardPool | InProcessRunner, *,
                 max_error_share: float, timeout_s: float | None, log: Callable[[str], None] | None = None) -> None:
        self.functions = (train, held_out)
        self.runner, self.max_error_share, self.timeout_s = runner, max_error_share, timeout_s
        self.log = log or logging.getLogger(__name__).warning
        self.stats = RewardStats()  # the calls since take_stats()
        self.failures_logged = 0

    def score(self, rows: Sequence[RewardRow], step: int) -> list[float]:
        """The training scores of `rows`, rollouts of RL step `step` (from 0)."""
        scores, stats = self._score(_TRAIN, rows, f"step {step + 1}")
        self.stats.add(stats)
        return scores

    def score_held_out(self, rows: Sequence[RewardRow]) -> list[float]:
        scores, stats = self._score(_HELD_OUT, rows, "the held-out evaluation")
        if stats.errors or stats.timeouts:
            self.log(f"held-out evaluation: {stats.errors} reward call(s) raised and {stats.timeouts} timed out, of "
                     f"{stats.calls}; each scored 0")
        return scores

    def summary(self) -> str:
        """One line for the run's log: which rewards, where they run."""
        train, held_out = self.functions
        where = (f"in {self.runner.workers} worker processes, at most {self.timeout_s} s a call"
                 if isinstance(self.runner, RewardPool) else "in this process")
        return (f"reward: {train.name} (held out: {'the same' if held_out is train else held_out.name}) {where}; a "
                f"step's failed calls may reach task.max_reward_error_share={self.max_error_share}")

    def take_stats(self) -> RewardStats:
        """The calls since the last take (a step's, by its driver), and a fresh count."""
        stats, self.stats = self.stats, RewardStats()
        return stats

    def close(self) -> None:
        self.runner.close()

    def _score(self, fn: int, rows: Sequence[RewardRow], where: str) -> tuple[list[float], RewardStats]:
        reward = self.functions[fn]
        outcomes = self.runner.run(fn, [(r.prompt, r.response, r.answer, dict(r.extra)) for r in rows])
        stats = RewardStats(calls=len(rows))
        scores, failed = [], []
        for row, outcome in zip(rows, outcomes):
            if outcome.failed:
                stats.timeouts += outcome.timed_out
                stats.errors += not outcome.timed_out
                failed.append((row, outcome))
                self._log_failure(reward, row, outcome, where)
                scores.append(0.0)
                continue
            score, metrics = read_result(reward, outcome.value, row)
            scores.append(score)
            for k, v in metrics.items():
                stats.sums[k] = stats.sums.get(k, 0.0) + v
                stats.counts[k] = stats.counts.get(k, 0) + 1
        if rows and len(failed) / len(rows) > self.max_error_share:
            raise ValueError(self._too_many(reward, failed, stats, where))
        return scores, stats

    def _what(self, outcome: Outcome) -> str:
        return f"ran past task.reward_timeout_s={self.timeout_s}" if outcome.timed_out else outcome.error

    def _log_failure(self, reward: RewardFunction, row: RewardRow, outcome: Outcome, where: str) -> None:
        self.failures_logged += 1
        if self.failures_logged > LOGGED_FAILURES:
            return
        self.log(f"reward {reward.name} failed at {where} on prompt {row.prompt_id!r} sample {row.sample} (scored 0): "
                 f"{self._what(outcome)}; the response begins {row.response[:160]!r}")
        if self.failures_logged == LOGGED_FAILURES:
            self.log("later reward failures are counted in reward/errors and reward/timeouts, not logged")

    def _too_many(self, reward: RewardFunction, failed: list, stats: RewardStats, where: str) -> str:
        row, outcome = next(((r, o) for r, o in failed if not o.timed_out), failed[0])  # an exception says most
        n = stats.calls
        return (f"reward {reward.name}: {len(failed)} of {n} calls failed at {where} on this rank ({stats.errors} raised, "
                f"{stats.timeouts} timed out), {len(failed) / n:.1%}, above task.max_reward_error_share="
                f"{self.max_error_share}; one failing row: prompt id {row.prompt_id!r} sample {row.sample}: "
                f"{self._what(outcome)}. Fix the reward (task.reward), or raise task.max_reward_error_share or "
                "task.reward_timeout_s")


def read_result(reward: RewardFunction, value: Any, row: RewardRow) -> tuple[float, dict[str, float]]:
    """(score, metrics) from what `reward` returned for `row`; ValueError naming the row if it is not a
    finite number (in the reward's bounds) or a dict with one and numeric metrics."""
    where = f"prompt {row.prompt_id!r} sample {row.sample}"
    metrics: dict[str, float] = {}
    score = value
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(f"{reward.name}: the dict returned for {where} has no 'score' (keys: {sorted(value)}); "
                             "return a number, or a dict of 'score' and numeric metrics")
        score = value["score"]
        for k, v in value.items():
            if k == "score":
                continue
            if k in RESERVED:
                raise ValueError(f"{reward.name}: metric {k!r} would be logged as reward/{k}, which the run logs itself; "
                                 "rename it")
            if not _finite(v):
                raise ValueError(f"{reward.name}: metric {k!r} of {where} is {v!r}; the entries besides 'score' must be "
                                 "finite numbers (their means are logged as reward/<key>)")
            metrics[str(k)] = float(v)
    if not _finite(score):
        raise ValueError(f"{reward.name}: reward {score!r} of {where} is not a finite number")
    if reward.bounds is not None and not reward.bounds[0] <= score <= reward.bounds[1]:
        raise ValueError(f"{reward.name}: reward {score!r} of {where} is outside its bounds {list(reward.bounds)}")
    return float(score), metrics


def _finite(v: Any) -> bool:
    return isinstance(v, numbers.Real) and math.isfinite(v)


def build_rewards(task_cfg, task, log: Callable[[str], None] | None = None) -> Rewards:
    """The run's rewards on this rank (task_cfg: the TaskSection; task: a pipeline.tasks.Task), their
    workers started if they run in a pool: close() them (the run's ExitStack does)."""
    train, held_out = reward_functions(task_cfg, task)
    if task_cfg.reward is not None and task_cfg.reward_workers > 0:
        runner: RewardPool | InProcessRunner = RewardPool([train, held_out], task_cfg.reward_workers,
                                                         task_cfg.reward_timeout_s)
        timeout = task_cfg.reward_timeout_s
    else:
        runner, timeout = InProcessRunner([train, held_out]), None
    return Rewards(train, held_out, runner, max_error_share=task_cfg.max_reward_error_share, timeout_s=timeout, log=log)
