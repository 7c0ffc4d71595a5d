"""An RL algorithm as the pieces the loop calls, built once from its config section.

`build_algorithm(cfg, max_response_len)` picks the advantage estimator and binds the loss's
knobs; the loop then calls, per step:

    rewards, m = algo.shape_rewards(rewards, lengths)   # DAPO overlong penalty (identity when off)
    groups, m  = fill_groups(stream, target)            # only if algo.dynamic_sampling
    adv, m     = algo.advantages(rewards, group_ids)    # [N] per response
    weights    = algo.loss_weights(response_mask)       # once per mini-batch
    loss, m    = algo.loss(logprobs, micro_batch)       # per micro-batch; backward; sum over micro-batches

There is no trainer class here: the variants differ only in which functions are bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from pipeline.algorithms.advantages import grpo_advantages, rloo_advantages
from pipeline.algorithms.aggregation import Aggregation, loss_weights
from pipeline.algorithms.config import AlgorithmConfig
from pipeline.algorithms.overlong import overlong_penalty
from pipeline.algorithms.policy_loss import policy_loss
from pipeline.records import TrainBatch

Metrics = dict[str, float]


@dataclass(frozen=True)
class Algorithm:
    name: str
    advantages: Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, Metrics]]  # (rewards, group_ids)
    policy_loss: Callable[..., tuple[torch.Tensor, Metrics]]  # policy_loss with the clip / KL knobs bound
    aggregation: Aggregation
    max_response_len: int
    dynamic_sampling: bool
    max_sampling_rounds: int
    overlong_buffer: int
    overlong_factor: float
    kl_coef: float

    @property
    def zero_advantage_is_inert(self) -> bool:
        """Whether a row with advantage 0 on every token adds nothing to the loss or its gradient: the
        clipped surrogate is then 0 whatever the ratio, and only a KL penalty would reach it."""
        return self.kl_coef == 0

    def loss_weights(self, response_mask: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T]
        return loss_weights(response_mask, self.aggregation, self.max_response_len)

    def shape_rewards(self, rewards: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        """Rewards [N] plus the overlong penalty of their response lengths [N]."""
        penalty, metrics = overlong_penalty(lengths, self.max_response_len, self.overlong_buffer, self.overlong_factor)
        return rewards.float() + penalty, metrics

    def loss(self, logprobs: torch.Tensor, batch: TrainBatch, entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
        """The loss of a (micro-)batch from the actor's log-probs [B, T] of its tokens."""
        return self.policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.loss_weights,
                                batch.response_mask, ref_logprobs=batch.ref_logprobs, entropy=entropy)


def build_algorithm(cfg: AlgorithmConfig, max_response_len: int) -> Algorithm:
    """The algorithm of `cfg`; `max_response_len` is the rollout's limit on response tokens."""
    cfg.validate()
    if max_response_len < 1:
        raise ValueError(f"max_response_len must be >= 1, got {max_response_len}")
    if cfg.overlong_buffer > max_response_len:
        raise ValueError(
            f"algorithm.overlong_buffer={cfg.overlong_buffer} exceeds the max response length {max_response_len}"
        )
    estimators = {
        "grpo": partial(grpo_advantages, normalize_std=cfg.normalize_std, eps=cfg.eps),
        "dapo": partial(grpo_advantages, normalize_std=cfg.normalize_std, eps=cfg.eps),
        "rloo": rloo_advantages,
    }
    loss = partial(policy_loss, clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_ratio_c=cfg.clip_ratio_c,
                   log_ratio_clamp=cfg.log_ratio_clamp, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator)
    return Algorithm(
        name=cfg.name, advantages=estimators[cfg.name], policy_loss=loss, aggregation=cfg.aggregation,
        max_response_len=max_response_len, dynamic_sampling=cfg.dynamic_sampling,
        max_sampling_rounds=cfg.max_sampling_rounds, overlong_buffer=cfg.overlong_buffer,
        overlong_factor=cfg.overlong_factor, kl_coef=cfg.kl_coef,
    )
