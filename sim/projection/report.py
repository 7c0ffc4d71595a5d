"""A scenario's report: the projection table, the sweeps, and their PNGs, as Markdown.

The accept-length sweep and the timeline use the scenario's largest device count; the trend
checks (draft depth against verification cost, tail weight, the analytic ceiling, split groups
against how alike a prompt's samples are) are optional
because they simulate many more steps.
"""

from __future__ import annotations

from pathlib import Path

from sim.config import Scenario
from sim.projection.plots import plot_accept, plot_depth, plot_scaling, plot_split, plot_tail, plot_timeline
from sim.projection.project import markdown_table, project, step_lengths
from sim.model.parts import Techniques
from sim.model.step import simulate_step
from sim.projection.sweeps import SplitPoint, SweepPoint, accept_sweep, ceiling_limit, depth_sweep, prompt_share_sweep, tail_sweep

TIMELINE = Techniques(spec=True, spot=True, bubble=True)
DEPTH_BATCHES = [1, 16, 64, 256]


def _sweep_table(points: list[SweepPoint], x_name: str, ceiling: bool = True) -> str:
    head = f"| {x_name} | rollout speedup | step speedup |" + (" step ceiling |" if ceiling else "")
    rule = "|---|---|---|" + ("---|" if ceiling else "")
    rows = [f"| {p.x:g} | {p.rollout_speedup:.2f}x | {p.step_speedup:.2f}x |" + (f" {p.ceiling:.2f}x |" if ceiling else "")
            for p in points]
    return "\n".join([head, rule, *rows])


def _split_table(points: list[SplitPoint]) -> str:
    rows = [f"| {p.prompt_share:g} | {p.split_rollout:.2f}x | {p.split_step:.2f}x | {p.spec_spot_step:.2f}x "
            f"| {p.spec_spot_split_step:.2f}x |" for p in points]
    return "\n".join(["| prompt share | split: rollout | split: step | spec+spot: step | spec+spot+split: step |",
                      "|---|---|---|---|---|", *rows])


def scenario_report(scn: Scenario, out: Path | None = None, checks: bool = False) -> str:
    """Markdown for the scenario; PNGs into `out` (named after the scenario) when given."""
    ref = max(scn.cluster.devices)
    rows = project(scn)
    accept = accept_sweep(scn, ref, scn.sweep.accept_lens)
    parts = [f"### {scn.name}", "", markdown_table(rows), "",
             f"Accept-length sweep at {ref} devices (speculation only):", "", _sweep_table(accept, "accept length")]
    if out is not None:
        plot_scaling(rows, out / f"{scn.name}_scaling.png", f"{scn.name}: speedup against device count")
        plot_accept(accept, out / f"{scn.name}_accept.png", f"{scn.name}, {ref} devices: speedup against accept length")
        step = simulate_step(scn, step_lengths(scn, ref)[0], ref, TIMELINE)
        plot_timeline(step, out / f"{scn.name}_timeline.png",
                      f"{scn.name}, {ref} devices, spec + spot + bubble: one step per rollout group")
    if checks:
        depth = depth_sweep(scn, scn.sweep.depths, DEPTH_BATCHES, scn.sweep.chain_accept_rate)
        small = min(scn.cluster.devices)
        tail = tail_sweep(scn, small, scn.sweep.tail_sigmas)
        limit = ceiling_limit(scn, ref, scn.sweep.accept_lens)
        parts += ["", f"Chain depth k (acceptance {scn.sweep.chain_accept_rate} per token), always on, one group:"]
        for batch, points in depth.items():
            best = max(points, key=lambda p: p.rollout_speedup)
            parts.append(f"- batch {batch}: " + ", ".join(f"k={p.x:g} {p.rollout_speedup:.2f}x" for p in points)
                         + f" (best k = {best.x:g})")
        parts += ["", f"Tail weight at {small} devices (speculation only):", "", _sweep_table(tail, "sigma", False),
                  "", "Analytic limit (every pass the same cost, drafting free, prefill one pass):", "",
                  _sweep_table(limit, "accept length")]
        split = prompt_share_sweep(scn, ref, scn.sweep.prompt_shares)
        parts += ["", f"Split groups at {ref} devices against the share of log-length variance between prompts "
                  "(speedups over the baseline):", "", _split_table(split)]
        if out is not None:
            plot_split(split, out / f"{scn.name}_split.png",
                       f"{scn.name}, {ref} devices: split groups")
        if out is not None:
            plot_depth(depth, out / f"{scn.name}_depth.png", f"{scn.name}: chain depth against batch (verify cost)")
            plot_tail(tail, out / f"{scn.name}_tail.png", f"{scn.name}, {small} devices: speedup against tail weight")
    return "\n".join(parts) + "\n"
