"""`python -m sim.calibrate --from runs/<run>/metrics.jsonl [--plain runs/<run0>] [--out FILE.yaml]`: fit a scenario.

Fits the latency model, accept lengths, prompt length and phase costs of a measured run
(`sim.calibration.fit`; with `--plain`, a run of the same model on the same machine without a drafter joins
the latency fit, so that a drafter-less engine's passes are priced as measured) and writes them as a complete scenario (default runs/<run>/calibrated.yaml) that
`python -m sim.run --scenario` projects, e.g. with `cluster.devices=[64]`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.config import save_config
from sim.calibration.fit import calibrate
from sim.calibration.runs import read_run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="source", required=True, help="runs/<run>/metrics.jsonl or the run folder")
    ap.add_argument("--plain", help="a run without a drafter (engine.spec.enabled=false), same model and machine")
    ap.add_argument("--out", type=Path, help="scenario file to write (default: <run>/calibrated.yaml)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    run = read_run(args.source)
    scn, metrics = calibrate(run, read_run(args.plain) if args.plain else None)
    out = args.out or run.folder / "calibrated.yaml"
    save_config(scn, out)
    lat = scn.latency
    print(f"calibrated on {run.name}: {metrics['calibrate/decode_passes']:.0f} decode passes after the warm-up, "
          f"{len(run.rollouts)} rollouts")
    print(f"  forward_s = {lat.base_s:.3g} + {lat.query_s:.3g} * query_tokens + {lat.kv_s:.3g} * kv_tokens "
          f"+ {lat.attn_s:.3g} * query_tokens x context "
          f"(R^2 {metrics['calibrate/forward_r2']:.3f}), as a table of {len(lat.table_tokens)} points over "
          f"{min(lat.table_tokens, default=0):.0f}-{max(lat.table_tokens, default=0):.0f} query tokens")
    print(f"  draft_s = depth * ({lat.draft_base_s:.3g} + {lat.draft_token_s:.3g} * rows * topk); "
          f"other_s = {lat.other_base_s:.3g} + {lat.other_row_s:.3g} * rows + {lat.other_verify_s:.3g} * verified"
          f" + {lat.other_drafter_s:.3g} with a drafter")
    prefill = "one forward pass" if lat.prefill_token_s is None else f"{lat.prefill_token_s:.3g} s per prompt token"
    ph = scn.phases
    unit = "per padded token of the largest rank" if ph.mini_batches else "device-seconds per token"
    print(f"  prefill {prefill}; update {ph.update_s_per_token:.3g} {unit} ({ph.mini_batches or 'no'} mini-batches), "
          f"log-prob {ph.logprob_s_per_token:.3g}, sync {ph.sync_s:.3g} s; "
          f"{metrics['calibrate/timed_steps']:.0f} timed steps after the warm-up")
    for arm in scn.spec.arms:
        print(f"  accept length {arm.name}: {arm.accept_len:.2f}")
    print(f"  prompt length {scn.rollout.prompt_len}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
