"""Simulated steps written as a measured run (metrics / decode_steps / rollouts JSONL).

The same format the RL loop writes (see `sim.calibration.runs`), so a simulated run can be calibrated and
validated like a real one: the round trip fit(trace(latency)) = latency is a test of both.
Each group is one rank (tensor_parallel 1). Every decode pass of a segment becomes one record,
its context at that pass; `noise` multiplies each pass's times by (1 + noise x N(0, 1)), drawn
from the generator passed in, and the rank and step timings are sums of the noisy records.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from common.atomic import atomic_file
from sim.config import Scenario
from sim.model.events import Segment
from sim.model.latency import LatencyModel
from sim.calibration.runs import parse_shape
from sim.model.parts import StepResult


def _passes(seg: Segment, latency: LatencyModel) -> list[tuple[float, float]]:
    """(mean context, forward_s) of each decode pass of a segment."""
    per_pass = seg.emitted / seg.passes  # tokens the rows gain per pass
    out = []
    for j in range(seg.passes):
        kv = seg.kv_tokens + (j - (seg.passes - 1) / 2) * per_pass
        out.append((kv / seg.rows, latency.forward_s(seg.rows, seg.query_tokens, kv)))
    return out


def _spread(total: float, passes: int) -> list[int]:
    """Integer per-pass counts summing to round(total), as even as they go (the engine's counts are
    integers; rounding each pass alone would bias the sum)."""
    edges = np.floor(np.arange(passes + 1) * round(total) / passes + 1e-9).astype(int)
    return np.diff(edges).tolist()


def _jitter(rng: np.random.Generator, noise: float) -> float:
    return max(0.05, 1.0 + noise * float(rng.standard_normal())) if noise > 0 else 1.0


def trace_records(scn: Scenario, step: int, result: StepResult, lengths_by_group: list[np.ndarray],
                  latency: LatencyModel, rng: np.random.Generator, noise: float = 0.0):
    """(metrics record, decode records, rollout records) of one simulated step."""
    if result.tensor_parallel != 1:
        raise ValueError("a trace writes one rank per rollout group: use cluster.tensor_parallel=1")
    decode, rollouts, rank_s = [], [], []
    spec_emitted = spec_rows = 0.0
    index = 0
    for rank, (group, lengths) in enumerate(zip(result.groups, lengths_by_group)):
        t = 0.0
        for seg in group.segments:
            if seg.kind == "prefill":
                t += seg.duration_s * _jitter(rng, noise)
                continue
            parse_shape(seg.kind)  # arms must be named d<depth>k<topk>v<verify>, bubble rows absent
            counts = {k: _spread(getattr(seg, k), seg.passes) for k in ("drafted", "emitted", "accepted")}
            for j, (context, forward) in enumerate(_passes(seg, latency)):
                rec = {"step": step, "rank": rank, "batch_size": seg.rows, "context_mean": round(context, 3),
                       "shape": seg.kind, **{k: v[j] for k, v in counts.items()},
                       "draft_s": seg.draft_s * _jitter(rng, noise), "forward_s": forward * _jitter(rng, noise),
                       "other_s": seg.other_s * _jitter(rng, noise)}
                decode.append(rec)
                t += rec["draft_s"] + rec["forward_s"] + rec["other_s"]
                if seg.kind != "off":
                    spec_emitted, spec_rows = spec_emitted + rec["emitted"], spec_rows + seg.rows
        rank_s.append(t)
        for length in lengths:
            samples = scn.rollout.samples_per_prompt
            rollouts.append({"step": step, "rank": rank, "prompt_id": f"s{step}p{index // samples}",
                             "sample": index % samples, "length": int(length), "finish_reason": "stop",
                             "reward": 0.0})
            index += 1
    rollout_s = max(rank_s)
    phases = {"logprob": result.logprob_s * _jitter(rng, noise), "update": result.update_s * _jitter(rng, noise),
              "sync": result.sync_s * _jitter(rng, noise)}
    all_lengths = np.concatenate(lengths_by_group)
    metrics = {"step": step, "timing/step": rollout_s + sum(phases.values()),
               "timing/rollout": float(np.mean(rank_s)), "timing/rollout_max": rollout_s,
               **{f"timing/{k}": v for k, v in phases.items()},
               **{f"timing/rollout/rank{r}": s for r, s in enumerate(rank_s)},
               **{f"timing/idle/rank{r}": rollout_s - s for r, s in enumerate(rank_s)},
               "spec/enabled": int(spec_rows > 0), "rollout/batch_size": len(all_lengths),
               "rollout/response_length/mean": float(all_lengths.mean()),
               "rollout/response_length/max": int(all_lengths.max()),
               "rollout/tokens_per_s": float(all_lengths.sum() / rollout_s), "world_size": len(rank_s)}
    if spec_rows:
        metrics["spec/accept_len"] = spec_emitted / spec_rows
    return metrics, decode, rollouts


def write_run(folder: str | Path, scn: Scenario, results: list[StepResult], lengths: list[list[np.ndarray]],
              latency: LatencyModel, rng: np.random.Generator, noise: float = 0.0) -> Path:
    """Write runs/<run>/{metrics,decode_steps,rollouts}.jsonl for these steps; returns the folder."""
    folder = Path(folder)
    files = {"metrics": [], "decode_steps": [], "rollouts": []}
    for step, (result, parts) in enumerate(zip(results, lengths)):
        m, d, r = trace_records(scn, step, result, parts, latency, rng, noise)
        files["metrics"].append(m)
        files["decode_steps"].extend(d)
        files["rollouts"].extend(r)
    for name, records in files.items():
        with atomic_file(folder / f"{name}.jsonl") as f:
            f.writelines(json.dumps(rec) + "\n" for rec in records)
    return folder
