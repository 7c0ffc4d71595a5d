"""One RL step on N devices in the scenario's placement: sim.model.colocated or sim.model.separated."""

from __future__ import annotations

import numpy as np

from sim.config import Scenario
from sim.model.colocated import simulate_colocated_step
from sim.model.latency import LatencyModel, build_latency
from sim.model.parts import StepResult, Techniques
from sim.model.separated import simulate_separated_step


def simulate_step(scn: Scenario, lengths: np.ndarray, devices: int, tech: Techniques,
                  latency: LatencyModel | None = None) -> StepResult:
    """The step for these response lengths ([n], a prompt's samples adjacent) on `devices`, in the
    scenario's placement."""
    latency = latency or build_latency(scn)
    if scn.placement.kind == "separated":
        return simulate_separated_step(scn, lengths, devices, tech, latency)
    return simulate_colocated_step(scn, lengths, devices, tech, latency)
