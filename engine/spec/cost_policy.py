"""A speculation policy that speculates only where the cost model predicts it faster than plain decoding.

Vocabulary: an *arm* is a draft shape or off (None), as for the BEG-MAB tuner (engine.spec.tuner);
a pass over `b` rows x `e` entries costs `costs(b, e)` seconds (engine.spec.pass_costs, measured on
this machine); a row's draft comes from a *source* (a part of a composed drafter: bubble draft,
n-gram, EAGLE; StepRecord.source); per source, draft tokens are accepted one after another with
probability `alpha` each (the chain model of EAGLE and Leviathan et al.: a chain of L tokens
yields 1 + alpha + ... + alpha^L tokens a pass, the last one the target's own bonus or correction).

Each decode step with `b` active rows, every arm's throughput is predicted:

    off:  b / (scale_off * costs(b, 1))
    arm:  b * E(L) / (scale_spec * costs(b, 1 + L) + draft_s(b)),   E(L) = sum_s p_s (1 + alpha_s + ... + alpha_s^L) + p_none

with p_s the share of rows source s drafts (p_none: no source had a draft; such a row still pays the
pass's width), `draft_s` the arm's measured proposing seconds per row times b, and the two scales
the live ratio of measured step seconds to the table's (other work on the machine, longer contexts,
the loop's bookkeeping). The arm with the highest prediction runs. Acceptance and shares are
counted from the step records with a decay, so they follow a drafter or a policy that changes.
Exploration is bounded: with probability `epsilon`, when off is predicted best, the arm whose
*optimistic* prediction (alpha at an upper confidence bound) is best runs instead, and only if that
optimism beats off: an arm that cannot win even so is never run.

Unlike the bandit it needs no pulls of a losing arm in every bucket to learn that it loses: the
costs come from the table, and acceptance measured at one batch size serves every other. The pure
part (`expected_emitted`, `Acceptance`, `predict`) is numbers in, numbers out; `CostPolicy` adapts it
to the engine's SpecPolicy and keeps its state as plain JSON (checkpoints, resumed runs).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from engine.spec.drafter import DraftShape
from engine.spec.pass_costs import PassCosts
from engine.spec.policy import SpecPolicy
from engine.spec.tuner import _jsonable, _tuple
from engine.types import StepRecord

DECAY = 0.98  # per speculative step: the counts' memory is ~50 steps
SCALE_DECAY = 0.9  # per step: the scales follow the machine within ~10 steps
MAX_ALPHA = 0.98  # no estimate promises that every draft token is accepted


def expected_emitted(alpha: float, length: int) -> float:
    """Tokens a row emits per pass when it drafts a chain of `length` tokens, each accepted with
    probability `alpha` given its predecessors: 1 + alpha + ... + alpha^length."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        return 1.0 + length
    return (1.0 - alpha ** (length + 1)) / (1.0 - alpha)


@dataclass
class SourceCounts:
    """One draft source's decayed counts: rows it drafted, and its tokens accepted / rejected."""

    rows: float = 0.0
    accepted: float = 0.0
    rejected: float = 0.0

    def alpha(self, prior: float, weight: float, optimism: float = 0.0) -> float:
        """Per-token acceptance: the posterior mean with `weight` pseudo-tokens at `prior`, plus
        `optimism` standard deviations (an upper confidence bound), within [0, 1]."""
        n = self.accepted + self.rejected + weight
        mean = (self.accepted + prior * weight) / n
        return min(MAX_ALPHA, mean + optimism * math.sqrt(mean * (1.0 - mean) / n))


@dataclass
class Acceptance:
    """What drafts achieved, per source, from step records (decayed per speculative step)."""

    sources: dict[int, SourceCounts] = field(default_factory=dict)
    plain_rows: float = 0.0  # rows of speculative steps that had no draft
    prior: float = 0.5
    weight: float = 8.0  # pseudo-tokens: without data, alpha's upper bound at two deviations is 0.85

    def add(self, record: StepRecord) -> None:
        for counts in self.sources.values():
            counts.rows *= DECAY
            counts.accepted *= DECAY
            counts.rejected *= DECAY
        self.plain_rows *= DECAY
        source = record.source or [0] * record.batch_size
        for d, a, s in zip(record.drafted, record.accepted, source):
            if d == 0:
                self.plain_rows += 1
                continue
            c = self.sources.setdefault(int(s), SourceCounts())
            c.rows += 1
            c.accepted += a
            c.rejected += a < d  # the token after the accepted prefix was rejected

    def emitted(self, length: int, optimism: float = 0.0) -> float:
        """Expected tokens a row emits per pass of a chain of `length` tokens (1: no source has a
        draft yet: then the prior, as if one source drafted every row)."""
        total = self.plain_rows + sum(c.rows for c in self.sources.values())
        if total <= 0:
            return expected_emitted(SourceCounts().alpha(self.prior, self.weight, optimism), length)
        e = self.plain_rows / total
        for c in self.sources.values():
            e += c.rows / total * expected_emitted(c.alpha(self.prior, self.weight, optimism), length)
        return e

    def alpha(self) -> float:
        """The per-token acceptance over every source (rows-weighted), for the metrics."""
        total = sum(c.rows for c in self.sources.values())
        if total <= 0:
            return self.prior
        return sum(c.rows * c.alpha(self.prior, self.weight) for c in self.sources.values()) / total


