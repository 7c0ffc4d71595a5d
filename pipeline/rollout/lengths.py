"""LengthPredictor: each prompt's expected response length, for long-first admission.

A prompt's prediction is the mean length of its responses the last time it was seen (its
*history*: prompts recur across epochs), else the *prior*, the running mean of every response
length observed so far (1 before any). The run feeds it every step's lengths of all ranks, so its
state is the same on every rank and an order derived from it is agreed without a message; it is
saved in run checkpoints (`components["length_predictor"]`). The history is bounded: the
prompts seen least recently are forgotten beyond `max_prompts`.

It knows nothing about ranks, engines or tokens; predictions order work, they never change it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence


class LengthPredictor:
    def __init__(self, max_prompts: int = 100_000) -> None:
        if max_prompts < 1:
            raise ValueError(f"max_prompts must be >= 1, got {max_prompts}")
        self.max_prompts = max_prompts
        self.history: OrderedDict[str, float] = OrderedDict()  # prompt id -> mean length last seen, oldest first
        self.count = 0  # responses observed
        self.total = 0.0  # their summed lengths

    @property
    def prior(self) -> float:
        return self.total / self.count if self.count else 1.0

    def predict(self, prompt_id: str) -> float:
        return self.history.get(prompt_id, self.prior)

    def observe(self, prompt_id: str, lengths: Sequence[int]) -> None:
        """One prompt's response lengths of this step: its history from now on, and the prior's."""
        if not lengths:
            raise ValueError(f"prompt {prompt_id!r}: no lengths to observe")
        self.history.pop(prompt_id, None)
        self.history[prompt_id] = sum(lengths) / len(lengths)
        while len(self.history) > self.max_prompts:
            self.history.popitem(last=False)
        self.count += len(lengths)
        self.total += float(sum(lengths))

    def state_dict(self) -> dict:
        return {"history": list(self.history.items()), "count": self.count, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.history = OrderedDict((str(k), float(v)) for k, v in state["history"])
        self.count, self.total = int(state["count"]), float(state["total"])


def long_first(predicted: Sequence[float]) -> list[int]:
    """Indices by predicted length, longest first; ties keep their order (stable)."""
    return sorted(range(len(predicted)), key=lambda i: -predicted[i])


def correlation(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson's correlation of xs and ys; None where either is constant (or fewer than 2 values)."""
    if len(xs) != len(ys):
        raise ValueError(f"correlation needs as many xs as ys, got {len(xs)} and {len(ys)}")
    n = len(xs)
    if n < 2 or len(set(xs)) == 1 or len(set(ys)) == 1:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / math.sqrt(sxx * syy)
