"""Validation: calibrate on one measured run, predict another's step timings, report the error.

The prediction replays each timed step after the warm-up (`sim.calibration.runs`) of the predicted run with
its own requests (the response lengths each rank generated, and those each rank trained on, from its
rollouts.jsonl) and its own setup (world size, the engine's largest batch, the speculation shape
it ran most at each batch size, the trainer's mini-batches from its config.yaml), and
everything else from the calibration: the latency model, accept lengths, prompt length, prefill
and phase costs. So the error measures the latency, acceptance and phase models, not the length
distribution. The error of a quantity is the mean over steps of |predicted - measured| /
measured; the rollout time is the slowest rank's (the barrier's).

The *step speedup* of a predicted run is the calibration run's mean step time over its own,
measured (both runs measured) and predicted (both runs replayed by the model): what a user
reads off the simulator when asking what a setting buys.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from sim.config import Scenario, SpecSpec
from sim.model.events import simulate_group
from sim.calibration.fit import fit_schedule, step_cut
from sim.model.latency import build_latency
from sim.calibration.runs import MeasuredRun, rollout_s
from sim.model.schedule import OFF, build_schedule
from sim.model.parts import phase_times

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
    reference: ValidationReport | None = None  # the calibration run replayed: the speedup's baseline

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

    def mean_step_s(self, which: str) -> float:
        """Mean step time over the steps that measured one, `measured` or `predicted`."""
        steps = [s for s in self.steps if s.measured_step_s is not None]
        if not steps:
            return float("nan")
        return float(np.mean([s.measured_step_s if which == "measured" else s.predicted_step_s for s in steps]))

    def speedup(self, which: str) -> float:
        """The calibration run's mean step time over this run's, `measured` or `predicted`."""
        if self.reference is None:
            return float("nan")
        return self.reference.mean_step_s(which) / self.mean_step_s(which)

    def speedup_error(self) -> float:
        measured = self.speedup("measured")
        return abs(self.speedup("predicted") - measured) / measured

    def passed(self, tolerance: float = TOLERANCE) -> bool:
        """Rollout error, step error and step-speedup error (where measured) within tolerance."""
        checks = [self.error("rollout"), self.error("step"), self.speedup_error()]
        return all(np.isnan(c) or c <= tolerance for c in checks) and not np.isnan(checks[0])


def predicted_spec(calibrated: Scenario, run: MeasuredRun) -> SpecSpec | None:
    """The speculation the predicted run ran (`sim.calibration.fit.fit_schedule`: its most used shape at each
    batch size), with the calibration's accept lengths; None when it never speculated."""
    spec = fit_schedule(run.decode_steps, calibrated.spec.arms)
    if spec.arm is None and not spec.buckets:
        return None
    known = {a.name for a in calibrated.spec.arms}
    for shape in [b.arm for b in spec.buckets] if spec.schedule == "buckets" else [spec.arm]:
        if shape != "off" and shape not in known:
            raise ValueError(f"{run.name} ran shape {shape!r}, which the calibration run never ran, so its accept "
                             f"length is unknown (calibrated shapes: {', '.join(sorted(known)) or 'none'})")
    return replace(spec, draft_params_b=calibrated.spec.draft_params_b)


def predicted_setup(calibrated: Scenario, run: MeasuredRun) -> Scenario:
    """The calibrated scenario with the predicted run's trainer mini-batches, epochs and micro-batch
    budget; the update's share of tokens is 1, as the replay gives it the rows it trained on."""
    calibrated = replace(calibrated, phases=replace(calibrated.phases, update_share=1.0))
    if not calibrated.phases.mini_batches or not run.config:
        return calibrated
    ph = calibrated.phases
    phases = replace(ph, mini_batches=run.trainer("mini_batches", ph.mini_batches),
                     ppo_epochs=run.trainer("ppo_epochs", ph.ppo_epochs),
                     micro_batch_tokens=run.setting("actor", "micro_batch_tokens", ph.micro_batch_tokens))
    return replace(calibrated, phases=phases)


def validate(calibrated: Scenario, run: MeasuredRun, calibrated_on: str = "",
             reference: ValidationReport | None = None) -> ValidationReport:
    scn = predicted_setup(calibrated, run)
    latency = build_latency(scn)
    spec = predicted_spec(scn, run)
    schedule = build_schedule(spec) if spec is not None else OFF
    max_batch = max((s.batch_size for s in run.decode_steps), default=scn.cluster.max_batch)
    by_rank = run.lengths_by_rank()
    trained = run.trained_lengths_by_rank()
    cuts = run.trained_mini_batches()
    out = []
    for m in run.timed_steps():
        step = m["step"]
        if step not in by_rank:
            continue
        world = int(m.get("world_size", max(by_rank[step]) + 1))
        ranks = [np.asarray(by_rank[step].get(r, []), dtype=np.int64) for r in range(world)]
        predicted = [simulate_group(lengths, prompt_len=scn.rollout.prompt_len, max_batch=max_batch,
                                    latency=latency, schedule=schedule).time_s if len(lengths) else 0.0
                     for lengths in ranks]
        lp, up, sync = phase_times(scn, [np.asarray(trained[step].get(r, []), dtype=np.int64) for r in range(world)],
                                   step_cut(cuts, step, range(world)))
        measured_ranks = tuple(float(m[f"timing/rollout/rank{r}"]) for r in range(world)
                               if f"timing/rollout/rank{r}" in m)
        out.append(StepComparison(
            step=int(step), measured_rollout_s=rollout_s(m), predicted_rollout_s=max(predicted),
            measured_step_s=float(m["timing/step"]) if "timing/step" in m else None,
            predicted_step_s=max(predicted) + lp + up + sync, measured_rank_s=measured_ranks,
            predicted_rank_s=tuple(predicted) if len(measured_ranks) == world else ()))
    if not out:
        raise ValueError(f"{run.name}: no timed step after the warm-up has both timing/rollout in metrics.jsonl "
                         "and rollouts in rollouts.jsonl (a run needs at least 2 timed steps)")
    return ValidationReport(calibrated_on=calibrated_on, predicted=run.name, steps=tuple(out), reference=reference)


def report_table(reports: list[ValidationReport], tolerance: float = TOLERANCE) -> str:
    lines = ["| calibrated on | predicted | steps | rollout error | step error | per-rank error "
             f"| step speedup measured / predicted | within {tolerance:.0%} |", "|---|---|---|---|---|---|---|---|"]
    for r in reports:
        speedup = (f"{r.speedup('measured'):.2f}x / {r.speedup('predicted'):.2f}x ({r.speedup_error():.1%})"
                   if r.reference is not None else "-")
        lines.append(f"| {r.calibrated_on} | {r.predicted} | {len(r.steps)} | {r.error('rollout'):.1%} "
                     f"| {r.error('step'):.1%} | {r.error('rank'):.1%} | {speedup} "
                     f"| {'yes' if r.passed(tolerance) else 'no'} |")
    return "\n".join(lines)

