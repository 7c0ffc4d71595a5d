"""The scenario file (`sim/scenarios/*.yaml`): typed sections of one simulated RL setup.

A scenario names the model and the hardware (for the roofline latency model) or carries a fitted
latency model (from `sim.calibrate`), the cluster (device counts to project, tensor-parallel
size per rollout group), the rollout batch and its response-length distribution, the
speculation arms and the schedule that picks among them by active batch size, the two ways of
filling the bubble (spot training of the drafter, pre-generation of the next step's drafts),
the non-rollout phases of a step, the one-step asynchronous mode, and the placement (every
device rolls out and trains, or separate actor and rollout devices).

Loaded with `common.config.load_config`: unknown keys and bad values raise `ValueError` naming
the dotted key. `load_scenario` also resolves relative paths against the scenario's folder.
This module knows nothing about how a step is simulated.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from common.config import load_config


@dataclass(kw_only=True)
class ModelSpec:
    name: str = "model"
    params_b: float  # all parameters, billions
    active_params_b: float | None = None  # parameters used per token (MoE); None = dense
    experts: int = 0  # MoE: routed experts per layer, and how many each token uses
    experts_per_token: int = 0
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    bytes_per_param: float = 2.0  # bf16 weights and KV cache

    def validate(self) -> None:
        for key in ("params_b", "layers", "q_heads", "kv_heads", "head_dim", "bytes_per_param"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model.{key} must be > 0, got {getattr(self, key)}")
        if self.active_params_b is not None:
            if not 0 < self.active_params_b <= self.params_b:
                raise ValueError(f"model.active_params_b must be in (0, params_b], got {self.active_params_b}")
            if not 0 < self.experts_per_token < self.experts:
                raise ValueError("model.active_params_b (MoE) needs model.experts > model.experts_per_token > 0")

    def touched_b(self, tokens: float) -> float:
        """Parameters (billions) a pass over `tokens` tokens reads: all of a dense model; for MoE
        the shared part plus the expected share of experts that at least one token routes to
        (tokens route independently and uniformly, k of E experts each)."""
        if self.active_params_b is None:
            return self.params_b
        share = self.experts_per_token / self.experts
        experts_b = (self.params_b - self.active_params_b) / (1 - share)
        shared_b = self.params_b - experts_b
        return shared_b + experts_b * (1 - (1 - share) ** max(tokens, 1.0))

    @property
    def active_b(self) -> float:
        return self.params_b if self.active_params_b is None else self.active_params_b

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


@dataclass(kw_only=True)
class HardwareSpec:
    name: str = "gpu"
    hbm_tbps: float  # peak memory bandwidth, TB/s
    tflops: float  # peak dense bf16, TFLOP/s
    bandwidth_efficiency: float = 0.8  # share of peak bandwidth a decode step reaches
    flops_efficiency: float = 0.6  # share of peak FLOP/s a large verify / prefill reaches
    step_overhead_s: float = 1e-4  # per forward pass: launches, sampling, TP all-reduces

    def validate(self) -> None:
        for key in ("hbm_tbps", "tflops"):
            if getattr(self, key) <= 0:
                raise ValueError(f"hardware.{key} must be > 0, got {getattr(self, key)}")
        for key in ("bandwidth_efficiency", "flops_efficiency"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"hardware.{key} must be in (0, 1], got {getattr(self, key)}")


@dataclass(kw_only=True)
class LatencySpec:
    """`roofline` (from model + hardware) or `fitted` (coefficients from `sim.calibrate`).

    fitted, per pass of a group:
    - forward_s = base_s + query_s * query_tokens + kv_s * kv_tokens + attn_s * query_tokens *
      mean context (the cached KV read once per row, and each computed token's scores over its
      row's context: a verify pass of 1 + v tokens per row pays the second 1 + v times), where a
      measured table (`table_tokens`, ascending, and `table_s`: the forward seconds less the kv
      and attention terms at those query-token counts) replaces the first two terms when present:
      linear interpolation between its points, and the slope query_s beyond its ends;
    - draft_s = depth * (draft_base_s + draft_token_s * rows * topk);
    - other_s = other_base_s + other_row_s * rows + other_verify_s * (query_tokens - rows)
      (sampling and emission per row; verification and KV commit per verified draft token), plus
      other_drafter_s on every pass of an engine with a drafter loaded ("off" passes included:
      the drafter follows the target's features); `sim.calibrate --plain` fits it from a run
      without a drafter, else it is 0 and other_base_s holds it, so a drafter-less run is
      predicted with the drafter's bookkeeping;
    - prefill: prefill_token_s per prompt token admitted (the prefill pass and the admission's
      bookkeeping, measured); None charges one forward pass over the prompts instead.
    """

    kind: Literal["roofline", "fitted"] = "roofline"
    base_s: float = 0.0
    query_s: float = 0.0
    kv_s: float = 0.0
    attn_s: float = 0.0  # per (computed token, cached context token) pair
    table_tokens: list[float] = field(default_factory=list)
    table_s: list[float] = field(default_factory=list)
    draft_base_s: float = 0.0
    draft_token_s: float = 0.0
    other_base_s: float = 0.0
    other_row_s: float = 0.0
    other_verify_s: float = 0.0
    other_drafter_s: float = 0.0
    prefill_token_s: float | None = None

    def validate(self) -> None:
        if len(self.table_tokens) != len(self.table_s):
            raise ValueError(f"latency.table_tokens ({len(self.table_tokens)} points) and latency.table_s "
                             f"({len(self.table_s)}) must have the same length")
        if any(b <= a for a, b in zip(self.table_tokens, self.table_tokens[1:])):
            raise ValueError("latency.table_tokens must increase strictly")


@dataclass(kw_only=True)
class ClusterSpec:
    devices: list[int]  # device counts to project; the first is the reference for tables
    tensor_parallel: int = 1  # devices per rollout group (one engine)
    max_batch: int = 256  # rows a group decodes at once; more requests wait in its queue

    def validate(self) -> None:
        if not self.devices:
            raise ValueError("cluster.devices must list at least one device count")
        for n in self.devices:
            if n < self.tensor_parallel or n % self.tensor_parallel:
                raise ValueError(
                    f"cluster.devices: {n} is not a multiple of cluster.tensor_parallel={self.tensor_parallel}")
        if self.max_batch < 1:
            raise ValueError(f"cluster.max_batch must be >= 1, got {self.max_batch}")


@dataclass(kw_only=True)
class LengthSpec:
    """Response lengths: `lognormal` (median, sigma, clipped at max_len) or `empirical` (a
    rollouts.jsonl whose `length` fields are resampled with replacement).

    How alike a prompt's samples are decides what splitting its group across rollout groups buys
    (`Techniques.split`): `prompt_share` is the share of the lognormal's log-length variance that
    lies between prompts (0: every response drawn alone; 1: a prompt's samples equally long), and
    `by_prompt` resamples an empirical file's whole groups (one prompt's samples in one step) so
    they keep the run's likeness; with `stratified` too, a step of P prompts takes one group from
    each of P strata of the file's groups by mean length, as the RL loop's stratified prompt order
    (trainer.prompt_order=stratified) gives every step the set's spread.
    """

    kind: Literal["lognormal", "empirical"] = "lognormal"
    median: float = 1000.0
    sigma: float = 1.0
    max_len: int = 8192
    path: str | None = None
    prompt_share: float = 0.0
    by_prompt: bool = False
    stratified: bool = False

    def validate(self) -> None:
        if self.kind == "empirical" and not self.path:
            raise ValueError("rollout.lengths.kind=empirical needs rollout.lengths.path (a rollouts.jsonl)")
        if self.median <= 0 or self.sigma < 0 or self.max_len < 1:
            raise ValueError("rollout.lengths: median > 0, sigma >= 0 and max_len >= 1 are required")
        if not 0.0 <= self.prompt_share <= 1.0:
            raise ValueError(f"rollout.lengths.prompt_share must be in [0, 1], got {self.prompt_share}")
        if self.prompt_share and self.kind != "lognormal":
            raise ValueError("rollout.lengths.prompt_share shapes the lognormal draw; an empirical file keeps its "
                             "run's likeness with rollout.lengths.by_prompt=true")
        if self.by_prompt and self.kind != "empirical":
            raise ValueError("rollout.lengths.by_prompt resamples an empirical file's groups; a lognormal draw sets "
                             "rollout.lengths.prompt_share instead")
        if self.stratified and not self.by_prompt:
            raise ValueError("rollout.lengths.stratified draws an empirical file's groups by stratum: it needs "
                             "rollout.lengths.kind=empirical and by_prompt=true")


@dataclass(kw_only=True)
class RolloutSpec:
    prompts: int  # prompts per RL step
    samples_per_prompt: int = 1
    prompt_len: int = 256
    lengths: LengthSpec = field(default_factory=LengthSpec)

    @property
    def requests(self) -> int:
        return self.prompts * self.samples_per_prompt


@dataclass(kw_only=True)
class ArmSpec:
    name: str  # e.g. d3k1v3 (depth, topk, verify tokens), the engine's shape name
    depth: int
    topk: int = 1
    verify_tokens: int
    accept_len: float  # mean tokens emitted per row per verify step, bonus included (>= 1)

    def validate(self) -> None:
        if min(self.depth, self.topk, self.verify_tokens) < 1:
            raise ValueError(f"spec arm {self.name}: depth, topk and verify_tokens must be >= 1")
        if not 1.0 <= self.accept_len <= self.verify_tokens + 1:
            raise ValueError(
                f"spec arm {self.name}: accept_len must be in [1, verify_tokens + 1], got {self.accept_len}")


@dataclass(kw_only=True)
class BucketSpec:
    max_batch: int  # this bucket holds active batch sizes up to here (above the previous one)
    arm: str  # an arm name, or "off"


@dataclass(kw_only=True)
class SpecSpec:
    """`always` runs `arm`; `threshold` runs it only while the active batch <= threshold (TLT's
    adaptive switch); `buckets` picks per batch-size bucket (the tuner's learned schedule), off
    above the last bucket."""

    arms: list[ArmSpec] = field(default_factory=list)
    schedule: Literal["always", "threshold", "buckets"] = "threshold"
    arm: str | None = None
    threshold: int = 32
    buckets: list[BucketSpec] = field(default_factory=list)
    draft_params_b: float = 0.0  # drafter weights read per draft level (roofline), billions

    def validate(self) -> None:
        names = [a.name for a in self.arms]
        wanted = [self.arm] if self.schedule != "buckets" else [b.arm for b in self.buckets]
        for name in (n for n in wanted if n is not None):
            if name != "off" and name not in names:
                raise ValueError(f"spec: arm {name!r} is not among spec.arms ({', '.join(names) or 'none'})")
        bounds = [b.max_batch for b in self.buckets]
        if bounds != sorted(set(bounds)):
            raise ValueError(f"spec.buckets: max_batch must increase strictly, got {bounds}")

    def arm_named(self, name: str) -> ArmSpec:
        return next(a for a in self.arms if a.name == name)


@dataclass(kw_only=True)
class SpotSpec:
    # Spot training multiplies the accepted draft tokens per step (accept_len - 1) by this.
    accept_gain: float = 1.0
    # Idle device-seconds per step the full gain needs; less idle time gives a proportional part.
    required_device_s: float = 0.0


@dataclass(kw_only=True)
class BubbleSpec:
    # Share of the next step's responses that get a pre-generated draft (at most what the idle
    # window can generate at the ranks' own decode rate).
    coverage: float = 0.5
    depth: int = 16  # draft tokens verified per row and step from a pre-generated response
    accept_len: float = 8.0  # tokens emitted per verify step on such a row

    def validate(self) -> None:
        if not 0 <= self.coverage <= 1:
            raise ValueError(f"bubble.coverage must be in [0, 1], got {self.coverage}")
        if not 1 <= self.accept_len <= self.depth + 1:
            raise ValueError(f"bubble.accept_len must be in [1, depth + 1], got {self.accept_len}")


@dataclass(kw_only=True)
class PhaseSpec:
    """Log-prob, training and weight-sync phases. Per-token costs are device-seconds per token
    (prompt + response); None derives them from the model: 2 (log-prob) or 6 (training) x active
    params x tokens / (peak FLOP/s x mfu)."""

    mfu: float = 0.4
    logprob_passes: int = 1  # forward passes for old (and reference) log-probs
    ppo_epochs: int = 1
    # 0: the per-token costs are device-seconds per real token, spread over the devices. k > 0:
    # the padded model of the RL loop's torch actor: each rank's rows (in order) are cut into k
    # mini-batches, each padded to its longest row (prompt + response); the ranks synchronise
    # per mini-batch, so a mini-batch costs its largest rank's padded tokens x update_s_per_token
    # (seconds per padded token on one rank); a log-prob pass costs the largest rank's real
    # tokens x logprob_s_per_token.
    mini_batches: int = 0
    # > 0: the actor's `micro_batch_tokens` (pipeline/actors/forward.py): a rank's mini-batch is
    # cut into micro-batches, rows longest first, each at most this many padded tokens, each padded
    # to its own longest row; 0: a mini-batch is one micro-batch padded to its longest row.
    micro_batch_tokens: int = 0
    # With mini_batches: how the trainer ranks split the step's rows. False: each rank its contiguous
    # shard, cut into even mini-batches (trainer.train_shares=shard); True: the token shares'
    # deal, each mini-batch's rows balanced over the ranks (sim.model.lengths.row_deal; sim.calibrate
    # sets it from a run's trainer.train_shares=tokens).
    row_deal: bool = False
    logprob_s_per_token: float | None = None
    update_s_per_token: float | None = None
    sync_s: float | None = None  # None: weight bytes per device / sync_gbps
    sync_gbps: float = 100.0
    # The share of the rollout's tokens the update trains on: GRPO and RLOO leave a group whose
    # rewards are all equal out of the update (advantage 0); sim.calibrate measures it. The update
    # phase's tokens are scaled by it.
    update_share: float = 1.0

    def validate(self) -> None:
        if not 0.0 <= self.update_share <= 1.0:
            raise ValueError(f"phases.update_share must be in [0, 1], got {self.update_share}")


@dataclass(kw_only=True)
class AsyncSpec:
    rollout_share: float = 0.5  # colocated placement: devices given to rollout in the one-step asynchronous mode

    def validate(self) -> None:
        if not 0 < self.rollout_share < 1:
            raise ValueError(f"one_step_async.rollout_share must be in (0, 1), got {self.rollout_share}")


@dataclass(kw_only=True)
class PlacementSpec:
    """Where a step's work runs. `colocated`: every device rolls out, then trains; weights reach
    the engine on the same device (`phases.sync_s` / `phases.sync_gbps`). `separated`: `actor_share`
    of the devices train (whole devices, at least one) and the others roll out in groups of
    `cluster.tensor_parallel`; rollouts go to the actor devices over `transfer_gbps`, and the
    actors push each rollout device its weight shard (all parameters / tensor_parallel bytes)
    over `sync_gbps`. The one-step asynchronous mode keeps this split (`one_step_async.rollout_share`
    is for the colocated placement)."""

    kind: Literal["colocated", "separated"] = "colocated"
    actor_share: float = 0.5  # separated: share of the devices that train
    sync_gbps: float = 50.0  # separated: GB/s of the weight push to each rollout device
    transfer_gbps: float = 50.0  # separated: GB/s of the rollouts' transfer to the actor devices
    transfer_bytes_per_token: float = 8.0  # a token id and its engine log-prob (int32 + float32)

    def validate(self) -> None:
        if not 0 < self.actor_share < 1:
            raise ValueError(f"placement.actor_share must be in (0, 1), got {self.actor_share}")
        for key in ("sync_gbps", "transfer_gbps"):
            if getattr(self, key) <= 0:
                raise ValueError(f"placement.{key} must be > 0, got {getattr(self, key)}")
        if self.transfer_bytes_per_token < 0:
            raise ValueError(f"placement.transfer_bytes_per_token must be >= 0, got {self.transfer_bytes_per_token}")


@dataclass(kw_only=True)
class SweepSpec:
    accept_lens: list[float] = field(default_factory=lambda: [1.5, 2.0, 3.0, 4.0, 6.0, 8.0])
    # Chain drafts of these depths, with accept_len = (1 - p^(k+1)) / (1 - p) for acceptance p.
    depths: list[int] = field(default_factory=lambda: [1, 2, 3, 5, 7])
    chain_accept_rate: float = 0.76
    tail_sigmas: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0, 1.25])
    # rollout.lengths.prompt_share varied: what split groups buy as a prompt's samples grow alike.
    prompt_shares: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 0.95])
    # Separated placement: the share of devices that train, varied (sim.placement).
    actor_shares: list[float] = field(default_factory=lambda: [0.25, 0.375, 0.5, 0.625, 0.75])


@dataclass(kw_only=True)
class Scenario:
    name: str
    seed: int = 0
    steps: int = 3  # RL steps (independent length draws) averaged per projection point
    model: ModelSpec | None = None
    hardware: HardwareSpec | None = None
    latency: LatencySpec = field(default_factory=LatencySpec)
    cluster: ClusterSpec
    rollout: RolloutSpec
    spec: SpecSpec = field(default_factory=SpecSpec)
    spot: SpotSpec = field(default_factory=SpotSpec)
    bubble: BubbleSpec = field(default_factory=BubbleSpec)
    phases: PhaseSpec = field(default_factory=PhaseSpec)
    one_step_async: AsyncSpec = field(default_factory=AsyncSpec)
    placement: PlacementSpec = field(default_factory=PlacementSpec)
    sweep: SweepSpec = field(default_factory=SweepSpec)

    def validate(self) -> None:
        if self.latency.kind == "roofline" and (self.model is None or self.hardware is None):
            raise ValueError("latency.kind=roofline needs the model and hardware sections")
        derived = self.phases.logprob_s_per_token is None or self.phases.update_s_per_token is None
        if (derived or self.phases.sync_s is None) and (self.model is None or self.hardware is None):
            raise ValueError("phases without logprob_s_per_token, update_s_per_token and sync_s need the "
                             "model and hardware sections")
        if self.placement.kind == "separated" and self.model is None:
            raise ValueError("placement.kind=separated sizes the weight push from the model section (params_b, "
                             "bytes_per_param): add it, or use placement.kind=colocated")


def load_scenario(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Load a scenario file; a relative `rollout.lengths.path` is read from the file's folder."""
    scn = load_config(Scenario, path, overrides)
    lengths = scn.rollout.lengths
    if lengths.path and not Path(lengths.path).is_absolute():
        resolved = str((Path(path).resolve().parent / lengths.path).resolve())
        scn = replace(scn, rollout=replace(scn.rollout, lengths=replace(lengths, path=resolved)))
    return scn
