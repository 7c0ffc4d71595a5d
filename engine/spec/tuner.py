"""BEG-MAB: a bucketed epsilon-greedy bandit that learns, per batch size, whether and how to speculate.

Vocabulary (after TLT, arXiv 2511.16665): an *arm* is a draft shape or off (None); batch sizes
fall into *buckets* by thresholds (TLT's [1, 2, 5, 21]: bucket 0 is batch 1, bucket 1 is 2-4,
bucket 2 is 5-20, bucket 3 is 21 and up); every decode step is one *pull* of the arm its bucket
chose, and its *reward* is the step's emitted tokens per second (engine.types.StepRecord: the
timings are device-synchronised). Per bucket and arm a sliding window keeps the last `window`
rewards. To choose: an arm of the bucket never pulled goes first (in arm order); otherwise with
probability `epsilon` a uniformly random arm, else the arm with the highest median reward.
With `explore_within` > 0, exploration draws only among the arms whose median is at least that
fraction of the best one's: an arm that was measured far worse in a bucket is not pulled again
at random there (a depth-16 step over 256 rows costs as much as twenty plain steps, and ten
percent of such steps lose more than the tail's speculation gains; the long-tail bench).

`Bandit` is the pure part (numbers in, an arm index out; its randomness is an explicit
`random.Random`, saved with its state). `TunerPolicy` adapts it to the engine's SpecPolicy: each
call first credits the previous step's record to the arm chosen for it, then chooses. Its state
(`state_dict`) is plain JSON and survives generate() calls, RL steps and checkpoints.
"""

from __future__ import annotations

import bisect
import random
import re
import statistics
from collections import deque

from engine.spec.drafter import DraftShape
from engine.spec.policy import SpecPolicy
from engine.types import StepRecord

_LABEL = re.compile(r"^d(\d+)k(\d+)v(\d+)(?:L(\d+))?(?:c(0?\.\d+))?$")


def parse_arm(label: str, iid_children: bool = False) -> DraftShape | None:
    """"off" or "d<depth>k<topk>v<verify_tokens>[L<long_depth>][c<min_confidence>]" (DraftShape.label) -> the arm."""
    if label == "off":
        return None
    m = _LABEL.match(label)
    if m is None:
        raise ValueError(f"tuner arm {label!r} is neither 'off' nor of the form d<depth>k<topk>v<verify_tokens>, e.g. d6k1v8 "
                         "(a chain with a confidence stop: d16k1v16c0.1; deeper for long rows: d8k1v8L16)")
    d, k, v = (int(x) for x in m.groups()[:3])
    long_depth = int(m.group(4)) if m.group(4) else 0
    conf = float(m.group(5)) if m.group(5) else 0.0
    if conf and k != 1:
        raise ValueError(f"tuner arm {label!r}: a confidence stop (c...) applies to chains only (k1)")
    if long_depth and (k != 1 or long_depth <= min(d, v)):
        raise ValueError(f"tuner arm {label!r}: a length-aware budget L<n> applies to chains (k1) and needs n above the "
                         f"arm's depth {min(d, v)}, e.g. d8k1v8L16")
    return DraftShape(depth=d, topk=k, verify_tokens=v, iid_children=iid_children, min_confidence=conf, long_depth=long_depth)


