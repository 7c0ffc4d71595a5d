"""`python -m sim.validate --calibrate-on RUN [--plain RUN0] --predict RUN2 [RUN3 ...] [--tolerance 0.15]`.

Calibrates on RUN (with RUN0, a run without a drafter, in the latency fit: `sim.calibrate --plain`), replays each step of RUN itself (the fit's own error, the first row) and of
every predicted run (`sim.calibration.validation`), prints the errors as a Markdown table, and exits 1 when
a predicted run's rollout, step or step-speedup error exceeds the tolerance.
"""

from __future__ import annotations

import argparse
import sys

from sim.calibration.fit import calibrate
from sim.calibration.runs import read_run
from sim.calibration.validation import TOLERANCE, report_table, validate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.validate", description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate-on", required=True, help="run folder (or its metrics.jsonl) to fit")
    ap.add_argument("--plain", help="a run of the same model without a drafter (engine.spec.enabled=false), to price "
                                    "drafter-less passes as measured")
    ap.add_argument("--predict", required=True, nargs="+", help="run folders whose timings to predict")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE, help="largest mean relative error")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    base = read_run(args.calibrate_on)
    scn, _ = calibrate(base, read_run(args.plain) if args.plain else None)
    own = validate(scn, base, calibrated_on=base.name)
    reports = [validate(scn, read_run(p), calibrated_on=base.name, reference=own) for p in args.predict]
    print(report_table([own, *reports], args.tolerance))
    return 0 if all(r.passed(args.tolerance) for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
