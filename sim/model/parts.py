"""The parts of one RL step that both placements share (sim.model.colocated, sim.model.separated):
the techniques, the rollout with its bubble filled, and the training phases' cost.

The rollout ends when the slowest group ends; every other group waits at the barrier: that wait
is the *bubble* (idle window) of its devices. Techniques, each switchable:

- spec: the speculation schedule (`sim.model.schedule`) in every group;
- spot: idle devices train the drafter; its accept lengths gain `spot.accept_gain` in full once
  the step offers `spot.required_device_s` idle device-seconds (a proportional part below);
- bubble: idle groups pre-generate the next step's responses at their own decode rate; those
  responses (up to `bubble.coverage` of them) are verified as drafts in the next step;
- one_step_async: rollout on a share of the devices overlaps training on the rest (steady state:
  step = max(rollout, log-prob + update) + sync); colocated, the share is
  `one_step_async.rollout_share`, separated it is the placement's split.
- split: a prompt's samples are dealt to different rollout groups (`sim.model.lengths.split_deal`, the
  RL loop's rollout.split_groups) rather than kept together: a long prompt's samples run side by
  side. It pays as much as a prompt's samples are alike (rollout.lengths.prompt_share) and a
  group's pass costs more with more rows.

Spot training and pre-generation fill the bubble of step t for step t + 1; the model takes the
steady state by iterating the step twice with the previous pass's fill. A group's idle window is
its wait at the rollout barrier plus the placement's *window*: time every rollout group waits
beyond the barrier (none when colocated; the actor's phases when separated). Pre-generation takes
the idle time it needs first, spot training the rest. The training phases follow
`PhaseSpec`: device-seconds per token spread over the trainer ranks, or the RL loop's padded
mini-batches (`padded_tokens`). Pure given the lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from sim.config import PhaseSpec, Scenario
from sim.model.events import GroupRollout, simulate_group
from sim.model.latency import LatencyModel
from sim.model.lengths import deal, row_deal, split_deal
from sim.model.schedule import OFF, Schedule, build_schedule

FILL_ITERATIONS = 2


@dataclass(frozen=True)
class Techniques:
    spec: bool = False
    spot: bool = False
    bubble: bool = False
    one_step_async: bool = False
    split: bool = False

    @property
    def name(self) -> str:
        on = [k for k in ("spec", "spot", "bubble", "one_step_async", "split") if getattr(self, k)]
        return "+".join(on) or "baseline"


@dataclass(frozen=True)
class Fill:
    """What fills each group's idle window [G] seconds, and what it buys the next step."""

    pregen_s: np.ndarray
    spot_s: np.ndarray
    coverage: float  # share of responses with a pre-generated draft
    accept_gain: float  # factor on accepted draft tokens from spot training


NO_FILL = Fill(np.zeros(0), np.zeros(0), 0.0, 1.0)


@dataclass(frozen=True)
class StepResult:
    devices: int
    techniques: Techniques
    groups: tuple[GroupRollout, ...]
    tensor_parallel: int
    rollout_s: float
    logprob_s: float
    update_s: float
    sync_s: float
    step_s: float
    fill: Fill  # what this step's bubble held (pre-generation and spot training for the next)
    used: Fill  # what this step received from the previous step's bubble
    placement: str = "colocated"  # the scenario's placement.kind
    actor_devices: int = 0  # devices that train (colocated synchronous: all of them)
    transfer_s: float = 0.0  # separated: the rollouts' transfer to the actor devices
    window_s: float = 0.0  # idle time of every rollout group beyond the rollout barrier

    @property
    def group_rollout_s(self) -> np.ndarray:  # [G]
        return np.array([g.time_s for g in self.groups])

    @property
    def idle_s(self) -> np.ndarray:  # [G] each group's idle time: its wait at the barrier plus the window
        return self.rollout_s - self.group_rollout_s + self.window_s

    @property
    def idle_share(self) -> np.ndarray:  # [G] share of the step each group's devices idle
        return self.idle_s / self.step_s