class Bandit:
    def __init__(self, num_arms: int, thresholds: list[int], *, epsilon: float = 0.1, window: int = 300, seed: int = 0,
                 explore_within: float = 0.0) -> None:
        if num_arms < 1:
            raise ValueError("the tuner needs at least one arm")
        if not thresholds or thresholds[0] != 1 or any(b <= a for a, b in zip(thresholds, thresholds[1:])):
            raise ValueError(f"tuner bucket thresholds must start at 1 and increase, got {thresholds}")
        if not 0 <= epsilon <= 1:
            raise ValueError(f"tuner epsilon must be in [0, 1], got {epsilon}")
        if window < 1:
            raise ValueError(f"tuner window must be >= 1, got {window}")
        if not 0 <= explore_within <= 1:
            raise ValueError(f"tuner explore_within must be in [0, 1] (0: explore every arm), got {explore_within}")
        self.num_arms, self.thresholds, self.epsilon, self.window = num_arms, list(thresholds), epsilon, window
        self.explore_within = explore_within
        self.rng = random.Random(seed)
        self.rewards = [[deque(maxlen=window) for _ in range(num_arms)] for _ in thresholds]  # [bucket][arm]
        self.explored = 0  # choices made at random (epsilon)
        self.choices = 0

    def bucket(self, batch_size: int) -> int:
        return max(0, bisect.bisect_right(self.thresholds, batch_size) - 1)

    def choose(self, bucket: int) -> int:
        self.choices += 1
        arms = self.rewards[bucket]
        fresh = [a for a in range(self.num_arms) if not arms[a]]
        if fresh:
            return fresh[0]
        if self.rng.random() < self.epsilon:
            self.explored += 1
            if self.explore_within <= 0:
                return self.rng.randrange(self.num_arms)
            medians = self._medians(bucket)
            top = max(medians)
            near = [a for a in range(self.num_arms) if medians[a] >= self.explore_within * top]
            return near[self.rng.randrange(len(near))]
        return self.best(bucket)

    def _medians(self, bucket: int) -> list[float]:
        return [statistics.median(r) if r else float("-inf") for r in self.rewards[bucket]]

    def best(self, bucket: int) -> int:
        """The arm with the highest median reward in the window (ties to the earlier arm)."""
        medians = self._medians(bucket)
        return max(range(self.num_arms), key=lambda a: (medians[a], -a))

    def update(self, bucket: int, arm: int, reward: float) -> None:
        self.rewards[bucket][arm].append(float(reward))

    def state_dict(self) -> dict:
        return {"rewards": [[list(r) for r in b] for b in self.rewards], "rng": _jsonable(self.rng.getstate()),
                "explored": self.explored, "choices": self.choices}

    def load_state_dict(self, state: dict) -> None:
        rewards = state["rewards"]
        if len(rewards) != len(self.thresholds) or any(len(b) != self.num_arms for b in rewards):
            raise ValueError("tuner state does not match its buckets and arms (the config changed since it was saved)")
        self.rewards = [[deque(r, maxlen=self.window) for r in b] for b in rewards]
        self.rng.setstate(_tuple(state["rng"]))
        self.explored, self.choices = int(state["explored"]), int(state["choices"])


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, tuple) else x


def _tuple(x):
    return tuple(_tuple(v) for v in x) if isinstance(x, list) else x


class TunerPolicy(SpecPolicy):
    """A SpecPolicy that learns which arm pays per batch-size bucket."""

    def __init__(self, arms: list[DraftShape | None], thresholds: list[int], *, epsilon: float = 0.1, window: int = 300,
                 seed: int = 0, explore_within: float = 0.0) -> None:
        self.arms = arms
        self.bandit = Bandit(len(arms), thresholds, epsilon=epsilon, window=window, seed=seed, explore_within=explore_within)
        self.pending: tuple[int, int] | None = None  # (bucket, arm) of the step not yet credited

    def choose(self, batch_size: int, last: StepRecord | None) -> DraftShape | None:
        # A generate() call's first step has no previous record (last is None): nothing to credit.
        if self.pending is not None and last is not None and last.seconds > 0:
            self.bandit.update(*self.pending, sum(last.emitted) / last.seconds)
        bucket = self.bandit.bucket(batch_size)
        arm = self.bandit.choose(bucket)
        self.pending = (bucket, arm)
        return self.arms[arm]

    def metrics(self) -> dict[str, float]:
        """spec/arm/<bucket>: the index of the best arm per bucket; spec/tuner_explore_share."""
        b = self.bandit
        out = {f"spec/arm/bucket{i}": float(b.best(i)) for i in range(len(b.thresholds)) if any(b.rewards[i])}
        out["spec/tuner_explore_share"] = b.explored / b.choices if b.choices else 0.0
        return out

    def state_dict(self) -> dict:
        return self.bandit.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.bandit.load_state_dict(state)
