"""`python -m bench.rollout_profile RUN [RUN ...] [--model M --alphas 0.5,0.8,0.95]`: where a rollout's time goes, by batch size.

Reads each run folder's `decode_steps.jsonl` (every rank's decode passes; bench.e2e's run folders,
or `launch.train`'s) and prints, per active-batch bucket (1, 2-4, 5-8, 9-16, 17-32, 33+) over
steps 2..N (step 1 pays one-time costs): the decode passes, their seconds (drafting, the target
forward, the rest: sampling, verification, bookkeeping), the bucket's share of the rollout's
decode time, milliseconds a pass, the entries a pass verified per row, tokens emitted per row a
pass (the accept length, 1.00 without speculation) and tokens per second. The first run is the
reference (all-off); each other run's bucket time is given as a ratio against it, so an
as-shipped run's loss or gain is placed where it happens.

With `--model` it adds the bound: this machine's pass-cost table (engine.spec.pass_costs, measured
once for the model on one thread, as each torchrun rank decodes; cached), and for each per-token
acceptance in `--alphas` the rollout ratio a drafter of that acceptance could reach on the first
run's decode trace at most: every pass at the chain length (0: off) that the table and the chain
model (1 + alpha + ... + alpha^L tokens a pass) predict fastest, drafting free. With the run's
R_gen (metrics.jsonl) it gives the step ceiling 1 / (R_gen / r + 1 - R_gen) at that rollout ratio
r. `--json` ends with one line holding the tables and bounds.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from bench.common import cpu_model, finish

BUCKETS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 32), (33, 1 << 30))


def bucket_name(b: int) -> str:
    lo, hi = next((lo, hi) for lo, hi in BUCKETS if lo <= b <= hi)
    return str(lo) if lo == hi else f"{lo}+" if hi == 1 << 30 else f"{lo}-{hi}"


def run_file(run: Path) -> Path:
    """The decode_steps.jsonl of a run folder (or of the one run folder inside a bench way's folder)."""
    direct = run / "decode_steps.jsonl"
    if direct.exists():
        return direct
    found = sorted(run.glob("*/decode_steps.jsonl"))
    if len(found) != 1:
        raise FileNotFoundError(f"{run}: no decode_steps.jsonl (give a run folder of launch.train or bench.e2e)")
    return found[0]


def read_passes(run: Path) -> list[dict]:
    """The run's decode passes of steps 2..N."""
    rows = [json.loads(line) for line in run_file(run).read_text().splitlines() if line.strip()]
    later = [r for r in rows if r["step"] > 1]
    if not later:
        raise ValueError(f"{run}: decode_steps.jsonl has no step after step 1 (run two or more steps)")
    return later


def profile(passes: list[dict]) -> dict[str, dict]:
    """Per bucket: passes, seconds (draft / forward / other), share, ms a pass, entries and tokens per row, tokens/s."""
    by = defaultdict(lambda: defaultdict(float))
    for p in passes:
        a = by[bucket_name(p["batch_size"])]
        a["passes"] += 1
        a["rows"] += p["batch_size"]
        a["draft_s"] += p["draft_s"]
        a["forward_s"] += p["forward_s"]
        a["other_s"] += p["other_s"]
        a["entries"] += p["batch_size"] + p["drafted"]
        a["emitted"] += p["emitted"]
        a["speculative"] += p["shape"] != "off"
    total = sum(a["draft_s"] + a["forward_s"] + a["other_s"] for a in by.values())
    out = {}
    for name in (bucket_name(lo) for lo, _ in BUCKETS):
        if name not in by:
            continue
        a = by[name]
        seconds = a["draft_s"] + a["forward_s"] + a["other_s"]
        out[name] = {"passes": int(a["passes"]), "seconds": round(seconds, 3), "draft_s": round(a["draft_s"], 3),
                     "forward_s": round(a["forward_s"], 3), "other_s": round(a["other_s"], 3),
                     "share": round(seconds / total, 3), "ms_per_pass": round(1e3 * seconds / a["passes"], 1),
                     "entries_per_row": round(a["entries"] / a["rows"], 2), "accept_len": round(a["emitted"] / a["rows"], 2),
                     "tokens_per_s": round(a["emitted"] / seconds, 1), "speculative_share": round(a["speculative"] / a["passes"], 3)}
    return out


def bound(passes: list[dict], costs, alpha: float, max_len: int) -> float:
    """The rollout ratio (plain seconds / best seconds) over the passes of a plain decode trace, each
    at the chain length 0..max_len predicted fastest for per-token acceptance `alpha` (drafting free)."""
    from engine.spec.cost_policy import expected_emitted

    plain = best = 0.0
    for p in passes:
        b, s = p["batch_size"], p["draft_s"] + p["forward_s"] + p["other_s"]
        gain = max(expected_emitted(alpha, n) * costs(b, 1) / costs(b, 1 + n) for n in range(max_len + 1))
        plain += s
        best += s / gain
    return plain / best


def r_gen(run: Path) -> float:
    """The generation phase's share of the step (rollout + idle) / step, mean over steps 2..N."""
    metrics = run / "metrics.jsonl" if (run / "metrics.jsonl").exists() else next(run.glob("*/metrics.jsonl"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [m for m in rows if "timing/step" in m][1:]
    return sum((m["timing/rollout"] + m["timing/idle"]) / m["timing/step"] for m in rows) / len(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rollout_profile", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run folders; the first is the reference (all-off)")
    p.add_argument("--model", default=None, help="the runs' model folder: adds the bound from this machine's pass costs")
    p.add_argument("--alphas", default="0.5,0.7,0.8,0.9,0.95", help="per-token acceptances the bound is given for")
    p.add_argument("--max-len", type=int, default=8, help="the longest chain the bound considers")
    p.add_argument("--max-batch", type=int, default=32, help="the engine's rows (the pass-cost table's largest)")
    p.add_argument("--context", type=int, default=384,
                   help="committed tokens per row while measuring: the engine's max_len / 2, as the cost tuner measures "
                        "(384: the GSM8K recipe's; the same table is then read from the tuner's cache)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        traces = {str(r): read_passes(r) for r in args.runs}
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    result = {"cpu": cpu_model(), "runs": {name: profile(t) for name, t in traces.items()}}
    ref_name, ref = next(iter(result["runs"].items()))
    err = lambda s: print(s, file=sys.stderr)  # noqa: E731
    err(f"cpu: {result['cpu']}; steps 2..N of each run, every rank's decode passes")
    for name, table in result["runs"].items():
        err(f"\n{name}")
        err(f"{'rows':>6} {'passes':>6} {'s':>7} {'draft':>6} {'fwd':>7} {'other':>6} {'share':>5} {'ms/pass':>7} "
            f"{'entries':>7} {'accept':>6} {'tok/s':>7} {'spec':>5} {'vs ref':>6}")
        for bucket, a in table.items():
            vs = ref.get(bucket, {}).get("seconds")
            err(f"{bucket:>6} {a['passes']:>6} {a['seconds']:>7.2f} {a['draft_s']:>6.2f} {a['forward_s']:>7.2f} "
                f"{a['other_s']:>6.2f} {a['share']:>5.2f} {a['ms_per_pass']:>7.1f} {a['entries_per_row']:>7.2f} "
                f"{a['accept_len']:>6.2f} {a['tokens_per_s']:>7.1f} {a['speculative_share']:>5.2f} "
                f"{'-' if not vs or name == ref_name else format(vs / a['seconds'], '.2f') + 'x':>6}")
    if args.model:
        import torch

        from engine.checkpoint import load_checkpoint
        from engine.runtime import TargetRuntime
        from engine.sampling import SamplingParams
        from engine.spec import pass_costs

        torch.set_num_threads(1)  # as a torchrun rank decodes (OMP_NUM_THREADS=1)
        model = load_checkpoint(args.model, torch.float32, "cpu")
        model.build_rope_table(1024)
        costs = pass_costs.cached(TargetRuntime(model), SamplingParams(temperature=1.0), args.max_batch, 1 + args.max_len,
                                  context=args.context)
        share = r_gen(args.runs[0])
        result["r_gen"] = round(share, 3)
        result["pass_costs"] = costs.as_dict()
        result["bound"] = {}
        err(f"\npass costs on one thread, ms (rows x entries {list(costs.entries)}):")
        for b, line in zip(costs.rows, costs.seconds):
            err(f"{b:>6} " + " ".join(f"{1e3 * s:>7.1f}" for s in line))
        err(f"bound on {ref_name}'s trace (R_gen {share:.2f}): drafts of per-token acceptance alpha, free to draft, each pass "
            f"at its best chain length (0..{args.max_len})")
        for alpha in (float(a) for a in args.alphas.split(",")):
            r = bound(traces[ref_name], costs, alpha, args.max_len)
            step = 1.0 / (share / r + 1.0 - share)
            result["bound"][str(alpha)] = {"rollout": round(r, 3), "step": round(step, 3)}
            err(f"  alpha {alpha:.2f}: rollout at most {r:.3f}x, step at most {step:.3f}x")
    finish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