def rollout_parts(scn: Scenario, lengths: np.ndarray, groups: int, tech: Techniques) -> list[np.ndarray]:
    """The requests ([n] lengths, a prompt's samples adjacent) each rollout group generates."""
    return split_deal(lengths, groups, scn.rollout.samples_per_prompt) if tech.split else deal(lengths, groups)


def fill_rollout(scn: Scenario, parts: list[np.ndarray], tech: Techniques, latency: LatencyModel,
                 window: Callable[[float], float] = lambda rollout_s: 0.0
                 ) -> tuple[list[GroupRollout], Fill, Fill]:
    """(groups, fill received, fill offered) of a rollout over these parts ([n_g] lengths per
    group) in the steady state of spot training and pre-generation; `window(rollout_s)` is the
    idle time every group has beyond the rollout barrier."""
    base = build_schedule(scn.spec) if tech.spec else OFF
    filling = tech.spot or tech.bubble
    used = NO_FILL
    groups = _rollout(scn, parts, base, used, latency)
    for _ in range(FILL_ITERATIONS if filling else 0):
        used = plan_fill(scn, groups, tech, window(max(g.time_s for g in groups)))
        groups = _rollout(scn, parts, base, used, latency)
    fill = plan_fill(scn, groups, tech, window(max(g.time_s for g in groups))) if filling else NO_FILL
    return groups, used, fill


def _rollout(scn: Scenario, parts: list[np.ndarray], base: Schedule, used: Fill,
             latency: LatencyModel) -> list[GroupRollout]:
    schedule = base.scaled(used.accept_gain) if used.accept_gain != 1.0 else base
    return [simulate_group(p, prompt_len=scn.rollout.prompt_len, max_batch=scn.cluster.max_batch,
                           latency=latency, schedule=schedule, bubble_mask=spread_mask(len(p), used.coverage),
                           bubble=scn.bubble) for p in parts]


def spread_mask(n: int, share: float) -> np.ndarray:
    """[n] bool with round(n * share) True entries spread evenly (deterministic)."""
    i = np.arange(n)
    return np.floor((i + 1) * share + 1e-9) > np.floor(i * share + 1e-9)


def plan_fill(scn: Scenario, groups: list[GroupRollout], tech: Techniques, window_s: float = 0.0) -> Fill:
    """Split each group's idle window (its wait at the barrier + `window_s`) between
    pre-generation (first) and spot training."""
    times = np.array([g.time_s for g in groups])
    idle = times.max() - times + window_s  # [G]
    rate = np.array([g.tokens / g.time_s if g.time_s > 0 else 0.0 for g in groups])  # [G] tokens/s
    pregen = np.zeros_like(idle)
    coverage = 0.0
    if tech.bubble:
        capacity = float((idle * rate).sum())  # tokens the idle windows could generate
        needed = scn.bubble.coverage * sum(g.tokens for g in groups)
        coverage = scn.bubble.coverage * min(1.0, capacity / needed) if needed > 0 else 0.0
        pregen = idle * (min(1.0, needed / capacity) if capacity > 0 else 0.0)
    spot = idle - pregen if tech.spot else np.zeros_like(idle)
    gain = 1.0
    if tech.spot:
        device_s = float(spot.sum()) * scn.cluster.tensor_parallel
        need = scn.spot.required_device_s
        part = 1.0 if need <= 0 else min(1.0, device_s / need)
        gain = 1.0 + (scn.spot.accept_gain - 1.0) * part
    return Fill(pregen_s=pregen, spot_s=spot, coverage=coverage, accept_gain=gain)


