"""The trend checks: speedup against accept length, draft depth, tail weight and the ceiling.

- `analytic_ceiling`: NeMo-RL's step bound S = 1 / (R_gen / alpha + 1 - R_gen), R_gen the
  rollout share of the baseline step; it holds with equality when verification and drafting
  are free and all rollout time is decode.
- `accept_sweep`: every arm's accept length set to alpha, speculation only (the scenario's
  schedule), against the ceiling at the same R_gen.
- `depth_sweep`: chain drafts of depth k (accept length from a per-token acceptance rate),
  always on, in one group holding B requests: a larger B makes verification costlier.
- `tail_sweep`: the lognormal's sigma varied at a fixed median.
- `prompt_share_sweep`: the share of log-length variance between prompts varied: what split
  groups buy, with and without speculation and spot training.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from sim.config import ArmSpec, ClusterSpec, LatencySpec, PlacementSpec, Scenario, SpecSpec
from sim.model.latency import build_latency
from sim.projection.project import COMBOS, SPLIT_COMBOS, project, simulate_steps
from sim.model.schedule import chain_arm
from sim.model.parts import Techniques

SPEC = Techniques(spec=True)


def analytic_ceiling(r_gen: float, alpha: float) -> float:
    return 1.0 / (r_gen / alpha + 1.0 - r_gen)


@dataclass(frozen=True)
class SweepPoint:
    x: float
    rollout_speedup: float
    step_speedup: float
    ceiling: float  # the analytic step ceiling at the baseline's R_gen and this point's alpha


def speedups(scn: Scenario, devices: int, tech: Techniques = SPEC) -> tuple[float, float, float]:
    """(rollout speedup, step speedup, baseline R_gen) of `tech` over the baseline."""
    latency = build_latency(scn)
    base = simulate_steps(scn, devices, Techniques(), latency)
    fast = simulate_steps(scn, devices, tech, latency)
    roll = np.mean([b.rollout_s for b in base]) / np.mean([f.rollout_s for f in fast])
    step = np.mean([b.step_s for b in base]) / np.mean([f.step_s for f in fast])
    r_gen = np.mean([b.rollout_s / b.step_s for b in base])
    return float(roll), float(step), float(r_gen)


def with_accept(scn: Scenario, alpha: float) -> Scenario:
    arms = [replace(a, accept_len=min(alpha, a.verify_tokens + 1.0)) for a in scn.spec.arms]
    return replace(scn, spec=replace(scn.spec, arms=arms))


def accept_sweep(scn: Scenario, devices: int, alphas: list[float]) -> list[SweepPoint]:
    out = []
    for alpha in alphas:
        roll, step, r_gen = speedups(with_accept(scn, alpha), devices)
        out.append(SweepPoint(alpha, roll, step, analytic_ceiling(r_gen, alpha)))
    return out


def ceiling_limit(scn: Scenario, devices: int, alphas: list[float], pass_s: float = 0.01) -> list[SweepPoint]:
    """The accept sweep where the ceiling is exact: every pass costs `pass_s` whatever it
    verifies or reads, drafting is free, and the one prefill pass per group (a one-token prompt,
    no queue) is the only rollout time that is not decode; colocated, as the ceiling assumes."""
    limit = replace(scn, placement=PlacementSpec(), latency=LatencySpec(kind="fitted", base_s=pass_s),
                    rollout=replace(scn.rollout, prompt_len=1),
                    cluster=replace(scn.cluster, max_batch=scn.rollout.requests),
                    spec=SpecSpec(arms=[ArmSpec(name="limit", depth=63, verify_tokens=63, accept_len=1.0)],
                                  schedule="always", arm="limit"))
    return accept_sweep(limit, devices, alphas)


def depth_sweep(scn: Scenario, depths: list[int], batches: list[int], p: float) -> dict[int, list[SweepPoint]]:
    """batch B -> rollout speedup of a depth-k chain, for each k, one group of B requests
    (colocated: one group's devices)."""
    out: dict[int, list[SweepPoint]] = {}
    tp = scn.cluster.tensor_parallel
    for b in batches:
        one = replace(scn, placement=PlacementSpec(),
                      cluster=ClusterSpec(devices=[tp], tensor_parallel=tp, max_batch=b),
                      rollout=replace(scn.rollout, prompts=b, samples_per_prompt=1))
        points = []
        for k in depths:
            arm = chain_arm(p, k)
            spec = SpecSpec(arms=[arm], schedule="always", arm=arm.name, draft_params_b=scn.spec.draft_params_b)
            roll, step, r_gen = speedups(replace(one, spec=spec), tp)
            points.append(SweepPoint(k, roll, step, analytic_ceiling(r_gen, arm.accept_len)))
        out[b] = points
    return out


def tail_sweep(scn: Scenario, devices: int, sigmas: list[float]) -> list[SweepPoint]:
    out = []
    for sigma in sigmas:
        lengths = replace(scn.rollout.lengths, kind="lognormal", sigma=sigma)
        roll, step, r_gen = speedups(replace(scn, rollout=replace(scn.rollout, lengths=lengths)), devices)
        out.append(SweepPoint(sigma, roll, step, float("nan")))
    return out


@dataclass(frozen=True)
class SplitPoint:
    prompt_share: float
    split_rollout: float  # split alone over the baseline: rollout speedup
    split_step: float
    spec_spot_step: float  # spec + spot over the baseline: step speedup
    spec_spot_split_step: float  # spec + spot + split over the baseline: step speedup


def prompt_share_sweep(scn: Scenario, devices: int, shares: list[float]) -> list[SplitPoint]:
    """rollout.lengths.prompt_share varied (a lognormal at the scenario's median and sigma)."""
    combos = {"baseline": COMBOS["baseline"], "spec+spot": COMBOS["spec+spot"], **SPLIT_COMBOS}
    out = []
    for share in shares:
        lengths = replace(scn.rollout.lengths, kind="lognormal", prompt_share=share, by_prompt=False)
        rows = {r.combo: r for r in project(replace(scn, rollout=replace(scn.rollout, lengths=lengths)), combos, [devices])}
        out.append(SplitPoint(share, rows["split"].rollout_speedup, rows["split"].step_speedup,
                              rows["spec+spot"].step_speedup, rows["spec+spot+split"].step_speedup))
    return out
