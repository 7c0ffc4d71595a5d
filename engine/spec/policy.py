"""The speculation policy: asked every decode step whether and how to speculate.

`choose(batch_size, last)` gets the number of active rows and the previous decode step's record
(None on the first step of a generate() call) and answers a `DraftShape`, or None for a step
without speculation ("off"). Any shape within the engine's maximum sizes (`engine.spec.max_*`)
is allowed on any step; switching costs nothing (drafters keep taking in features while off).
The default is `FixedPolicy`: the config's shape on every step; `TailPolicy` speculates only once
the batch has thinned to a threshold (`engine.spec.max_active_batch`: the long tail, where a
draft is nearly free and decoding is latency-bound). The tuner (BEG-MAB) is another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.spec.drafter import DraftShape
from engine.types import StepRecord


class SpecPolicy(Protocol):
    """Implementations subclass it and inherit the defaults of a policy that learns nothing."""

    def choose(self, batch_size: int, last: StepRecord | None) -> DraftShape | None: ...

    def metrics(self) -> dict[str, float]:
        """What the policy learned so far, for the step's metrics (namespaced, e.g. tuner/...)."""
        return {}

    def state_dict(self) -> dict:
        """What a resumed run needs to continue choosing as this one would."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass
class FixedPolicy(SpecPolicy):
    """The same shape (or always off, with None) on every step."""

    shape: DraftShape | None

    def choose(self, batch_size: int, last: StepRecord | None) -> DraftShape | None:
        return self.shape


@dataclass
class TailPolicy(SpecPolicy):
    """The shape while at most `max_active` rows are active, off above (TLT's adaptive switch,
    without its hysteresis: switching costs nothing here)."""

    shape: DraftShape
    max_active: int

    def choose(self, batch_size: int, last: StepRecord | None) -> DraftShape | None:
        return self.shape if batch_size <= self.max_active else None
