"""Calibration: a measured run's decode passes, rollouts and step timings fitted into a scenario.

Fits, each by non-negative least squares on a small basis over the run's decode passes:
- forward_s = base_s + query_s * query_tokens + kv_s * kv_tokens (query tokens = rows x (1 +
  verify tokens), kv tokens = rows x mean context);
- draft_s = depth * (draft_base_s + draft_token_s * rows * topk) on speculative passes;
- other_s = other_base_s + other_row_s * rows;
and directly: the accept length of each shape (emitted / rows over its passes), the prompt
length (the smallest mean context of each rank's first pass), the response lengths (the run's
rollouts.jsonl, resampled), log-prob and update device-seconds per token and the sync time.
The result is a complete `Scenario` of the measured setup (`latency.kind: fitted`); project it
by changing `cluster.devices` and the rollout batch. Pure apart from `MeasuredRun` records.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from sim.config import (ArmSpec, ClusterSpec, LatencySpec, LengthSpec, PhaseSpec, RolloutSpec, Scenario,
                        SpecSpec)
from sim.runs import DecodeStep, MeasuredRun, parse_shape


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: refit without the columns that came out negative."""
    keep = np.ones(x.shape[1], dtype=bool)
    while True:
        coef = np.zeros(x.shape[1])
        if keep.any():
            coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (coef >= 0).all():
            return coef
        keep &= coef > 0


def r_squared(x: np.ndarray, y: np.ndarray, coef: np.ndarray) -> float:
    resid = y - x @ coef
    total = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float((resid ** 2).sum()) / total if total > 0 else 1.0


def fit_latency(steps: list[DecodeStep]) -> tuple[LatencySpec, dict[str, float]]:
    if not steps:
        raise ValueError("calibration needs decode passes (decode_steps.jsonl is empty)")
    x = np.array([[1.0, s.query_tokens, s.kv_tokens] for s in steps])  # [P, 3]
    y = np.array([s.forward_s for s in steps])
    fwd = nnls(x, y)
    xo = np.array([[1.0, s.batch_size] for s in steps])
    other = nnls(xo, np.array([s.other_s for s in steps]))
    spec = [(s, parse_shape(s.shape)) for s in steps if s.shape != "off"]
    draft = np.zeros(2)
    if spec:
        xd = np.array([[d, d * s.batch_size * k] for s, (d, k, _) in spec])
        draft = nnls(xd, np.array([s.draft_s for s, _ in spec]))
    fitted = LatencySpec(kind="fitted", base_s=float(fwd[0]), query_s=float(fwd[1]), kv_s=float(fwd[2]),
                         draft_base_s=float(draft[0]), draft_token_s=float(draft[1]),
                         other_base_s=float(other[0]), other_row_s=float(other[1]))
    return fitted, {"calibrate/forward_r2": r_squared(x, y, fwd), "calibrate/decode_passes": float(len(steps))}


def fit_arms(steps: list[DecodeStep]) -> list[ArmSpec]:
    emitted: dict[str, int] = defaultdict(int)
    rows: dict[str, int] = defaultdict(int)
    for s in steps:
        if s.shape != "off":
            emitted[s.shape] += s.emitted
            rows[s.shape] += s.batch_size
    arms = []
    for shape in sorted(emitted):
        depth, topk, verify = parse_shape(shape)
        accept = min(max(emitted[shape] / rows[shape], 1.0), verify + 1.0)
        arms.append(ArmSpec(name=shape, depth=depth, topk=topk, verify_tokens=verify, accept_len=accept))
    return arms


def fit_schedule(steps: list[DecodeStep], arms: list[ArmSpec]) -> SpecSpec:
    """The schedule the run ran: its most used shape, on up to the largest batch it ran at."""
    used = Counter(s.shape for s in steps if s.shape != "off")
    if not used:
        return SpecSpec(arms=arms)
    shape = used.most_common(1)[0][0]
    threshold = max(s.batch_size for s in steps if s.shape == shape)
    return SpecSpec(arms=arms, schedule="threshold", arm=shape, threshold=threshold)


def prompt_len(steps: list[DecodeStep]) -> int:
    first: dict[tuple[int, int], float] = {}
    for s in steps:
        key = (s.step, s.rank)
        first[key] = min(first.get(key, s.context_mean), s.context_mean)
    return max(1, int(round(float(np.median(list(first.values()))))))


def fit_phases(run: MeasuredRun, prompt: int) -> PhaseSpec:
    """Device-seconds per (prompt + response) token of log-prob and update, and the sync time."""
    tokens: dict[int, float] = defaultdict(float)
    for r in run.rollouts:
        tokens[r.step] += r.length + prompt
    per: dict[str, list[float]] = defaultdict(list)
    for m in run.metrics:
        step, world = m.get("step"), m.get("world_size", 1)
        for key in ("logprob", "update"):
            if f"timing/{key}" in m and tokens.get(step):
                per[key].append(m[f"timing/{key}"] * world / tokens[step])
        if "timing/sync" in m:
            per["sync"].append(m["timing/sync"])
    mean = {k: float(np.mean(v)) for k, v in per.items()}
    return PhaseSpec(logprob_s_per_token=mean.get("logprob", 0.0), update_s_per_token=mean.get("update", 0.0),
                     sync_s=mean.get("sync", 0.0))


def calibrate(run: MeasuredRun) -> tuple[Scenario, dict[str, float]]:
    if not run.rollouts:
        raise ValueError(f"{run.folder}: rollouts.jsonl is empty; the length distribution comes from it")
    latency, metrics = fit_latency(run.decode_steps)
    arms = fit_arms(run.decode_steps)
    prompt = prompt_len(run.decode_steps)
    per_step = Counter(r.step for r in run.rollouts)
    requests = int(np.median(list(per_step.values())))
    samples = max(r.sample for r in run.rollouts) + 1
    world = int(max((m.get("world_size", 1) for m in run.metrics), default=1))
    lengths = LengthSpec(kind="empirical", path=str((run.folder / "rollouts.jsonl").resolve()),
                         max_len=max(r.length for r in run.rollouts))
    scn = Scenario(
        name=f"calibrated-{run.name}", steps=len(per_step), latency=latency,
        cluster=ClusterSpec(devices=[world], tensor_parallel=1,
                            max_batch=max(s.batch_size for s in run.decode_steps)),
        rollout=RolloutSpec(prompts=max(1, requests // samples), samples_per_prompt=samples, prompt_len=prompt,
                            lengths=lengths),
        spec=fit_schedule(run.decode_steps, arms), phases=fit_phases(run, prompt))
    metrics.update({f"calibrate/accept_len/{a.name}": a.accept_len for a in arms})
    metrics["calibrate/prompt_len"] = float(prompt)
    return scn, metrics