def entries(arm: DraftShape) -> int:
    """Entries per row of the arm's verify pass: the root and its draft nodes."""
    return 1 + (arm.chain_len if arm.topk == 1 else arm.verify_tokens)


def predict(b: int, arm: DraftShape | None, costs: PassCosts, acceptance: Acceptance, scale_off: float, scale_spec: float,
            draft_s_per_row: float, optimism: float = 0.0) -> float:
    """Predicted tokens per second of one step over `b` rows with `arm` (None: off)."""
    if arm is None:
        return b / (scale_off * costs(b, 1))
    seconds = scale_spec * costs(b, entries(arm)) + draft_s_per_row * b
    return b * acceptance.emitted(arm.chain_len, optimism) / seconds


class CostPolicy(SpecPolicy):
    """Chooses, every step, the arm predicted fastest by the pass-cost table and the live acceptance."""

    def __init__(self, arms: list[DraftShape | None], costs: PassCosts, *, epsilon: float = 0.05, prior: float = 0.5,
                 optimism: float = 2.0, seed: int = 0) -> None:
        if not 0 <= epsilon <= 1:
            raise ValueError(f"engine.spec.tuner_epsilon must be in [0, 1], got {epsilon}")
        self.arms = [a for a in arms if a is not None]  # off is always an option
        if not self.arms:
            raise ValueError("the cost tuner needs at least one arm besides 'off' in engine.spec.tuner_arms")
        self.costs, self.epsilon, self.optimism = costs, epsilon, optimism
        self.acceptance = Acceptance(prior=prior)
        self.scale = {"off": 1.0, "spec": 1.0}
        self.draft_s = {a.label: 0.0 for a in self.arms}  # seconds of proposing per row, decayed mean
        self.rng = random.Random(seed)
        self.pending: DraftShape | None = None
        self.steps = self.speculative = self.explored = 0

    def _credit(self, last: StepRecord) -> None:
        """What the previous step measured: its acceptance, the table's scale, the arm's drafting time."""
        arm = self.pending
        kind = "off" if arm is None else "spec"
        predicted = self.costs(last.batch_size, 1 if arm is None else entries(arm))
        measured = last.forward_s + last.other_s
        self.scale[kind] = SCALE_DECAY * self.scale[kind] + (1 - SCALE_DECAY) * measured / predicted
        if arm is not None:
            self.acceptance.add(last)
            old = self.draft_s[arm.label]
            self.draft_s[arm.label] = last.draft_s / last.batch_size if old == 0 else 0.8 * old + 0.2 * last.draft_s / last.batch_size

    def choose(self, batch_size: int, last: StepRecord | None) -> DraftShape | None:
        if last is not None and last.seconds > 0 and last.shape == (self.pending.label if self.pending else "off"):
            self._credit(last)
        self.steps += 1
        scale_spec = self.scale["spec"] if self.speculative else self.scale["off"]

        def rate(arm, optimism=0.0):
            return predict(batch_size, arm, self.costs, self.acceptance, self.scale["off"], scale_spec,
                           self.draft_s.get(arm.label, 0.0) if arm else 0.0, optimism)

        off = rate(None)
        best = max(self.arms, key=rate)
        choice = best if rate(best) > off else None
        if choice is None and self.epsilon > 0 and self.rng.random() < self.epsilon:
            hopeful = max(self.arms, key=lambda a: rate(a, self.optimism))
            if rate(hopeful, self.optimism) > off:
                choice = hopeful
                self.explored += 1
        self.speculative += choice is not None
        self.pending = choice
        return choice

    def metrics(self) -> dict[str, float]:
        """spec/alpha (per-token acceptance estimate), spec/speculated_share (steps that speculated),
        spec/tuner_explore_share, spec/cost_scale (measured / table seconds of plain steps)."""
        n = max(self.steps, 1)
        return {"spec/alpha": self.acceptance.alpha(), "spec/speculated_share": self.speculative / n,
                "spec/tuner_explore_share": self.explored / n, "spec/cost_scale": self.scale["off"]}

    def state_dict(self) -> dict:
        a = self.acceptance
        return {"sources": {str(k): [c.rows, c.accepted, c.rejected] for k, c in a.sources.items()},
                "plain_rows": a.plain_rows, "scale": dict(self.scale), "draft_s": dict(self.draft_s),
                "rng": _jsonable(self.rng.getstate()), "counts": [self.steps, self.speculative, self.explored]}

    def load_state_dict(self, state: dict) -> None:
        if set(state.get("draft_s", {})) != set(self.draft_s):
            raise ValueError("cost tuner state does not match its arms (engine.spec.tuner_arms changed since it was saved)")
        self.acceptance.sources = {int(k): SourceCounts(*v) for k, v in state["sources"].items()}
        self.acceptance.plain_rows = float(state["plain_rows"])
        self.scale = dict(state["scale"])
        self.draft_s = dict(state["draft_s"])
        self.rng.setstate(_tuple(state["rng"]))
        self.steps, self.speculative, self.explored = (int(x) for x in state["counts"])
        self.pending = None
