"""What a run's config asks of its rollout backend, checked against what the backend declares.

The backend that engine.backend names declares on its class what it can do
(engine.backend.BackendCapabilities as `CAPS`, and `serves` for engine.spec.drafter), looked up
by engine.backends.factory.backend_class without building anything. `check_capabilities(cfg)`
refuses a config that turns on a setting needing a capability the backend lacks, naming the
setting, the capability, the key to change and the backends that have it. It is the one place
that knows which setting needs which capability: TrainConfig.validate calls it when a config
loads, launch.run.build_run before it builds anything (a config made in code skips loading).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.backends.factory import BACKENDS, backend_class

if TYPE_CHECKING:
    from launch.run_config import TrainConfig


@dataclass(frozen=True)
class Need:
    """A setting that needs a capability of the rollout backend."""

    setting: str  # as a config writes it
    capability: str  # a BackendCapabilities field
    why: str  # what the setting does with it
    fix: str  # what to change instead of the backend
    asks: Callable[[TrainConfig], bool]  # whether a config turns the setting on


NEEDS = (
    Need("trainer.old_logprobs=engine", "exact_logprobs",
         "takes the PPO ratio's old log-probs from the engine as exactly the served policy's",
         "set trainer.old_logprobs=actor or auto", lambda c: c.trainer.old_logprobs == "engine"),
    Need("bubble.enabled", "preemptible", "cuts pre-generation at the end of its part of the idle window",
         "set bubble.enabled=false", lambda c: c.bubble.enabled),
    Need("bubble.enabled", "takes_drafts", "hands the next step's requests their pre-generated responses as drafts",
         "set bubble.enabled=false", lambda c: c.bubble.enabled),
    Need("rollout.work_stealing", "pulls_requests", "feeds the engine from a queue as its rows free up",
         "set rollout.work_stealing=false", lambda c: c.rollout.work_stealing),
    Need("engine.weights=bfloat16", "bf16_kernels", "serves the policy from bf16 weight copies in the CPU kernels",
         "set engine.weights=float32", lambda c: c.engine.weights == "bfloat16"),
    Need("engine.products=bf16", "bf16_kernels", "computes the CPU kernels' matrix products in bf16",
         "set engine.products=float32 or auto", lambda c: c.engine.products == "bf16"),
    Need("pipeline.placement=separated: spot.enabled", "returns_features",
         "trains from the rollout engine's features (the rollout ranks hold no actor)",
         "set spot.enabled=false (or use pipeline.placement=colocated)",
         lambda c: c.pipeline.placement == "separated" and c.spot.enabled),
)


def check_capabilities(cfg: TrainConfig) -> None:
    """ValueError naming the setting, the capability and the key to change, for the first setting
    of `cfg` that its rollout backend cannot run."""
    name = cfg.engine.backend
    backend = backend_class(name)
    spec = cfg.engine.spec
    if spec.enabled and not backend.serves(spec.drafter_spec):
        raise ValueError(f"engine.backend={name} does not serve engine.spec.drafter={spec.drafter} (compositions and "
                         f"pre-generated drafts are the native engine's): choose a drafter it serves, or "
                         f"{_having(lambda b: b.serves(spec.drafter_spec))}")
    for need in NEEDS:
        if need.asks(cfg) and not getattr(backend.CAPS, need.capability):
            raise ValueError(f"{need.setting} {need.why}, which needs the capability {need.capability} that "
                             f"engine.backend={name} lacks: {need.fix}, or "
                             f"{_having(lambda b: getattr(b.CAPS, need.capability))}")
    if cfg.spot.enabled and not backend.CAPS.returns_features and not (spec.enabled and spec.drafter_spec.learned):
        raise ValueError(f"spot.enabled with engine.backend={name}, which returns no features to train from "
                         "(capability returns_features), trains the drafter the backend serves on the actor's "
                         f"features: set engine.spec.enabled=true and a learned engine.spec.drafter (got "
                         f"{spec.drafter!r}, enabled={spec.enabled}), or {_having(lambda b: b.CAPS.returns_features)}")


def _having(has: Callable[[type], bool]) -> str:
    """The advice to switch backends: those that have what `has` asks."""
    names = [n for n in BACKENDS if has(backend_class(n))]
    return f"set engine.backend={' or '.join(names)}" if names else "no backend has it"
