"""`python -m sim.run --scenario FILE [--out DIR] [--checks] [key=value ...]`: project a scenario.

Prints the Markdown report (projection table, accept-length sweep, and with --checks the trend
checks); with --out also writes it as DIR/<scenario>.md with its PNGs beside it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.atomic import atomic_file
from common.config import override_args
from sim.config import load_scenario
from sim.projection.report import scenario_report


def main(argv: list[str] | None = None) -> int:
    overrides, rest = override_args(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m sim.run", description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", required=True, help="a sim/scenarios/*.yaml file")
    ap.add_argument("--out", type=Path, help="folder for the report and its PNGs")
    ap.add_argument("--checks", action="store_true", help="also run the trend checks (slower)")
    args = ap.parse_args(rest)
    scn = load_scenario(args.scenario, overrides)
    text = scenario_report(scn, args.out, checks=args.checks)
    if args.out is not None:
        with atomic_file(args.out / f"{scn.name}.md") as f:
            f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