def chunks(rows: np.ndarray, k: int) -> list[np.ndarray]:
    """rows cut as torch.Tensor.chunk(k) cuts them: ceil(n / k) per chunk, the last one shorter."""
    size = -(-len(rows) // k) if len(rows) else 1
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def micro_padded(lengths: np.ndarray, budget: int) -> float:
    """Padded tokens of one rank's mini-batch of rows with these lengths (prompt + response) as
    the actor cuts it (pipeline/actors/forward.micro_batches): longest first, a micro-batch takes
    rows while rows x its longest <= budget and is padded to its longest row; budget 0: one
    micro-batch."""
    if len(lengths) == 0:
        return 0.0
    if budget <= 0:
        return float(len(lengths) * lengths.max())
    order = np.sort(lengths)[::-1]
    padded, start = 0.0, 0
    for i in range(1, len(order) + 1):
        if i == len(order) or (i - start + 1) * order[start] > budget:
            padded += (i - start) * float(order[start])
            start = i
    return padded


def padded_tokens(phases: PhaseSpec, parts: list[np.ndarray], prompt_len: int,
                  cut: list[list[np.ndarray]] | None = None) -> tuple[float, float]:
    """(the largest rank's real tokens, one epoch's padded tokens) of ranks holding these
    responses ([n_r] lengths in batch order each): every rank cuts its rows into
    `phases.mini_batches` mini-batches (`cut`: [rank][mini-batch] rows as a run's records name
    them; else even chunks of each rank's rows), each into micro-batches (`micro_padded`), and a
    mini-batch waits for its largest rank."""
    real = max(float(p.sum()) + len(p) * prompt_len for p in parts)
    cut = cut if cut is not None else [chunks(p, phases.mini_batches) for p in parts]
    padded = 0.0
    for i in range(max(len(c) for c in cut)):
        padded += max((micro_padded(c[i] + prompt_len, phases.micro_batch_tokens) for c in cut if i < len(c)),
                      default=0.0)
    return real, padded


def trainer_parts(scn: Scenario, lengths: np.ndarray, trainers: int) -> tuple[list[np.ndarray], list[list[np.ndarray]] | None]:
    """(each trainer rank's responses, their [rank][mini-batch] cut or None) for the step's lengths:
    the token shares' row deal where `phases.row_deal` (with mini-batches), else contiguous shards."""
    ph = scn.phases
    if ph.mini_batches and ph.row_deal:
        cut = row_deal(lengths, trainers, scn.rollout.samples_per_prompt, ph.mini_batches)
        return [np.concatenate(c) for c in cut], cut
    return deal(lengths, trainers), None


def phase_times(scn: Scenario, parts: list[np.ndarray],
                cut: list[list[np.ndarray]] | None = None) -> tuple[float, float, float]:
    """(log-prob, update, weight-sync) seconds of a colocated step whose trainer ranks (one per
    device) hold these responses ([n_r] lengths each; `cut`: their mini-batches, padded_tokens)."""
    return (*train_times(scn, parts, cut), colocated_sync_s(scn))


def train_times(scn: Scenario, parts: list[np.ndarray],
                cut: list[list[np.ndarray]] | None = None) -> tuple[float, float]:
    """(log-prob, update) seconds of trainer ranks (one per device) holding these responses
    (`cut`: their mini-batches, padded_tokens)."""
    ph = scn.phases
    prompt = scn.rollout.prompt_len
    lp, up = ph.logprob_s_per_token, ph.update_s_per_token
    if lp is None or up is None:
        per_flop = 1.0 / (scn.hardware.tflops * 1e12 * ph.mfu)
        lp = 2 * scn.model.active_b * 1e9 * per_flop if lp is None else lp
        up = 6 * scn.model.active_b * 1e9 * per_flop if up is None else up
    if ph.mini_batches:
        real, padded = padded_tokens(ph, parts, prompt, cut)
        return lp * real * ph.logprob_passes, up * padded * ph.ppo_epochs * ph.update_share
    tokens = float(sum(p.sum() for p in parts)) + sum(len(p) for p in parts) * prompt
    devices = len(parts)
    return lp * tokens * ph.logprob_passes / devices, up * tokens * ph.ppo_epochs * ph.update_share / devices


def shard_bytes(scn: Scenario) -> float:
    """Weight bytes one device of a rollout group holds: all parameters over tensor_parallel."""
    return scn.model.params_b * 1e9 * scn.model.bytes_per_param / scn.cluster.tensor_parallel


def colocated_sync_s(scn: Scenario) -> float:
    """The weights' way from the actor to the engine on the same device: measured, or a shard
    over `phases.sync_gbps`."""
    if scn.phases.sync_s is not None:
        return scn.phases.sync_s
    return shard_bytes(scn) / (scn.phases.sync_gbps * 1e9)
