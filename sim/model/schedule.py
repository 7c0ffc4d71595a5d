"""Which speculation arm a group runs at a given active batch size.

An *arm* is a draft shape (depth, topk, verify_tokens) with its mean *accept length*: tokens
emitted per row per verify pass, the bonus token included (so plain decoding has 1). The
schedule is a function of the active batch size only (TLT's switch also waits 10 consecutive
steps below its threshold: at most 10 decode steps per rollout, left out here).
Spot training of the drafter scales the accepted draft tokens, accept_len - 1, by a gain.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sim.config import ArmSpec, SpecSpec


@dataclass(frozen=True)
class Schedule:
    """thresholds[i] is the largest batch size of bucket i; arms[i] its arm or None (off)."""

    thresholds: tuple[int, ...]
    arms: tuple[ArmSpec | None, ...]

    def arm_for(self, batch: int) -> ArmSpec | None:
        for bound, arm in zip(self.thresholds, self.arms):
            if batch <= bound:
                return arm
        return None

    @property
    def drafts(self) -> bool:
        """Whether some batch size speculates (the engine then holds a drafter)."""
        return any(a is not None for a in self.arms)

    def scaled(self, accept_gain: float) -> Schedule:
        return Schedule(self.thresholds, tuple(None if a is None else boost(a, accept_gain) for a in self.arms))


OFF = Schedule((), ())


def boost(arm: ArmSpec, gain: float) -> ArmSpec:
    """The arm with accepted draft tokens per pass scaled by `gain`, capped at the tree's size."""
    accept = min(1.0 + (arm.accept_len - 1.0) * gain, float(arm.verify_tokens + 1))
    return replace(arm, accept_len=accept)


def build_schedule(spec: SpecSpec) -> Schedule:
    if spec.schedule != "buckets" and spec.arm is None:
        raise ValueError(f"spec.schedule={spec.schedule} needs spec.arm (one of spec.arms) to speculate")
    if spec.schedule == "always":
        return Schedule((2**62,), (spec.arm_named(spec.arm),))
    if spec.schedule == "threshold":
        return Schedule((spec.threshold,), (spec.arm_named(spec.arm),))
    return Schedule(tuple(b.max_batch for b in spec.buckets),
                    tuple(None if b.arm == "off" else spec.arm_named(b.arm) for b in spec.buckets))


def chain_accept_len(p: float, depth: int) -> float:
    """Accept length of a chain draft of `depth` tokens, each accepted with probability p given
    its predecessors were: 1 + p + ... + p^depth = (1 - p^(depth+1)) / (1 - p)."""
    if not 0 <= p <= 1:
        raise ValueError(f"chain acceptance rate must be in [0, 1], got {p}")
    return float(depth + 1) if p == 1 else (1 - p ** (depth + 1)) / (1 - p)


def chain_arm(p: float, depth: int) -> ArmSpec:
    return ArmSpec(name=f"d{depth}k1v{depth}", depth=depth, topk=1, verify_tokens=depth,
                   accept_len=chain_accept_len(p, depth))
