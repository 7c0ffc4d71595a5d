"""PNG plots of projections, sweeps and one step's per-group timeline (matplotlib, Agg backend).

Every function takes records from `sim.projection.project` / `sim.projection.sweeps` / `sim.model.parts` and a path, and
writes one small PNG atomically. Nothing here simulates.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from common.atomic import atomic_write  # noqa: E402
from sim.projection.project import Projection  # noqa: E402
from sim.model.parts import StepResult  # noqa: E402
from sim.projection.sweeps import SplitPoint, SweepPoint  # noqa: E402

if TYPE_CHECKING:
    from sim.placement import PlacementRow

DPI = 80
COLORS = {"prefill": "#999999", "off": "#4c72b0", "spec": "#55a868", "bubble": "#dd8452",
          "pregen": "#f2c09a", "spot": "#8172b2", "idle": "#ffffff",
          "logprob": "#c44e52", "update": "#937860", "sync": "#222222"}


def _save(fig, path: str | Path) -> None:
    path = Path(path)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=DPI, format="png"))
    plt.close(fig)


def _finish(fig, ax, path: str | Path, title: str, xlabel: str, ylabel: str, unit_line: bool = False) -> None:
    """Labels, grid, legend and title of a single-axes line plot, then the PNG."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if unit_line:
        ax.axhline(1.0, color="#bbbbbb", lw=0.8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    _save(fig, path)


def plot_scaling(rows: list[Projection], path: str | Path, title: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharex=True)
    for combo in dict.fromkeys(r.combo for r in rows):
        if combo == "baseline":
            continue
        pts = [r for r in rows if r.combo == combo]
        x = [r.devices for r in pts]
        axes[0].plot(x, [r.rollout_speedup for r in pts], marker="o", label=combo)
        axes[1].plot(x, [r.step_speedup for r in pts], marker="o", label=combo)
    for ax, what in zip(axes, ("rollout", "step")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        ax.set_ylabel(f"{what} speedup (x)")
        ax.axhline(1.0, color="#bbbbbb", lw=0.8)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    _save(fig, path)


def plot_accept(points: list[SweepPoint], path: str | Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    x = [p.x for p in points]
    ax.plot(x, [p.rollout_speedup for p in points], marker="o", label="rollout (simulated)")
    ax.plot(x, [p.step_speedup for p in points], marker="o", label="step (simulated)")
    ax.plot(x, [p.ceiling for p in points], ls="--", color="k", label="step ceiling 1/(R/a+1-R)")
    _finish(fig, ax, path, title, "accept length (tokens per verify pass)", "speedup (x)")


def plot_depth(sweep: dict[int, list[SweepPoint]], path: str | Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for batch, points in sweep.items():
        ax.plot([p.x for p in points], [p.rollout_speedup for p in points], marker="o", label=f"batch {batch}")
    _finish(fig, ax, path, title, "chain draft depth k", "rollout speedup (x)", unit_line=True)


def plot_tail(points: list[SweepPoint], path: str | Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot([p.x for p in points], [p.rollout_speedup for p in points], marker="o", label="rollout")
    ax.plot([p.x for p in points], [p.step_speedup for p in points], marker="o", label="step")
    _finish(fig, ax, path, title, "lognormal sigma of response length (median fixed)", "speculation speedup (x)")


def plot_split(points: list[SplitPoint], path: str | Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    x = [p.prompt_share for p in points]
    ax.plot(x, [p.split_step for p in points], marker="o", label="split alone")
    ax.plot(x, [p.spec_spot_step for p in points], marker="o", label="spec+spot")
    ax.plot(x, [p.spec_spot_split_step for p in points], marker="o", label="spec+spot+split")
    _finish(fig, ax, path, title, "share of log-length variance between prompts", "step speedup over the baseline (x)",
            unit_line=True)


LAYOUT_STYLE = {"colocated": "-", "separated": "--", "separated+async": ":"}


def plot_placement(best: list[PlacementRow], at_ref: list[PlacementRow], path: str | Path, title: str) -> None:
    """Left: step speedup over the colocated baseline against devices, each layout at its best
    actor share. Right: at one device count, the separated layouts against their actor devices."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for layout, ls in LAYOUT_STYLE.items():
        for combo, marker in (("baseline", "s"), ("spec+spot", "o")):
            pts = sorted((r for r in best if r.layout == layout and r.combo == combo), key=lambda r: r.devices)
            axes[0].plot([r.devices for r in pts], [r.speedup for r in pts], ls=ls, marker=marker,
                         label=f"{layout}, {combo}")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("devices")
    axes[0].set_ylabel("step speedup over colocated baseline (x)")
    for layout in LAYOUT_STYLE:
        if layout == "colocated":
            continue
        for combo, marker in (("baseline", "s"), ("spec+spot", "o")):
            pts = sorted((r for r in at_ref if r.layout == layout and r.combo == combo), key=lambda r: r.actor_devices)
            axes[1].plot([r.actor_devices for r in pts], [r.speedup for r in pts], ls=LAYOUT_STYLE[layout],
                         marker=marker, label=f"{layout}, {combo}")
    for r in at_ref:
        if r.layout == "colocated":
            axes[1].axhline(r.speedup, color="#888888", lw=0.8, ls="-" if r.combo == "spec+spot" else "-.")
    ref = at_ref[0].devices if at_ref else 0
    axes[1].set_xlabel(f"actor devices (of {ref}; grey: colocated)")
    axes[1].set_ylabel("step speedup (x)")
    for ax in axes:
        ax.axhline(1.0, color="#bbbbbb", lw=0.8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    _save(fig, path)


def _kind_class(kind: str) -> str:
    if kind in ("prefill", "off"):
        return kind
    return "bubble" if kind == "bubble" else "spec"


def plot_timeline(result: StepResult, path: str | Path, title: str, max_groups: int = 16) -> None:
    """One bar per rollout group (slowest last): decode segments by kind, then the idle window
    split into pre-generation, spot training and plain idle, then the step's other phases. In the
    separated placement the log-prob and update phases run on the actor devices (the top bar)
    while the rollout groups' idle window goes on; the weight push ends the step on both."""
    order = sorted(range(len(result.groups)), key=lambda g: result.groups[g].time_s)
    if len(order) > max_groups:  # keep the fastest and the slowest groups
        order = order[: max_groups // 2] + order[-(max_groups - max_groups // 2):]
    separated = result.placement == "separated"
    fig, ax = plt.subplots(figsize=(9, 0.3 * (len(order) + separated) + 1.6))
    window_end = result.rollout_s + result.window_s
    for y, g in enumerate(order):
        bars: dict[str, list[tuple[float, float]]] = {}
        for s in result.groups[g].segments:
            bars.setdefault(_kind_class(s.kind), []).append((s.start_s, s.duration_s))
        t = result.groups[g].time_s
        pregen = result.fill.pregen_s[g] if len(result.fill.pregen_s) else 0.0
        spot = result.fill.spot_s[g] if len(result.fill.spot_s) else 0.0
        bars["pregen"] = [(t, pregen)]
        bars["spot"] = [(t + pregen, spot)]
        bars["idle"] = [(t + pregen + spot, window_end - t - pregen - spot)]
        if separated:
            bars["sync"] = [(window_end, result.sync_s)]
        elif not result.techniques.one_step_async:
            t0 = result.rollout_s
            bars["logprob"] = [(t0, result.logprob_s)]
            bars["update"] = [(t0 + result.logprob_s, result.update_s)]
            bars["sync"] = [(t0 + result.logprob_s + result.update_s, result.sync_s)]
        _draw_bars(ax, y, bars)
    labels = [f"group {g}" for g in order]
    if separated:
        t0 = 0.0 if result.techniques.one_step_async else result.rollout_s + result.transfer_s
        _draw_bars(ax, len(order), {"idle": [(0.0, t0)], "logprob": [(t0, result.logprob_s)],
                                    "update": [(t0 + result.logprob_s, result.update_s)],
                                    "sync": [(result.step_s - result.sync_s, result.sync_s)]})
        labels.append(f"{result.actor_devices} actor devices")
    ax.set_yticks(range(len(labels)), labels, fontsize=6)
    ax.set_xlabel("seconds into the step")
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="#cc0000" if n == "idle" else "none")
               for n, c in COLORS.items()]
    ax.legend(handles, list(COLORS), fontsize=6, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    ax.set_title(title, fontsize=9)
    _save(fig, path)


def _draw_bars(ax, y: int, bars: dict[str, list[tuple[float, float]]]) -> None:
    for name, spans in bars.items():
        spans = [sp for sp in spans if sp[1] > 0]
        if spans:
            ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=COLORS[name],
                           edgecolor="#cc0000" if name == "idle" else "none", linewidth=0.5)
