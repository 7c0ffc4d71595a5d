"""dashboard.png: one figure of a run, drawn from its folder's files alone.

Panels: mean reward (with its std band) and held-out accuracy over steps; the response-length
percentiles (p50, p90, max) per step, on a log scale when the tail is ten times the median or
more; the response-length distribution of the first and last quarter of the steps; rollout
throughput; the step time split into rollout / idle / log-prob / update / sync / other; accept
length and rate; each rank's idle share; each rank's live resident memory (`mem/rss_gb/rank{r}`,
pipeline.metrics.live_memory) with its growth a step after the first fifth of the steps. A panel whose metrics the run did not log says so
instead. When the run is compared with a reference run (pipeline.metrics.comparison: given, or
the folder's comparison.json) a further panel shows the step-time ratio per step (reference /
this run) and its mean; without a comparison there is no such panel.

`python -m pipeline.metrics.dashboard runs/<run> [--compare runs/<reference>]` rebuilds the
dashboard and summary.txt. Drawn on matplotlib's Agg canvas directly (no pyplot, no global
backend switch).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter
from PIL import Image

from common.atomic import atomic_write
from pipeline.metrics.comparison import Comparison, compare_runs, read_comparison
from pipeline.metrics.history import TIME_SPLIT, RunHistory, load_history
from pipeline.metrics.lengths import PERCENTILES, length_metric
from pipeline.metrics.live_memory import MIN_FIT_STEPS, RSS_KEY, growth_per_step
from pipeline.metrics.summary import write_summary

DASHBOARD_FILE = "dashboard.png"
COLORS = {"rollout": "#4C72B0", "idle": "#C44E52", "logprob": "#8172B2", "update": "#55A868", "sync": "#CCB974",
          "other": "#B0B0B0"}


def _no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} logged", ha="center", va="center", transform=ax.transAxes, color="0.45")
    ax.set_xticks([])
    ax.set_yticks([])


def _reward(ax: Axes, h: RunHistory) -> None:
    ax.set_title("Reward and held-out accuracy")
    steps, mean = h.series("reward/mean")
    eval_steps, accuracy = h.series("eval/accuracy")
    if not steps and not eval_steps:
        return _no_data(ax, "reward/mean or eval/accuracy")
    handles = []
    if steps:
        handles += ax.plot(steps, mean, color="#4C72B0", label="reward/mean")
        std = dict(zip(*h.series("reward/std")))
        if std:
            band = [(s, m, std[s]) for s, m in zip(steps, mean) if s in std]
            ax.fill_between([s for s, _, _ in band], [m - d for _, m, d in band], [m + d for _, m, d in band],
                            color="#4C72B0", alpha=0.15, linewidth=0)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    if eval_steps:
        acc_ax = ax.twinx()
        handles += acc_ax.plot(eval_steps, accuracy, "o-", color="#DD8452", markersize=3, label="eval/accuracy")
        acc_ax.set_ylabel("held-out accuracy")
        acc_ax.set_ylim(0, 1)
    ax.legend(handles=handles, loc="lower right", fontsize=8)


LENGTH_LINES = [(f"p{q}", color) for q, color in zip(PERCENTILES, ("#4C72B0", "#DD8452"))] + [("max", "#C44E52")]
WIDE_SPREAD = 10  # max / p50 from which the length panel's y axis is logarithmic: the median stays readable


def _length_percentiles(ax: Axes, h: RunHistory) -> None:
    ax.set_title("Response length percentiles")
    lines = [(stat, color, *h.series(length_metric(stat))) for stat, color in LENGTH_LINES]
    lines = [line for line in lines if line[2]]
    if not lines:
        return _no_data(ax, f"{length_metric('p50')}, p90 or max")
    for stat, color, steps, values in lines:
        ax.plot(steps, values, color=color, label=stat, marker="o" if len(steps) == 1 else None)
    # The tail against the median: the lowest line (p50 when logged) against the highest (max).
    low, high = min((v for v in lines[0][3] if v > 0), default=0), max(lines[-1][3])
    if low and high / low >= WIDE_SPREAD:
        ax.set_yscale("log")
        for axis_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis_formatter(LogFormatter(labelOnlyBase=False))  # "300", not "3x10^2": lengths are read as counts
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel("step")
    ax.set_ylabel("response length (tokens)")
    ax.legend(loc="upper left", fontsize=8)


def _lengths(ax: Axes, h: RunHistory) -> None:
    ax.set_title("Response lengths")
    steps = list(h.lengths)
    if not steps:
        return _no_data(ax, "response lengths (lengths.jsonl)")
    quarter = max(1, len(steps) // 4)
    groups = [steps[:quarter]] if len(steps) <= quarter else [steps[:quarter], steps[-quarter:]]
    longest = max(max(h.lengths[s], default=0) for g in groups for s in g)
    bins = np.linspace(0, max(longest, 1), 31)  # shared, so the two quarters compare bar for bar
    for group, color in zip(groups, ("#4C72B0", "#DD8452")):
        values = [n for s in group for n in h.lengths[s]]
        label = f"step {group[0]}" if len(group) == 1 else f"steps {group[0]}-{group[-1]}"
        ax.hist(values, bins=bins, color=color, alpha=0.55, label=f"{label} (n={len(values)})")
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("rollouts")
    ax.legend(fontsize=8)


def _time_split(ax: Axes, h: RunHistory) -> None:
    ax.set_title("Step time split")
    rows = [(s, r) for s, r in h.rows.items() if "timing/step" in r]
    if not rows:
        return _no_data(ax, "timing/step")
    top = 1.3 * max(r["timing/step"] for _, r in rows)  # headroom for the legend
    rows = _chunk_means(rows, max_points=150)  # a long run's per-step noise hides the split
    steps = [s for s, _ in rows]
    layers = {name: [r.get(f"timing/{name}", 0.0) for _, r in rows] for name in TIME_SPLIT}
    layers = {name: values for name, values in layers.items() if any(values)}
    layers["other"] = [max(r["timing/step"] - sum(v[i] for v in layers.values()), 0.0) for i, (_, r) in enumerate(rows)]
    if len(steps) == 1:
        bottom = 0.0
        for name, values in layers.items():
            ax.bar(steps, values, bottom=bottom, color=COLORS[name], label=name, width=0.6)
            bottom += values[0]
    else:
        ax.stackplot(steps, *layers.values(), labels=list(layers), colors=[COLORS[n] for n in layers], alpha=0.85)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_ylim(0, top)
    ax.legend(loc="upper left", fontsize=8, ncol=3)


def _chunk_means(rows: list[tuple[int, dict]], max_points: int) -> list[tuple[float, dict]]:
    """At most max_points rows: consecutive steps averaged in equal chunks (at its mean step)."""
    size = -(-len(rows) // max_points)
    if size == 1:
        return rows
    out = []
    for start in range(0, len(rows), size):
        chunk = rows[start:start + size]
        names = {k for _, r in chunk for k in r if k.startswith("timing/")}
        out.append((sum(s for s, _ in chunk) / len(chunk),
                    {k: sum(r.get(k, 0.0) for _, r in chunk) / len(chunk) for k in names}))
    return out


def _speculation(ax: Axes, h: RunHistory) -> None:
    ax.set_title("Speculation")
    steps, accept_len = h.series("spec/accept_len")
    rate_steps, rate = h.series("spec/accept_rate")
    if not steps and not rate_steps:
        return _no_data(ax, "spec/accept_len or spec/accept_rate")
    handles = []
    if steps:
        handles += ax.plot(steps, accept_len, color="#55A868", label="accept length")
        ax.set_ylabel("accepted tokens per verify")
    ax.set_xlabel("step")
    if rate_steps:
        rate_ax = ax.twinx()
        handles += rate_ax.plot(rate_steps, rate, color="#8172B2", linestyle="--", label="accept rate")
        rate_ax.set_ylabel("accept rate")
        rate_ax.set_ylim(0, 1)
    ax.legend(handles=handles, loc="lower right", fontsize=8)


def _idle(ax: Axes, h: RunHistory) -> None:
    ax.set_title("Idle share per rank")
    shares = [(r, h.share(f"timing/idle/rank{r}")) for r in h.ranks("timing/idle")]
    shares = [(r, s) for r, s in shares if s is not None]
    if not shares:
        return _no_data(ax, "timing/idle/rank<r> with timing/step")
    ax.bar([str(r) for r, _ in shares], [s for _, s in shares], color=COLORS["idle"])
    overall = h.share("timing/idle")
    if overall is not None:
        ax.axhline(overall, color="0.3", linestyle=":", label=f"mean {overall:.1%}")
        ax.legend(fontsize=8)
    ax.set_xlabel("rank")
    ax.set_ylabel("share of step time waiting")
    ax.set_ylim(0, max(0.05, 1.2 * max(s for _, s in shares)))  # all-zero shares would autoscale to nothing
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")


def _throughput(ax: Axes, h: RunHistory) -> None:
    ax.set_title("Rollout throughput")
    steps, tps = h.series("rollout/tokens_per_s")
    if not steps:
        return _no_data(ax, "rollout/tokens_per_s")
    ax.plot(steps, tps, color="#4C72B0")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)


def _live_memory(ax: Axes, h: RunHistory) -> None:
    ax.set_title("Live memory per rank")
    ranks = h.ranks(RSS_KEY)
    if not ranks:
        return _no_data(ax, f"{RSS_KEY}/rank<r>")
    for rank in ranks:
        steps, gb = h.series(f"{RSS_KEY}/rank{rank}")
        warmup = steps[len(steps) // 5]  # the fit leaves out the first fifth: arenas and caches fill in
        fits = sum(s > warmup for s in steps) >= MIN_FIT_STEPS
        growth = f", {growth_per_step(steps, gb, warmup) * 1e3:+.2f} MB/step after step {warmup}" if fits else ""
        ax.plot(steps, gb, label=f"rank {rank}{growth}")
    ax.set_xlabel("step")
    ax.set_ylabel("resident GB")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8)


def _step_ratio(ax: Axes, c: Comparison) -> None:
    ax.set_title("Step-time ratio: reference / this run")
    ax.plot(c.steps, c.step_ratios, "o-", color="#55A868", markersize=3, label=f"vs {Path(c.reference_run).name}")
    steps = c.timed_steps
    ax.axhline(c.step_ratio, color="0.3", linestyle="--",
               label=f"mean step time, steps {steps[0]}..{steps[-1]}: {c.step_ratio:.2f}x")
    ax.axhline(1.0, color="0.6", linestyle=":", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("reference step time / this step time")
    ax.set_ylim(0, 1.3 * max(*c.step_ratios, 1.0))  # headroom for the legend; 1 (no speedup) always in view
    ax.legend(loc="upper left", fontsize=8)


PANELS = (_reward, _length_percentiles, _lengths, _throughput, _time_split, _speculation, _idle, _live_memory)
COMPARISON_AT = 5  # the step-ratio panel's place: beside the step time split


def dashboard_figure(history: RunHistory, title: str, comparison: Comparison | None = None) -> Figure:
    panels: list[tuple[Callable, RunHistory | Comparison]] = [(panel, history) for panel in PANELS]
    if comparison is not None:
        panels.insert(COMPARISON_AT, (_step_ratio, comparison))
    rows = -(-len(panels) // 4)
    fig = Figure(figsize=(20, 4.2 * rows), dpi=90, layout="constrained")
    trained = sum(1 for row in history.rows.values() if "timing/step" in row)  # step 0 holds the first eval only
    fig.suptitle(f"{title}: {trained} steps", fontsize=13)
    axes = list(fig.subplots(rows, 4).flat)
    for (panel, data), ax in zip(panels, axes):
        panel(ax, data)
        ax.grid(alpha=0.25)
    for ax in axes[len(panels):]:
        fig.delaxes(ax)
    return fig


def render_dashboard(run_dir: str | Path, comparison: Comparison | None = None) -> Path:
    """Draw <run_dir>/dashboard.png from the run's metrics files and `comparison` (default: the
    folder's comparison.json, if any); returns its path."""
    run_dir = Path(run_dir)
    if comparison is None:
        comparison = read_comparison(run_dir)
    fig = dashboard_figure(load_history(run_dir), run_dir.name, comparison)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    # A 256-colour palette keeps a long run's antialiased lines a fraction of the RGB file's size.
    image = Image.fromarray(np.asarray(canvas.buffer_rgba())[..., :3]).quantize(256)
    path = run_dir / DASHBOARD_FILE
    atomic_write(path, lambda tmp: image.save(tmp, format="PNG", optimize=True))
    return path


def write_report(run_dir: str | Path, reference_dir: str | Path | None = None) -> tuple[Path, Path]:
    """The dashboard and summary.txt of a run, compared with `reference_dir`'s run when given
    (else with the folder's comparison.json, if any); prints both paths."""
    comparison = compare_runs(run_dir, reference_dir) if reference_dir is not None else None
    dashboard, summary = render_dashboard(run_dir, comparison), write_summary(run_dir, comparison)
    print(f"dashboard: {dashboard}\nsummary: {summary}", flush=True)
    return dashboard, summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.metrics.dashboard",
                                description="Rebuild a run's dashboard.png and summary.txt from its folder.")
    p.add_argument("run_dir", help="the run folder (runs/<run>)")
    p.add_argument("--compare", metavar="REFERENCE_RUN_DIR", default=None,
                   help="a reference run (e.g. the same run with speculation off): adds the step-time ratio per "
                        "step and the measured speedup")
    args = p.parse_args(argv)
    try:
        write_report(args.run_dir, args.compare)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from e


if __name__ == "__main__":
    main()
