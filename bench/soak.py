"""`torchrun --nproc-per-node=2 -m bench.soak --config configs/tiny.yaml --steps 200 [--warmup 20] [--max-growth-mb 1] [--json]`:
a long run with every part that keeps state across steps on, and whether any rank's live memory grows.

One RL run of the config with spot training and bubble drafts on (the config's drafter behind
`pregenerated+`), its own evaluation and checkpoint cadence kept, for N steps. The loop logs each
rank's live resident memory every step (`mem/rss_gb/rank{r}`, pipeline.metrics.live_memory); the
bench fits a line to each rank's values after the warm-up steps and prints, per rank, the live RSS
at the warm-up's end and at the last step and the fitted growth in MB a step. It writes them to
`<run>/soak.json` and exits 1 when a rank grows faster than `--max-growth-mb`: a leak, not a peak,
since a high-water mark only ever rises. Further `key=value` arguments override the config.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.common import cpu_model, finish
from bench.runs import plan_config, train_runs
from pipeline.metrics.history import load_history
from pipeline.metrics.live_memory import RSS_KEY, growth_per_step

SOAK_FILE = "soak.json"


def soak_levers(config: str, overrides: list[str]) -> list[str]:
    """Spot training and bubble drafts on, the config's drafter behind the pre-generated drafts."""
    drafter = plan_config(config, overrides, [], Path("."), "soak").engine.spec.drafter
    parts = [p for p in drafter.split("+") if p != "pregenerated"]
    return ["spot.enabled=true", "bubble.enabled=true", f"engine.spec.drafter={'+'.join(['pregenerated', *parts])}"]


def growth_report(run_dir: Path, warmup: int) -> dict:
    """Per rank: live RSS (GB) at the warm-up's end and at the last step, and the fitted growth (MB a step)."""
    history = load_history(run_dir)
    ranks = history.ranks(RSS_KEY)
    if not ranks:
        raise ValueError(f"{run_dir} logged no {RSS_KEY}/rank<r>: the run is older than the live-RSS metric")
    out = {}
    for rank in ranks:
        steps, gb = history.series(f"{RSS_KEY}/rank{rank}")
        after = [v for s, v in zip(steps, gb) if s > warmup]
        out[rank] = {"steps": len(steps), "rss_gb_after_warmup": after[0], "rss_gb_last": gb[-1],
                     "growth_mb_per_step": growth_per_step(steps, gb, warmup) * 1e3}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20, help="steps left out of the fit (allocator arenas and caches fill in)")
    p.add_argument("--max-growth-mb", type=float, default=1.0, help="the largest growth of any rank's live RSS, MB a step")
    p.add_argument("--out", default="runs/soak", help="the run folder goes under it")
    p.add_argument("--json", action="store_true")
    args, overrides = p.parse_known_args(argv)
    if args.steps <= args.warmup + 2:
        p.error(f"--steps {args.steps} leaves fewer than 3 steps after --warmup {args.warmup} to fit a slope")
    common = [f"trainer.steps={args.steps}", "metrics.wandb=false", "metrics.console=false", *overrides]
    runs, r = train_runs(args.config, [("run", soak_levers(args.config, common))], common, Path(args.out), "soak")
    if not r.main:
        return 0
    run_dir = runs["run"]
    report = growth_report(run_dir, args.warmup)
    print(f"soak: {args.steps} steps on {len(report)} rank(s), {cpu_model()}; growth fitted after step {args.warmup}")
    print("| rank | live RSS after warm-up (GB) | live RSS last step (GB) | growth (MB/step) |")
    print("|---|---|---|---|")
    for rank, row in report.items():
        print(f"| {rank} | {row['rss_gb_after_warmup']:.3f} | {row['rss_gb_last']:.3f} | {row['growth_mb_per_step']:+.3f} |")
    worst = max(row["growth_mb_per_step"] for row in report.values())
    result = {"run_dir": str(run_dir), "steps": args.steps, "warmup": args.warmup, "max_growth_mb": args.max_growth_mb,
              "worst_growth_mb_per_step": worst, "ranks": report, "cpu": cpu_model()}
    (run_dir / SOAK_FILE).write_text(json.dumps(result, indent=1))
    finish(result, args.json)
    if worst > args.max_growth_mb:
        print(f"soak: live RSS grows {worst:+.3f} MB a step after step {args.warmup}, above --max-growth-mb "
              f"{args.max_growth_mb:g} (per rank above; {run_dir}/dashboard.png draws it)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
