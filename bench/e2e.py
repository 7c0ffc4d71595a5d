"""`python -m bench.e2e --config configs/tiny.yaml --steps N [--json]`: RL steps, speculation on vs off.

Runs the same N RL steps twice in this process (same seeds, same data): once with the config's
speculation, once with `engine.spec.enabled=false` (and no spot training: nothing to train), and compares them side by side:

- step-time ratio (off / on, mean over steps 2..N: step 1 pays one-time costs);
- R_gen, the generation share of the step without speculation (rollout / step time);
- alpha, the accept length with speculation (spec/accept_len);
- the ceiling 1 / (R_gen / alpha + 1 - R_gen) (NeMo-RL's step bound: speculation free, verification
  as cheap as decoding);
- whether the two runs were identical: every step's rewards and losses, and the final weights.

Under `torchrun` every rank runs both. Prints the CPU model and the kernel state with the table;
`--json` ends with one line `{"step_ratio", "r_gen", "accept_len", "ceiling", "identical", ...}`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.common import cpu_model, finish
from bench.runs import bench_overrides, mean, read_metrics, same_steps, same_weights, train_runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=None, help="folder for the two runs (default: a temporary one)")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", help="section.key=value, applied to both runs")
    args = p.parse_args(argv)
    if args.steps < 2:
        print("error: --steps must be >= 2 (step 1 is excluded from the timing)", file=sys.stderr)
        return 1
    out = Path(args.out or tempfile.mkdtemp(prefix="tailspec-e2e-"))
    plan = [("on", []), ("off", ["engine.spec.enabled=false", "spot.enabled=false"])]
    try:
        runs, _ = train_runs(args.config, plan, bench_overrides(args.steps, args.overrides), out, "e2e")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    on, off = read_metrics(runs["on"]), read_metrics(runs["off"])
    identical_steps, identical_weights = same_steps(on, off), same_weights(runs["on"], runs["off"], args.steps)
    t_on, t_off = mean([m["timing/step"] for m in on[1:]]), mean([m["timing/step"] for m in off[1:]])
    r_gen = mean([m["timing/rollout"] / m["timing/step"] for m in off[1:]])
    alpha = mean([m["spec/accept_len"] for m in on[1:] if "spec/accept_len" in m]) if any("spec/accept_len" in m for m in on) else 1.0
    ceiling = 1.0 / (r_gen / alpha + 1.0 - r_gen)
    result = {
        "step_ratio": round(t_off / t_on, 3), "r_gen": round(r_gen, 3), "accept_len": round(alpha, 3),
        "ceiling": round(ceiling, 3), "of_ceiling": round(t_off / t_on / ceiling, 3), "identical": identical_steps and identical_weights,
        "identical_steps": identical_steps, "identical_weights": identical_weights, "step_s_on": round(t_on, 3),
        "step_s_off": round(t_off, 3),
        "rollout_s_on": round(mean([m["timing/rollout"] for m in on[1:]]), 3),
        "rollout_s_off": round(mean([m["timing/rollout"] for m in off[1:]]), 3),
        "steps": args.steps, "config": args.config, "cpu": cpu_model(), "runs": {k: str(v) for k, v in runs.items()},
    }
    print(f"cpu: {result['cpu']}", file=sys.stderr)
    print(f"{'':>10} {'step s':>8} {'rollout s':>10}", file=sys.stderr)
    print(f"{'spec on':>10} {t_on:>8.2f} {result['rollout_s_on']:>10.2f}", file=sys.stderr)
    print(f"{'spec off':>10} {t_off:>8.2f} {result['rollout_s_off']:>10.2f}", file=sys.stderr)
    print(f"step ratio {result['step_ratio']:.2f}x, R_gen {r_gen:.2f}, accept length {alpha:.2f}, ceiling {ceiling:.2f}x "
          f"({result['of_ceiling']:.0%} of it); identical runs: {result['identical']}", file=sys.stderr)
    finish(result, args.json)
    return 0 if result["identical"] else 2


if __name__ == "__main__":
    sys.exit(main())
