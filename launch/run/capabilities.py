"""A run's config checked as a whole: what its settings need of the rollout backend, the actor
backend and the placement, and the settings that cannot go together.

Each of the three parts declares what it can do without building anything: the rollout backend
that engine.backend names on its class (engine.backend.BackendCapabilities as `CAPS`, and `serves`
for engine.spec.drafter; engine.backends.factory.backend_class), the actor backend of
actor.backend on its class (pipeline.actors.base.ActorCapabilities as `CAPS`;
pipeline.actors.actor_class), the placement of pipeline.placement in pipeline.config.PLACEMENTS.
`NEEDS` is the one table of which setting needs which capability of which part; `validate_run(cfg)`
refuses a config that turns on a setting its part lacks the capability for, naming the setting,
the capability, the key to change and the choices that have it, then the combinations no part
runs. Each section's `validate()` checks its own values first (common.config, as it loads).

It runs once per config, when the config loads (TrainConfig.validate); code that changes a loaded
config calls `cfg.validate()` again. It knows the sections' fields and the parts' declarations,
nothing of how a part runs; it reads the run config through `RunConfig`, so it imports nothing
of launch.run.config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from engine.backends.factory import BACKENDS, backend_class
from engine.config import EngineConfig
from pipeline.actors import ACTOR_BACKENDS, ActorConfig, actor_caps
from pipeline.algorithms.config import AlgorithmConfig
from pipeline.drafts.bubble import BubbleConfig
from pipeline.config import PLACEMENTS, PipelineSection, RolloutSection, TrainerSection
from spot.config import SpotConfig

Part = Literal["engine", "actor", "placement"]


class RunConfig(Protocol):
    """The sections of a run config (launch.run.config.TrainConfig) that the checks read."""

    engine: EngineConfig
    actor: ActorConfig
    pipeline: PipelineSection
    rollout: RolloutSection
    trainer: TrainerSection
    algorithm: AlgorithmConfig
    spot: SpotConfig
    bubble: BubbleConfig


@dataclass(frozen=True)
class Need:
    """A setting that needs a capability of one part of the run."""

    setting: str  # as a config writes it
    part: Part  # whose capability: the rollout backend's, the actor backend's or the placement's
    capability: str  # a field of that part's capabilities
    why: str  # what the setting does with it
    fix: str  # what to change instead of the part
    asks: Callable[[RunConfig], bool]  # whether a config turns the setting on


def _separated_spot(c: RunConfig) -> bool:
    return c.spot.enabled and not c.pipeline.caps.actor_beside_engine


NEEDS = (
    # the rollout backend (engine.backend)
    Need("trainer.old_logprobs=engine", "engine", "exact_logprobs",
         "takes the PPO ratio's old log-probs from the engine as exactly the served policy's",
         "set trainer.old_logprobs=actor or auto", lambda c: c.trainer.old_logprobs == "engine"),
    Need("bubble.enabled", "engine", "preemptible", "cuts pre-generation at the end of its part of the idle window",
         "set bubble.enabled=false", lambda c: c.bubble.enabled),
    Need("bubble.enabled", "engine", "takes_drafts",
         "hands the next step's requests their pre-generated responses as drafts",
         "set bubble.enabled=false", lambda c: c.bubble.enabled),
    Need("rollout.work_stealing", "engine", "pulls_requests", "feeds the engine from a queue as its rows free up",
         "set rollout.work_stealing=false", lambda c: c.rollout.work_stealing),
    Need("engine.weights=bfloat16", "engine", "bf16_kernels",
         "serves the policy from bf16 weight copies in the CPU kernels",
         "set engine.weights=float32", lambda c: c.engine.weights == "bfloat16"),
    Need("engine.products=bf16", "engine", "bf16_kernels", "computes the CPU kernels' matrix products in bf16",
         "set engine.products=float32 or auto", lambda c: c.engine.products == "bf16"),
    Need("pipeline.placement=separated: spot.enabled", "engine", "returns_features",
         "trains from the rollout engine's features (the rollout ranks hold no actor)",
         "set spot.enabled=false (or use pipeline.placement=colocated)", _separated_spot),
    # the placement (pipeline.placement)
    Need("bubble.enabled", "placement", "pregenerates", "pre-generates in a rank's wait between its rollouts and "
         "its update", "set bubble.enabled=false", lambda c: c.bubble.enabled),
    Need("algorithm.dynamic_sampling", "placement", "refills", "rolls out more rounds of a step (DAPO's refill) on "
         "the ranks that train them", "set algorithm.dynamic_sampling=false", lambda c: bool(c.algorithm.dynamic_sampling)),
    Need("rollout.work_stealing", "placement", "balances", "balances a step's rollouts across the ranks that train "
         "them", "set rollout.work_stealing=false", lambda c: c.rollout.work_stealing),
    Need("rollout.long_first", "placement", "balances", "orders a rank's admissions by the schedule's shares "
         "(pipeline.rollout.schedule)", "set rollout.long_first=false", lambda c: c.rollout.long_first),
    Need("trainer.train_shares=tokens", "placement", "balances", "deals a step's groups to the ranks that made them "
         "by tokens", "set trainer.train_shares=shard", lambda c: c.trainer.train_shares == "tokens"),
    # the actor backend (actor.backend)
    Need("pipeline.placement=separated", "actor", "subgroup", "trains the actor on the actor ranks, a subgroup of "
         "the job", "use pipeline.placement=colocated", lambda c: not c.pipeline.caps.actor_on_every_rank),
    Need("actor.offload_optimizer / actor.offload_params", "actor", "offloads",
         "keeps optimizer states or parameters in CPU memory", "set actor.offload_optimizer=false and "
         "actor.offload_params=false", lambda c: c.actor.offload_optimizer or c.actor.offload_params),
    Need("actor.tensor_parallel / actor.pipeline_parallel", "actor", "model_parallel",
         "splits each layer's matrices or the layers over ranks", "set both to 1 (DeepSpeed ZeRO shards the model "
         "over data-parallel ranks instead: actor.zero_stage=3)",
         lambda c: (c.actor.tensor_parallel, c.actor.pipeline_parallel) != (1, 1)),
    Need("actor.precision=bf16-mixed", "actor", "autocast", "runs the update's products in bf16 under autocast "
         "over float32 weights", "set actor.precision=float32, and use DeepSpeed's or Megatron's own bf16 settings",
         lambda c: c.actor.precision == "bf16-mixed"),
    Need("actor.device=cpu", "actor", "cpu", "trains on the CPU", "set actor.device=cuda",
         lambda c: not c.actor.device.startswith("cuda")),
)

# each part: the key that chooses it, its choices, and a choice's declared capabilities
PARTS: dict[Part, tuple[str, tuple[str, ...], Callable[[str], object]]] = {
    "engine": ("engine.backend", BACKENDS, lambda name: backend_class(name).CAPS),
    "actor": ("actor.backend", ACTOR_BACKENDS, actor_caps),
    "placement": ("pipeline.placement", tuple(PLACEMENTS), PLACEMENTS.__getitem__),
}


def _chosen(part: Part, cfg: RunConfig) -> str:
    return {"engine": cfg.engine.backend, "actor": cfg.actor.backend, "placement": cfg.pipeline.placement}[part]


def validate_run(cfg: RunConfig) -> None:
    """ValueError for the first setting of `cfg` that one of its parts cannot run (naming the
    setting, the capability, the key to change and the choices that have it), else for the first
    combination of settings that no part runs."""
    _check_drafter(cfg)
    for need in NEEDS:
        if need.asks(cfg):
            _check_need(need, cfg)
    _check_spot(cfg)
    _check_bubble(cfg)
    _check_schedule(cfg)
    _check_weights(cfg)


def _check_need(need: Need, cfg: RunConfig) -> None:
    key, choices, caps_of = PARTS[need.part]
    name = _chosen(need.part, cfg)
    if getattr(caps_of(name), need.capability):
        return
    having = [c for c in choices if getattr(caps_of(c), need.capability)]
    switch = f"set {key}={' or '.join(having)}" if having else f"no {key} has it"
    if need.part == "placement":
        raise ValueError(f"{key}={name}: {need.setting} {need.why}, which needs the capability {need.capability} "
                         f"that this placement lacks: {need.fix}, or {switch}")
    raise ValueError(f"{need.setting} {need.why}, which needs the capability {need.capability} that {key}={name} "
                     f"lacks: {need.fix}, or {switch}")


def _engine_having(has: Callable[[type], bool]) -> str:
    """The advice to switch rollout backends: those that have what `has` asks."""
    names = [n for n in BACKENDS if has(backend_class(n))]
    return f"set engine.backend={' or '.join(names)}" if names else "no backend has it"


def _check_drafter(cfg: RunConfig) -> None:
    name, spec = cfg.engine.backend, cfg.engine.spec
    if spec.enabled and not backend_class(name).serves(spec.drafter_spec):
        raise ValueError(f"engine.backend={name} does not serve engine.spec.drafter={spec.drafter} (compositions and "
                         f"pre-generated drafts are the native engine's): choose a drafter it serves, or "
                         f"{_engine_having(lambda b: b.serves(spec.drafter_spec))}")


def _check_spot(cfg: RunConfig) -> None:
    spec, name = cfg.engine.spec, cfg.engine.backend
    if not cfg.spot.enabled:
        return
    if not backend_class(name).CAPS.returns_features and not (spec.enabled and spec.drafter_spec.learned):
        raise ValueError(f"spot.enabled with engine.backend={name}, which returns no features to train from "
                         "(capability returns_features), trains the drafter the backend serves on the actor's "
                         f"features: set engine.spec.enabled=true and a learned engine.spec.drafter (got "
                         f"{spec.drafter!r}, enabled={spec.enabled}), or "
                         f"{_engine_having(lambda b: b.CAPS.returns_features)}")
    if not spec.enabled:
        raise ValueError("spot.enabled trains the engine's EAGLE drafter, but engine.spec.enabled is false: set "
                         "spot.enabled=false, or turn speculation on with an EAGLE drafter (engine.spec.drafter: eagle)")


def _check_bubble(cfg: RunConfig) -> None:
    if not cfg.bubble.enabled:
        return
    if not (cfg.engine.spec.enabled and cfg.engine.spec.drafter_spec.pregenerated):
        raise ValueError("bubble.enabled needs engine.spec.enabled: true and a drafter that proposes pre-generated "
                         f"responses first (engine.spec.drafter: pregenerated+eagle), got {cfg.engine.spec.drafter!r}")
    if cfg.trainer.async_steps:
        raise ValueError("bubble.enabled pre-generates step t+1 with policy t in step t's idle window; with "
                         "trainer.async_steps=1 step t+1 is rolled out before that window: use one or the other")


def _check_schedule(cfg: RunConfig) -> None:
    """What the rollout schedule (pipeline.rollout.schedule) supports: one generation round per step, synchronous."""
    chosen = [k for k, on in (("rollout.work_stealing", cfg.rollout.work_stealing),
                              # a separated run's rollout ranks split groups on their own (pipeline.separated.rollout)
                              ("rollout.split_groups", cfg.rollout.split_groups and not cfg.pipeline.separated),
                              ("rollout.long_first", cfg.rollout.long_first),
                              ("trainer.train_shares=tokens", cfg.trainer.train_shares == "tokens")) if on]
    if not chosen:
        return
    if cfg.algorithm.dynamic_sampling:
        raise ValueError(f"{', '.join(chosen)} cannot be combined with algorithm.dynamic_sampling (DAPO's refill rounds "
                         "are rolled out per rank): turn one of them off")
    if cfg.trainer.async_steps:
        raise ValueError(f"{', '.join(chosen)} needs trainer.async_steps=0 (the schedule exchanges a step's rollouts "
                         "after its idle window, which the asynchronous mode does not have)")


def _check_weights(cfg: RunConfig) -> None:
    if cfg.engine.weights != "float32" and cfg.trainer.old_logprobs == "engine":
        raise ValueError("trainer.old_logprobs=engine is wrong with engine.weights=bfloat16: the engine serves the "
                         "bf16-rounded policy, not the actor's (train/mismatch_kl shows the gap); use "
                         "trainer.old_logprobs=actor or auto")
