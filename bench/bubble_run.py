"""`torchrun --standalone --nproc-per-node=2 -m bench.bubble --config configs/tiny.yaml --steps N [--json]`:
N RL steps with bubble drafts and without, side by side.

After a discarded one-step warm-up run, the same N steps (same seeds, same data) run twice in this
process group through launch.train: once with `bubble.enabled=true` and the config's drafter behind
bubble drafts (`engine.spec.drafter=pregenerated+<drafter>`), once without. Here, unlike the
one-step mode of bench.bubble, only what the idle windows really pre-generated is covered. The
runs must be identical: every step's rewards, losses and grad norms, and the final weights. The
bench prints, per step from step 2 (step 1 has nothing pre-generated), coverage and accept length
of the covered rows, the target passes per row of both runs (from decode_steps.jsonl) and their
rollout times. `--json` ends with `{"decode_steps_ratio", "rollout_ratio", "coverage",
"accept_len_covered", "identical", ...}`. Bubble drafts need idle windows: run it on two or more ranks.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from bench.common import cpu_model, finish
from bench.runs import bench_overrides, mean, read_metrics, same_steps, same_weights, train_runs
from common.config import load_config
from launch.run.config import TrainConfig


def row_passes(run_dir: Path) -> dict[int, int]:
    """Per RL step: target passes summed over rows (every row of a decode step is one pass of it), all ranks."""
    out: dict[int, int] = defaultdict(int)
    for line in (run_dir / "decode_steps.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out[rec["step"]] += rec["batch_size"]
    return dict(out)


def run_steps(config: str, steps: int, overrides: list[str], out: str | None, as_json: bool) -> int:
    if steps < 2:
        print("error: --steps must be >= 2 (step 1 has no pre-generated drafts)", file=sys.stderr)
        return 1
    folder = Path(out or tempfile.mkdtemp(prefix="tailspec-bubble-run-"))
    common = bench_overrides(steps, overrides)

    def check(cfg, r) -> None:
        if r.world < 2:
            raise ValueError("bubble drafts are made in idle windows, which need two or more ranks: "
                             "run it under torchrun --nproc-per-node=2")

    try:
        base = load_config(TrainConfig, config, common).engine.spec
        if not base.enabled or base.drafter_spec.composed:
            raise ValueError("bench.bubble needs engine.spec.enabled=true with a single drafter (eagle, eagle3 or ngram)")
        plan = [("warmup", ["trainer.steps=1"]),
                ("bubble", ["bubble.enabled=true", f"engine.spec.drafter=pregenerated+{base.drafter}"]),
                ("plain", ["bubble.enabled=false"])]
        runs, r = train_runs(config, plan, common, folder, "bubble", check)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not r.main:
        return 0
    on, off = read_metrics(runs["bubble"]), read_metrics(runs["plain"])
    identical = same_steps(on, off) and same_weights(runs["bubble"], runs["plain"], steps)
    p_on, p_off = row_passes(runs["bubble"]), row_passes(runs["plain"])
    later = range(2, steps + 1)
    t_on = [m["timing/rollout_max"] for m in on[1:]]
    t_off = [m["timing/rollout_max"] for m in off[1:]]
    accepts = [m["bubble/accept_len"] for m in on[1:] if "bubble/accept_len" in m]  # steps where bubble drafts ran
    result = {
        "decode_steps_ratio": round(sum(p_on[s] for s in later) / sum(p_off[s] for s in later), 3),
        "rollout_ratio": round(mean(t_off) / mean(t_on), 3),
        "coverage": round(mean([m.get("bubble/coverage", 0.0) for m in on[1:]]), 3),
        "token_coverage": round(mean([m.get("bubble/token_coverage", 0.0) for m in on[1:]]), 3),
        "accept_len_covered": round(mean(accepts), 3) if accepts else None,
        "decode_steps_saved": int(sum(m.get("bubble/decode_steps_saved", 0.0) for m in on[1:])),
        "identical": identical, "steps": steps, "world_size": r.world, "config": config, "overrides": overrides,
        "cpu": cpu_model(), "runs": {k: str(v) for k, v in runs.items()},
    }
    print(f"cpu: {result['cpu']}", file=sys.stderr)
    print(f"{'step':>5} {'coverage':>9} {'accept':>7} {'row passes bubble':>18} {'plain':>7} {'rollout s bubble':>17} {'plain':>7}",
          file=sys.stderr)
    for i, s in enumerate(later, start=1):
        a, b = on[i], off[i]
        print(f"{s:>5} {a.get('bubble/coverage', 0.0):>9.2f} {a.get('bubble/accept_len', float('nan')):>7.2f} "
              f"{p_on[s]:>18} {p_off[s]:>7} {a['timing/rollout_max']:>17.2f} {b['timing/rollout_max']:>7.2f}", file=sys.stderr)
    print(f"steps 2..{steps}: row passes bubble / plain {result['decode_steps_ratio']:.3f}, rollout speed-up "
          f"{result['rollout_ratio']:.2f}x, coverage {result['coverage']:.0%} of rollouts ({result['token_coverage']:.0%} of "
          f"tokens), accept length of covered rows {result['accept_len_covered']}; identical: {identical}", file=sys.stderr)
    finish(result, as_json)
    return 0 if identical else 2
