"""Which assumptions move a projection: the step speedup with one scenario key changed at a time.

`python -m sim.sensitivity --scenario FILE [--vary=key=value ...] [--devices 8 64] [--split] [key=value ...]`
prints one Markdown row per variation (the scenario itself first): the step speedup of each
technique over the baseline at each device count (spec and spec+spot; with --split also
spec+spot+split, which acts only where a prompt's samples are alike:
`--vary=rollout.lengths.prompt_share=0.75`). A variation is a dotted override applied on
top of the scenario's own (`phases.mfu=0.2`, `rollout.lengths.sigma=0.6`); `scale:R` as a value
of `rollout.prompts` keeps R rows per device instead of the scenario's fixed global batch (the
prompts grow with the devices). Nothing here changes how a step is simulated.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from common.config import override_args
from sim.config import Scenario, load_scenario
from sim.projection.project import COMBOS, SPLIT_COMBOS, project

TECHNIQUES = ("spec", "spec+spot")
WITH_SPLIT = (*TECHNIQUES, "spec+spot+split")
SCALE = "scale:"


def speedups(scn: Scenario, devices: list[int], rows_per_device: int | None = None,
             techniques: tuple[str, ...] = TECHNIQUES) -> dict[tuple[int, str], float]:
    """(devices, technique) -> step speedup over the baseline; `rows_per_device` scales the batch."""
    every = {**COMBOS, **SPLIT_COMBOS}
    combos = {name: every[name] for name in ("baseline", *techniques)}
    out = {}
    for n in devices:
        case = scn
        if rows_per_device is not None:
            prompts = max(1, rows_per_device * n // scn.rollout.samples_per_prompt)
            case = replace(scn, rollout=replace(scn.rollout, prompts=prompts))
        for row in project(case, combos, [n]):
            if row.combo in techniques:
                out[(n, row.combo)] = row.step_speedup
    return out


def variation_rows(path: str, overrides: list[str], vary: list[str], devices: list[int],
                   techniques: tuple[str, ...] = TECHNIQUES) -> str:
    head = "| variation | " + " | ".join(f"{t} @ {n}" for t in techniques for n in devices) + " |"
    lines = [head, "|---|" + "---|" * (len(techniques) * len(devices))]
    for v in ["", *vary]:
        rows = None
        extra = [v] if v else []
        if v.startswith("rollout.prompts=" + SCALE):
            rows, extra = int(v.split(SCALE, 1)[1]), []
        scn = load_scenario(path, [*overrides, *extra])
        s = speedups(scn, devices, rows, techniques)
        name = v or "as in the scenario"
        lines.append(f"| {name} | " + " | ".join(f"{s[(n, t)]:.2f}x" for t in techniques for n in devices) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    overrides, rest = override_args(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m sim.sensitivity", description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--vary", action="append", default=[],
                    help="--vary=key=value: a dotted override to try alone (repeatable)")
    ap.add_argument("--devices", type=int, nargs="+", help="device counts (default: the scenario's)")
    ap.add_argument("--split", action="store_true", help="also spec+spot+split (split groups)")
    args = ap.parse_args(rest)
    devices = args.devices or load_scenario(args.scenario, overrides).cluster.devices
    print(variation_rows(args.scenario, overrides, args.vary, devices, WITH_SPLIT if args.split else TECHNIQUES), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
