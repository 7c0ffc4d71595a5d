"""Projection: each technique alone and combined, at every device count of a scenario.

Every technique sees the same response lengths (common random numbers: the lengths of step s
at N devices come from `numpy.random.default_rng([seed, N, s])`), so a speedup compares the
same work. A row averages `scenario.steps` steps. Speedups are against the baseline (no
speculation, no bubble filling, synchronous, a prompt's samples together) on the same devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.config import Scenario
from sim.model.latency import LatencyModel, build_latency
from sim.model.lengths import draw_lengths, read_lengths_by_prompt, read_rollout_lengths
from sim.model.parts import StepResult, Techniques
from sim.model.step import simulate_step

COMBOS: dict[str, Techniques] = {
    "baseline": Techniques(),
    "spec": Techniques(spec=True),
    "spec+spot": Techniques(spec=True, spot=True),
    "bubble": Techniques(bubble=True),
    "one_step_async": Techniques(one_step_async=True),
    "all": Techniques(spec=True, spot=True, bubble=True, one_step_async=True),
}
# Rows added where a prompt's samples are alike (`lengths_alike`): split groups have nothing to
# balance when every response is drawn alone.
SPLIT_COMBOS: dict[str, Techniques] = {
    "split": Techniques(split=True),
    "spec+spot+split": Techniques(spec=True, spot=True, split=True),
}


def lengths_alike(scn: Scenario) -> bool:
    """Whether a prompt's samples are drawn alike (lognormal prompt_share > 0, or an empirical
    file's whole groups), so that dealing them apart changes the rollout."""
    spec = scn.rollout.lengths
    return scn.rollout.samples_per_prompt > 1 and (spec.prompt_share > 0 or spec.by_prompt)


def default_combos(scn: Scenario) -> dict[str, Techniques]:
    return {**COMBOS, **SPLIT_COMBOS} if lengths_alike(scn) else COMBOS


@dataclass(frozen=True)
class Projection:
    devices: int
    combo: str
    rollout_s: float
    step_s: float
    idle_share: float  # mean over groups and steps of the share of the step spent waiting
    rollout_speedup: float
    step_speedup: float
    coverage: float  # share of responses verified against a pre-generated draft
    accept_gain: float  # spot training's factor on accepted draft tokens


def step_lengths(scn: Scenario, devices: int) -> list[np.ndarray]:
    """The response lengths of each simulated step at this device count."""
    spec, ro = scn.rollout.lengths, scn.rollout
    empirical = None
    if spec.kind == "empirical":
        empirical = (read_lengths_by_prompt(spec.path, ro.samples_per_prompt) if spec.by_prompt
                     else read_rollout_lengths(spec.path))
    return [draw_lengths(spec, ro.prompts, ro.samples_per_prompt, np.random.default_rng([scn.seed, devices, s]),
                         empirical) for s in range(scn.steps)]


def simulate_steps(scn: Scenario, devices: int, tech: Techniques,
                   latency: LatencyModel | None = None) -> list[StepResult]:
    latency = latency or build_latency(scn)
    return [simulate_step(scn, lengths, devices, tech, latency) for lengths in step_lengths(scn, devices)]


def project(scn: Scenario, combos: dict[str, Techniques] | None = None,
            devices: list[int] | None = None) -> list[Projection]:
    """Each technique combination (default: `default_combos`) at each device count."""
    combos = default_combos(scn) if combos is None else combos
    latency = build_latency(scn)
    rows = []
    for n in devices or scn.cluster.devices:
        results = {name: simulate_steps(scn, n, tech, latency) for name, tech in combos.items()}
        base = results.get("baseline") or simulate_steps(scn, n, Techniques(), latency)
        base_roll = np.mean([r.rollout_s for r in base])
        base_step = np.mean([r.step_s for r in base])
        for name, steps in results.items():
            roll, step = np.mean([r.rollout_s for r in steps]), np.mean([r.step_s for r in steps])
            rows.append(Projection(
                devices=n, combo=name, rollout_s=float(roll), step_s=float(step),
                idle_share=float(np.mean([r.idle_share.mean() for r in steps])),
                rollout_speedup=float(base_roll / roll), step_speedup=float(base_step / step),
                coverage=float(np.mean([r.used.coverage for r in steps])),
                accept_gain=float(np.mean([r.used.accept_gain for r in steps]))))
    return rows


def markdown_table(rows: list[Projection]) -> str:
    head = ("| devices | techniques | rollout s | step s | idle share | rollout speedup | step speedup "
            "| bubble coverage | spot gain |\n|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {r.devices} | {r.combo} | {r.rollout_s:.1f} | {r.step_s:.1f} | {r.idle_share:.1%} "
             f"| {r.rollout_speedup:.2f}x | {r.step_speedup:.2f}x | {r.coverage:.0%} | {r.accept_gain:.2f} |"
             for r in rows]
    return "\n".join([head, *lines])
