"""summary.txt: a run's outcome in a few lines, read back from its metrics files.

Steps, first and last mean reward, best held-out accuracy, where the mean step's time went
(`timing/step` split into rollout / idle / log-prob / update / sync, the rest as "other"), mean
accept length, the idle share per rank, and how long-tailed the responses were (the median length,
and each step's longest response over its median: the tail a step waits for, 8x or more in
reasoning RL). A quantity the run never logged reads "n/a".

A speedup is stated only when it was measured: with a comparison against a reference run
(pipeline.metrics.comparison: given, or the run folder's comparison.json), a last line gives the
step ratio, the steps it is over and whether the two runs were identical; without one, the
summary says nothing about speed relative to anything.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from common.atomic import atomic_write
from pipeline.metrics.comparison import Comparison, read_comparison
from pipeline.metrics.history import TIME_SPLIT, RunHistory, load_history

SUMMARY_FILE = "summary.txt"


def summary_lines(history: RunHistory, comparison: Comparison | None = None) -> list[str]:
    steps = list(history.rows)
    lines = [f"steps: {len(steps)}" + (f" ({steps[0]}..{steps[-1]})" if steps else "")]
    reward_steps, rewards = history.series("reward/mean")
    lines.append("reward/mean: " + (f"first {rewards[0]:.4f} (step {reward_steps[0]}), last {rewards[-1]:.4f} "
                                    f"(step {reward_steps[-1]})" if rewards else "n/a"))
    eval_steps, accuracy = history.series("eval/accuracy")
    if accuracy:
        best = max(range(len(accuracy)), key=lambda i: accuracy[i])
        lines.append(f"eval/accuracy: best {accuracy[best]:.4f} (step {eval_steps[best]}), last {accuracy[-1]:.4f}")
    else:
        lines.append("eval/accuracy: n/a")
    lines.append("step time: " + _time_split(history))
    accept = history.mean("spec/accept_len")
    lines.append("spec/accept_len: " + (f"mean {accept:.2f}" if accept is not None else "n/a"))
    idle = history.share("timing/idle")
    rank_shares = [(r, history.share(f"timing/idle/rank{r}")) for r in history.ranks("timing/idle")]
    per_rank = ", ".join(f"rank {r} {share:.1%}" for r, share in rank_shares if share is not None)
    idle_text = f"{idle:.1%}" if idle is not None else "n/a"
    lines.append(f"idle share: {idle_text}" + (f" ({per_rank})" if per_rank else ""))
    lines.append("response length: " + _tail(history))
    if comparison is not None:
        lines.append(speedup_line(comparison))
    return lines


def speedup_line(c: Comparison) -> str:
    identical = {True: "yes", False: "no", None: "not checked"}[c.identical]
    steps = c.timed_steps
    return (f"measured speedup: {c.step_ratio:.2f}x vs {c.reference_run} (mean step time, reference / this run, "
            f"steps {steps[0]}..{steps[-1]}; identical runs: {identical})")


def _tail(history: RunHistory) -> str:
    steps = [lengths for lengths in history.lengths.values() if lengths]
    if not steps:
        return "n/a"
    ratios = sorted(max(lengths) / statistics.median(lengths) for lengths in steps)
    at_8x = sum(r >= 8 for r in ratios)
    return (f"median {statistics.median([n for lengths in steps for n in lengths]):.0f} tokens; a step's longest over "
            f"its median: least {ratios[0]:.1f}x, median {statistics.median(ratios):.1f}x, most {ratios[-1]:.1f}x "
            f"(>= 8x in {at_8x} of {len(ratios)} steps)")


def _time_split(history: RunHistory) -> str:
    step = history.mean("timing/step")
    if step is None:
        return "n/a"
    parts = [(name, history.mean(f"timing/{name}")) for name in TIME_SPLIT]
    parts = [(name, value) for name, value in parts if value is not None]
    other = step - sum(value for _, value in parts)
    text = f"mean {step:.2f} s = " + " + ".join(f"{name} {value:.2f}" for name, value in parts)
    return text + f" + other {other:.2f}" if parts else f"mean {step:.2f} s"


def write_summary(run_dir: str | Path, comparison: Comparison | None = None) -> Path:
    """Write <run_dir>/summary.txt from the run's metrics files and `comparison` (default: the
    folder's comparison.json, if any); returns its path."""
    path = Path(run_dir) / SUMMARY_FILE
    if comparison is None:
        comparison = read_comparison(run_dir)
    text = "\n".join([f"run: {Path(run_dir).name}", *summary_lines(load_history(run_dir), comparison)]) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text))
    return path
