"""One RL step in the separated placement: actor devices train, rollout devices generate.

`placement.actor_share` of the devices train (the *actor* devices); the rest form rollout groups
of `cluster.tensor_parallel` devices. A synchronous step is

    rollout (rollout devices) -> transfer (rollouts to the actors) -> log-probs + update (actor
    devices) -> weight push (actors to every rollout device)

and the rollout devices' idle window is their wait at the rollout barrier plus the transfer and
the whole actor phase: the spot pool (drafter training) and pre-generation fill it, as in the
colocated step (`sim.model.parts.plan_fill`). In the one-step asynchronous mode the rollout of step t+1
overlaps the actor phase of step t:

    step = max(rollout + transfer, log-probs + update) + push

and a rollout group waits beyond the barrier only while the actors are still busy (or the
transfer runs). The actor devices idle while the rollout runs; they hold no DataBuffer and train
no drafter. The push sends each rollout device its weight shard (all parameters over
tensor_parallel) over `placement.sync_gbps`; the transfer sends every rollout token's id and
engine log-prob over `placement.transfer_gbps`. Pure given the lengths.
"""

from __future__ import annotations

import numpy as np

from sim.config import Scenario
from sim.model.latency import LatencyModel
from sim.model.parts import StepResult, Techniques, fill_rollout, rollout_parts, shard_bytes, train_times, trainer_parts


def device_split(scn: Scenario, devices: int) -> tuple[int, int] | None:
    """(actor devices, rollout devices): `placement.actor_share` of the devices rounded to whole
    devices (at least one), the rest rounded down to whole rollout groups (the remainder trains);
    None when no rollout group is left."""
    tp = scn.cluster.tensor_parallel
    actors = max(1, int(round(devices * scn.placement.actor_share)))
    rollout = (devices - actors) // tp * tp
    return (devices - rollout, rollout) if rollout >= tp else None


def split_devices(scn: Scenario, devices: int) -> tuple[int, int]:
    """`device_split`, raising when it leaves no rollout group."""
    split = device_split(scn, devices)
    if split is None:
        tp = scn.cluster.tensor_parallel
        raise ValueError(f"placement.actor_share={scn.placement.actor_share}: {devices} devices leave fewer than "
                         f"one rollout group of cluster.tensor_parallel={tp}; lower placement.actor_share or "
                         "project more devices (cluster.devices)")
    return split


def push_sync_s(scn: Scenario) -> float:
    """Seconds to push the updated weights to the rollout devices: a shard each, in parallel."""
    return shard_bytes(scn) / (scn.placement.sync_gbps * 1e9)


def transfer_s(scn: Scenario, lengths: np.ndarray) -> float:
    """Seconds to send a step's rollouts (prompt + response tokens) to the actor devices."""
    tokens = float(np.sum(lengths)) + len(lengths) * scn.rollout.prompt_len
    return tokens * scn.placement.transfer_bytes_per_token / (scn.placement.transfer_gbps * 1e9)


def simulate_separated_step(scn: Scenario, lengths: np.ndarray, devices: int, tech: Techniques,
                            latency: LatencyModel) -> StepResult:
    """The step for these response lengths ([n], a prompt's samples adjacent) on `devices`."""
    tp = scn.cluster.tensor_parallel
    actors, rollout_devices = split_devices(scn, devices)
    logprob_s, update_s = train_times(scn, *trainer_parts(scn, lengths, actors))
    actor_s = logprob_s + update_s
    move_s = transfer_s(scn, lengths)
    if tech.one_step_async:
        def window(rollout_s: float) -> float:
            return max(move_s, actor_s - rollout_s)
    else:
        def window(rollout_s: float) -> float:
            return move_s + actor_s
    groups, used, fill = fill_rollout(scn, rollout_parts(scn, lengths, rollout_devices // tp, tech), tech, latency,
                                      window)
    rollout_s = max(g.time_s for g in groups)
    sync_s = push_sync_s(scn)
    step_s = rollout_s + window(rollout_s) + sync_s
    return StepResult(devices=devices, techniques=tech, groups=tuple(groups), tensor_parallel=tp,
                      rollout_s=rollout_s, logprob_s=logprob_s, update_s=update_s, sync_s=sync_s,
                      step_s=step_s, fill=fill, used=used, placement="separated", actor_devices=actors, transfer_s=move_s,
                      window_s=window(rollout_s))
