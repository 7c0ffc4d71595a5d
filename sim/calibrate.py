"""`python -m sim.calibrate --from runs/<run>/metrics.jsonl [--out FILE.yaml]`: fit a scenario.

Fits the latency model, accept lengths, prompt length and phase costs of a measured run
(`sim.fit`) and writes them as a complete scenario (default runs/<run>/calibrated.yaml) that
`python -m sim.run --scenario` projects, e.g. with `cluster.devices=[64]`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch.config import save_config
from sim.fit import calibrate
from sim.runs import read_run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="source", required=True, help="runs/<run>/metrics.jsonl or the run folder")
    ap.add_argument("--out", type=Path, help="scenario file to write (default: <run>/calibrated.yaml)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    run = read_run(args.source)
    scn, metrics = calibrate(run)
    out = args.out or run.folder / "calibrated.yaml"
    save_config(scn, out)
    lat = scn.latency
    print(f"calibrated on {run.name}: {len(run.decode_steps)} decode passes, {len(run.rollouts)} rollouts")
    print(f"  forward_s = {lat.base_s:.3g} + {lat.query_s:.3g} * query_tokens + {lat.kv_s:.3g} * kv_tokens "
          f"(R^2 {metrics['calibrate/forward_r2']:.3f})")
    print(f"  draft_s = depth * ({lat.draft_base_s:.3g} + {lat.draft_token_s:.3g} * rows * topk); "
          f"other_s = {lat.other_base_s:.3g} + {lat.other_row_s:.3g} * rows")
    for arm in scn.spec.arms:
        print(f"  accept length {arm.name}: {arm.accept_len:.2f}")
    print(f"  prompt length {scn.rollout.prompt_len}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
