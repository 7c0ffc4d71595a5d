"""Colocated against separated: the same scenario in both placements, on the same lengths.

Every row is a (device count, layout, techniques) with its step time and its step speedup over
the *colocated baseline* (synchronous, no speculation) on the same devices and lengths (common
random numbers, as in `sim.projection.project`). Layouts:

- `colocated`: every device rolls out, then trains (TLT's layout), synchronous;
- `separated`: `actor_share` of the devices train, the rest roll out, synchronous;
- `separated+async`: the same split, the rollout of step t+1 overlapping the update of step t.

Techniques: `baseline` (no speculation) and `spec+spot` (the scenario's speculation schedule, its
drafter trained by the spot pool in the rollout devices' idle time). A separated layout is
projected at every share of `sweep.actor_shares` that leaves a rollout group; `best` keeps the
fastest share of each. The rollout devices' idle share counts their wait at the rollout barrier
and, separated, the transfer and the actor phase they wait through (what the spot pool can use).

`python -m sim.placement --scenario FILE [--png PATH] [key=value ...]` prints the tables as
Markdown; --png draws the figure at PATH and, beside it (PATH's stem + `_timeline`), one
separated step of spec+spot at the scenario's actor share and largest device count.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from common.config import override_args
from sim.config import Scenario, load_scenario
from sim.model.latency import build_latency
from sim.projection.plots import plot_placement, plot_timeline
from sim.projection.project import simulate_steps
from sim.model.separated import device_split
from sim.model.parts import Techniques

TECHNIQUES = {"baseline": Techniques(), "spec+spot": Techniques(spec=True, spot=True)}
LAYOUTS = ("colocated", "separated", "separated+async")


@dataclass(frozen=True)
class PlacementRow:
    devices: int
    layout: str  # one of LAYOUTS
    combo: str  # a key of TECHNIQUES
    actor_devices: int  # devices that train (colocated: all)
    rollout_s: float
    step_s: float
    speedup: float  # colocated baseline's step time / this step time
    rollout_idle_share: float  # mean over rollout groups and steps of idle time / step time
    spot_gain: float  # spot training's factor on accepted draft tokens


def layout_scenario(scn: Scenario, layout: str, actor_share: float | None = None) -> Scenario:
    """The scenario in this layout (and actor share, for the separated ones)."""
    kind = "colocated" if layout == "colocated" else "separated"
    share = scn.placement.actor_share if actor_share is None else actor_share
    return replace(scn, placement=replace(scn.placement, kind=kind, actor_share=share))


def layout_techniques(layout: str, combo: str) -> Techniques:
    return replace(TECHNIQUES[combo], one_step_async=layout == "separated+async")


def valid_shares(scn: Scenario, devices: int) -> list[float]:
    """The shares of `sweep.actor_shares` that leave at least one rollout group on `devices`."""
    return [share for share in scn.sweep.actor_shares
            if device_split(layout_scenario(scn, "separated", share), devices) is not None]


def compare(scn: Scenario, devices: list[int] | None = None) -> list[PlacementRow]:
    """Rows for every device count, layout, technique and (separated) actor share."""
    latency = build_latency(scn)
    rows = []
    for n in devices or scn.cluster.devices:
        colocated = layout_scenario(scn, "colocated")
        base_step = float(np.mean([r.step_s for r in simulate_steps(colocated, n, Techniques(), latency)]))
        cases = [(colocated, "colocated")]
        cases += [(layout_scenario(scn, layout, share), layout)
                  for layout in LAYOUTS[1:] for share in valid_shares(scn, n)]
        for case, layout in cases:
            for combo in TECHNIQUES:
                steps = simulate_steps(case, n, layout_techniques(layout, combo), latency)
                step_s = float(np.mean([r.step_s for r in steps]))
                rows.append(PlacementRow(
                    devices=n, layout=layout, combo=combo, actor_devices=steps[0].actor_devices,
                    rollout_s=float(np.mean([r.rollout_s for r in steps])), step_s=step_s,
                    speedup=base_step / step_s,
                    rollout_idle_share=float(np.mean([r.idle_share.mean() for r in steps])),
                    spot_gain=float(np.mean([r.used.accept_gain for r in steps]))))
    return rows


def best(rows: list[PlacementRow]) -> list[PlacementRow]:
    """The fastest row of each (devices, layout, combo): the best actor share of a separated layout."""
    out: dict[tuple[int, str, str], PlacementRow] = {}
    for r in rows:
        key = (r.devices, r.layout, r.combo)
        if key not in out or r.step_s < out[key].step_s:
            out[key] = r
    return list(out.values())


def summary_table(rows: list[PlacementRow]) -> str:
    head = ("| devices | layout | actor devices | techniques | rollout s | step s | step speedup | "
            "rollout devices idle | spot gain |\n|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {r.devices} | {r.layout} | {r.actor_devices} | {r.combo} | {r.rollout_s:.1f} | {r.step_s:.1f} "
             f"| {r.speedup:.2f}x | {r.rollout_idle_share:.0%} | {r.spot_gain:.2f} |" for r in best(rows)]
    return "\n".join([head, *lines])


def share_table(rows: list[PlacementRow], devices: int, combo: str = "spec+spot") -> str:
    """Step speedup over the colocated baseline against the actor devices, at one device count."""
    sep = [r for r in rows if r.devices == devices and r.combo == combo and r.layout != "colocated"]
    actors = sorted({r.actor_devices for r in sep})
    head = "| layout | " + " | ".join(f"{a} actors" for a in actors) + " |"
    lines = [head, "|---|" + "---|" * len(actors)]
    for layout in LAYOUTS[1:]:
        by_actor = {r.actor_devices: r.speedup for r in sep if r.layout == layout}
        lines.append(f"| {layout} | " + " | ".join(f"{by_actor[a]:.2f}x" if a in by_actor else "-" for a in actors) + " |")
    return "\n".join(lines)


def placement_report(scn: Scenario, png: Path | None = None) -> str:
    rows = compare(scn)
    ref = max(scn.cluster.devices)
    text = "\n".join([f"### {scn.name}: colocated against separated", "",
                      "Best actor share per layout (step speedup over the colocated baseline on the same devices):",
                      "", summary_table(rows), "",
                      f"Step speedup of spec+spot against the actor devices, {ref} devices:", "",
                      share_table(rows, ref)]) + "\n"
    if png is not None:
        plot_placement(best(rows), [r for r in rows if r.devices == ref], png,
                       f"{scn.name}: colocated against separated placement")
        separated = layout_scenario(scn, "separated")
        step = simulate_steps(separated, ref, TECHNIQUES["spec+spot"])[0]
        plot_timeline(step, png.with_name(f"{png.stem}_timeline.png"),
                      f"{scn.name}, {ref} devices, separated ({step.actor_devices} actor devices), spec + spot: one step")
    return text


def main(argv: list[str] | None = None) -> int:
    overrides, rest = override_args(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m sim.placement", description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", required=True, help="a sim/scenarios/*.yaml file (its placement section sets "
                                                      "the separated layout's bandwidths)")
    ap.add_argument("--png", type=Path, help="write the figure here")
    args = ap.parse_args(rest)
    print(placement_report(load_scenario(args.scenario, overrides), args.png), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
