"""`python -m engine.kernels --report [--retune] [--json]`: the host, the kernels' tuned
parameters and their kernel-vs-torch table (engine/kernels/report.py). `--retune` drops this
host's cached tuning first (do it on a quiet machine: the choice is only as good as the timings)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from engine.omp import openmp_default


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.kernels", description=__doc__.splitlines()[0])
    p.add_argument("--report", action="store_true", help="print the report (the default action)")
    p.add_argument("--retune", action="store_true", help="measure again, ignoring this host's cached tuning")
    p.add_argument("--threads", type=int, default=None, help="torch / kernel threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = p.parse_args(argv)
    openmp_default()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.retune:
        os.environ["TAILSPEC_CPU_TUNE"] = "force"
    from engine.kernels.report import report, text

    r = report()
    print(json.dumps(r, sort_keys=True) if args.json else text(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
