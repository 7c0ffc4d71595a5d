"""RL algorithms as pure functions of tensors: advantages (GRPO, Dr. GRPO, RLOO), loss aggregation
weights, the clipped surrogate with DAPO's clip-higher and verl's dual clip, KL estimators,
dynamic sampling and overlong shaping. `build_algorithm(AlgorithmConfig, max_response_len)` binds
them for the loop. Every function returns `(value, metrics)` with metrics named `train/...`
(loss_weights and kl_per_token return a tensor only). Nothing here knows about models, ranks or I/O.

The math follows verl's `core_algos` (the field's reference), including its defaults where the
papers leave a choice: dual clip is on at `algorithm.clip_ratio_c: 3.0` for every algorithm, so a
token with a negative advantage (one sampled far off-policy, say) adds at most -A * 3 to the loss
however far its ratio grew; the loss differs from plain PPO clipping only at tokens with A < 0 and
a ratio above 3, counted in `train/pg_clipfrac_dual`. `clip_ratio_c: null` turns it off.
A group whose rewards are all equal gets advantage exactly 0 under every estimator.
"""

from pipeline.algorithms.advantages import grpo_advantages, rloo_advantages, token_advantages
from pipeline.algorithms.aggregation import AGGREGATIONS, loss_weights
from pipeline.algorithms.algorithm import Algorithm, build_algorithm
from pipeline.algorithms.config import AlgorithmConfig
from pipeline.algorithms.dynamic_sampling import fill_groups, informative_groups
from pipeline.algorithms.kl import KL_ESTIMATORS, kl_per_token, mismatch_kl
from pipeline.algorithms.overlong import overlong_penalty
from pipeline.algorithms.policy_loss import policy_loss

__all__ = [
    "AGGREGATIONS", "Algorithm", "AlgorithmConfig", "KL_ESTIMATORS", "build_algorithm", "fill_groups",
    "grpo_advantages", "informative_groups", "kl_per_token", "loss_weights", "mismatch_kl", "overlong_penalty",
    "policy_loss", "rloo_advantages", "token_advantages",
]
