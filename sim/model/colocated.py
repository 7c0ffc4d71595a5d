"""One RL step in the colocated placement: rollout on every group, then log-probs, training and
sync on the same devices (with `one_step_async`, rollout on a share of the devices overlapping
training on the rest). Built on sim.model.parts. Pure given the lengths.
"""

from __future__ import annotations

import numpy as np

from sim.config import Scenario
from sim.model.latency import LatencyModel
from sim.model.parts import StepResult, Techniques, fill_rollout, phase_times, rollout_parts, trainer_parts


def simulate_colocated_step(scn: Scenario, lengths: np.ndarray, devices: int, tech: Techniques,
                            latency: LatencyModel) -> StepResult:
    """The step for these response lengths ([n], a prompt's samples adjacent) on `devices`."""
    tp = scn.cluster.tensor_parallel
    rollout_devices = _rollout_devices(scn, devices, tech)
    groups, used, fill = fill_rollout(scn, rollout_parts(scn, lengths, rollout_devices // tp, tech), tech, latency)
    rollout_s = max(g.time_s for g in groups)
    trainers = devices - rollout_devices if tech.one_step_async else devices
    logprob_s, update_s, sync_s = phase_times(scn, *trainer_parts(scn, lengths, trainers))
    if tech.one_step_async:
        step_s = max(rollout_s, logprob_s + update_s) + sync_s
    else:
        step_s = rollout_s + logprob_s + update_s + sync_s
    return StepResult(devices=devices, techniques=tech, groups=tuple(groups), tensor_parallel=tp,
                      rollout_s=rollout_s, logprob_s=logprob_s, update_s=update_s, sync_s=sync_s,
                      step_s=step_s, fill=fill, used=used, actor_devices=trainers)


def _rollout_devices(scn: Scenario, devices: int, tech: Techniques) -> int:
    tp = scn.cluster.tensor_parallel
    if not tech.one_step_async:
        return devices
    n = int(round(devices * scn.one_step_async.rollout_share / tp)) * tp
    if not tp <= n <= devices - 1:
        raise ValueError(f"one_step_async: {devices} devices leave no rollout group of {tp} and a trainer "
                         f"with rollout_share={scn.one_step_async.rollout_share}")
    return n
