"""The RL algorithm's config section (`algorithm:` in configs/*.yaml).

Knobs left at `None` take the algorithm's default when the section is built, so the saved config
holds the values that ran:

| knob            | grpo                | rloo       | dapo       |
|-----------------|---------------------|------------|------------|
| clip_low        | 0.2                 | 0.2        | 0.2        |
| clip_high       | 0.2                 | 0.2        | 0.28       |
| normalize_std   | true (false: Dr. GRPO) | n/a (false) | true    |
| aggregation     | seq-mean-token-mean | token-mean | token-mean |
| dynamic_sampling| false               | false      | true       |

Dr. GRPO is `name: grpo, normalize_std: false, aggregation: seq-mean-token-sum-norm`.
The KL penalty to a reference policy is off by default (`kl_coef: 0`), as in DAPO and Dr. GRPO.
Dual clip is on for every algorithm, `clip_ratio_c: 3.0` as in verl: a token with a negative
advantage adds at most -A * 3 to the loss, however far its ratio grew (see
pipeline.algorithms.policy_loss). It changes the loss only where a ratio exceeds 3 with A < 0;
`clip_ratio_c: null` turns it off (plain PPO clipping, as in the GRPO and DAPO papers).
DAPO's overlong shaping is off until `overlong_buffer` is set (DAPO used 4096 of 20480 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeline.algorithms.aggregation import Aggregation
from pipeline.algorithms.kl import KLEstimator

_DEFAULTS = {
    "grpo": {"clip_low": 0.2, "clip_high": 0.2, "normalize_std": True, "aggregation": "seq-mean-token-mean",
             "dynamic_sampling": False},
    "rloo": {"clip_low": 0.2, "clip_high": 0.2, "normalize_std": False, "aggregation": "token-mean",
             "dynamic_sampling": False},
    "dapo": {"clip_low": 0.2, "clip_high": 0.28, "normalize_std": True, "aggregation": "token-mean",
             "dynamic_sampling": True},
}


@dataclass(kw_only=True)
class AlgorithmConfig:
    name: Literal["grpo", "rloo", "dapo"] = "grpo"
    clip_low: float | None = None  # ratio clipped below at 1 - clip_low (negative advantages)
    clip_high: float | None = None  # ratio clipped above at 1 + clip_high (positive advantages)
    clip_ratio_c: float | None = 3.0  # dual clip: the loss of a negative advantage capped at -A * clip_ratio_c; null: off
    normalize_std: bool | None = None  # divide GRPO advantages by the group's std
    aggregation: Aggregation | None = None
    eps: float = 1e-6  # added to the group std
    log_ratio_clamp: float = 20.0  # |log p - log p_old| and |log p_ref - log p| are clamped to this before exp
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    dynamic_sampling: bool | None = None  # drop groups with equal rewards, refill the batch
    max_sampling_rounds: int = 10  # generation rounds allowed to fill one batch (dynamic sampling)
    overlong_buffer: int = 0  # tokens before the max response length over which the reward ramps down
    overlong_factor: float = 1.0  # the penalty at the max response length

    def __post_init__(self) -> None:
        if self.name not in _DEFAULTS:
            raise ValueError(f"algorithm.name must be one of {', '.join(_DEFAULTS)}, got {self.name!r}")
        if self.name == "rloo" and self.normalize_std:
            raise ValueError("algorithm.normalize_std applies to grpo and dapo; rloo's baseline is not std-normalised")
        for key, value in _DEFAULTS[self.name].items():
            if getattr(self, key) is None:
                setattr(self, key, value)

    def validate(self) -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"algorithm.clip_low must be in [0, 1) (the ratio floor 1 - clip_low > 0), got {self.clip_low}")
        if self.clip_high < 0.0:
            raise ValueError(f"algorithm.clip_high must be >= 0, got {self.clip_high}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(
                f"algorithm.clip_ratio_c must be > 1 (dual clip's bound on the ratio of a negative advantage) "
                f"or null to turn dual clip off, got {self.clip_ratio_c}"
            )
        for key in ("eps", "log_ratio_clamp", "overlong_factor"):
            if not getattr(self, key) > 0:
                raise ValueError(f"algorithm.{key} must be > 0, got {getattr(self, key)}")
        if self.kl_coef < 0:
            raise ValueError(f"algorithm.kl_coef must be >= 0, got {self.kl_coef}")
        if self.max_sampling_rounds < 1:
            raise ValueError(f"algorithm.max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}")
        if self.overlong_buffer < 0:
            raise ValueError(f"algorithm.overlong_buffer must be >= 0, got {self.overlong_buffer}")
