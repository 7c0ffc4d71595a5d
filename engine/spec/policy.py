"""The speculation policy: asked every decode step whether and how to speculate.

`choose(batch_size, last)` gets the number of active rows and the previous decode step's record
(None on the first step of a generate() call) and answers a `DraftShape`, or None for a step
without speculation ("off"). Any shape within the engine's maximum sizes (`engine.spec.max_*`)
is allowed on any step; switching costs nothing (drafters keep taking in features while off).
The default is `FixedPolicy`: the config's shape on every step. The tuner (BEG-MAB) is another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.spec.drafter import DraftShape
from engine.types import StepRecord


class SpecPolicy(Protocol):
    def choose(self, batch_size: int, last: StepRecord | None) -> DraftShape | None: ...


@dataclass
class FixedPolicy:
    """The same shape (or always off, with None) on every step."""

    shape: DraftShape | None

    def choose(self, batch_size: int, last: StepRecord | None) -> DraftShape | None:
        return self.shape
