"""Validation: calibrate on one measured run, predict another's step timings, report the error.

The prediction replays each step of the predicted run with its own requests (the response
lengths each rank generated, from its rollouts.jsonl), its own setup (world size, the engine's
largest batch, the speculation shape it ran and the largest batch it ran it at), and everything
else from the calibration: the latency model, accept lengths, prompt length and phase costs. So
the error measures the latency and acceptance model, not the length distribution. The error of
a quantity is the mean over steps of |predicted - measured| / measured.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np

from sim.config import Scenario, SpecSpec
from sim.events import simulate_group
from sim.latency import build_latency
from sim.runs import MeasuredRun
from sim.schedule import OFF, build_schedule
from sim.step import phase_times

TOLERANCE = 0.15


@dataclass(frozen=True)
class StepComparison:
    step: int
    measured_rollout_s: float
    predicted_rollout_s: float
    measured_step_s: float | None
    predicted_step_s: float
    measured_rank_s: tuple[float, ...]
    predicted_rank_s: tuple[float, ...]


@dataclass(frozen=True)
class ValidationReport:
    calibrated_on: str
    predicted: str
    steps: tuple[StepComparison, ...]

    def error(self, what: str) -> float:
        pairs = []
        for s in self.steps:
            if what == "rollout":
                pairs.append((s.predicted_rollout_s, s.measured_rollout_s))
            elif what == "step" and s.measured_step_s is not None:
                pairs.append((s.predicted_step_s, s.measured_step_s))
            elif what == "rank":
                pairs.extend(zip(s.predicted_rank_s, s.measured_rank_s))
        return float(np.mean([abs(p - m) / m for p, m in pairs if m > 0])) if pairs else float("nan")

    def passed(self, tolerance: float = TOLERANCE) -> bool:
        """Rollout error (always measured) and step error (where timing/step was) within tolerance."""
        rollout, step = self.error("rollout"), self.error("step")
        return rollout <= tolerance and (np.isnan(step) or step <= tolerance)


def predicted_spec(calibrated: Scenario, run: MeasuredRun) -> SpecSpec | None:
    """The speculation the predicted run ran, with the calibration's accept lengths."""
    shapes = defaultdict(int)
    for s in run.decode_steps:
        if s.shape != "off":
            shapes[s.shape] += 1
    if not shapes:
        return None
    shape = max(shapes, key=shapes.get)
    known = {a.name for a in calibrated.spec.arms}
    if shape not in known:
        raise ValueError(f"{run.name} ran shape {shape!r}, which the calibration run never ran, so its accept "
                         f"length is unknown (calibrated shapes: {', '.join(sorted(known)) or 'none'})")
    threshold = max(s.batch_size for s in run.decode_steps if s.shape == shape)
    return replace(calibrated.spec, schedule="threshold", arm=shape, threshold=threshold)


def validate(calibrated: Scenario, run: MeasuredRun, calibrated_on: str = "") -> ValidationReport:
    latency = build_latency(calibrated)
    spec = predicted_spec(calibrated, run)
    schedule = build_schedule(spec) if spec is not None else OFF
    max_batch = max((s.batch_size for s in run.decode_steps), default=calibrated.cluster.max_batch)
    by_rank: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r in run.rollouts:
        by_rank[r.step][r.rank].append(r.length)
    out = []
    for m in run.metrics:
        step = m.get("step")
        if "timing/rollout" not in m or step not in by_rank:
            continue
        world = int(m.get("world_size", max(by_rank[step]) + 1))
        ranks = [np.asarray(by_rank[step].get(r, []), dtype=np.int64) for r in range(world)]
        predicted = [simulate_group(lengths, prompt_len=calibrated.rollout.prompt_len, max_batch=max_batch,
                                    latency=latency, schedule=schedule).time_s if len(lengths) else 0.0
                     for lengths in ranks]
        lp, up, sync = phase_times(calibrated, np.concatenate(ranks), world)
        measured_ranks = tuple(float(m[f"timing/rollout/rank{r}"]) for r in range(world)
                               if f"timing/rollout/rank{r}" in m)
        out.append(StepComparison(
            step=int(step), measured_rollout_s=float(m["timing/rollout"]), predicted_rollout_s=max(predicted),
            measured_step_s=float(m["timing/step"]) if "timing/step" in m else None,
            predicted_step_s=max(predicted) + lp + up + sync, measured_rank_s=measured_ranks,
            predicted_rank_s=tuple(predicted) if len(measured_ranks) == world else ()))
    if not out:
        raise ValueError(f"{run.name}: no step has both timing/rollout in metrics.jsonl and rollouts in rollouts.jsonl")
    return ValidationReport(calibrated_on=calibrated_on, predicted=run.name, steps=tuple(out))


def report_table(reports: list[ValidationReport], tolerance: float = TOLERANCE) -> str:
    lines = ["| calibrated on | predicted | steps | rollout error | step error | per-rank error | within "
             f"{tolerance:.0%} |", "|---|---|---|---|---|---|---|"]
    for r in reports:
        lines.append(f"| {r.calibrated_on} | {r.predicted} | {len(r.steps)} | {r.error('rollout'):.1%} "
                     f"| {r.error('step'):.1%} | {r.error('rank'):.1%} | {'yes' if r.passed(tolerance) else 'no'} |")
    return "\n".join(lines)
