"""Per-token estimators of KL divergence from samples, and the rollout / actor mismatch.

For tokens x sampled from p (log-prob `logprobs`) and a reference q (`ref_logprobs`), with
log r = log q(x) - log p(x), Schulman's estimators of KL(p || q) (http://joschu.net/blog/kl-approx.html):

- k1 = -log r            unbiased, high variance, can be negative per token;
- k2 = (log r)^2 / 2     biased, low variance, >= 0;
- k3 = (r - 1) - log r   unbiased, low variance, >= 0 (the GRPO paper's choice).

log r is clamped to +-`log_ratio_clamp` before `exp`, so a far-off token gives a large finite
value, not inf. `mismatch_kl` applies k3 to the rollout engine's log-probs of its own samples
against the actor's recomputed ones: it is ~0 when the two compute the same policy.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)


def kl_per_token(
    logprobs: torch.Tensor,  # [B, T] log p(x) of the sampled tokens
    ref_logprobs: torch.Tensor,  # [B, T] log q(x)
    estimator: KLEstimator = "k3",
    log_ratio_clamp: float = 20.0,
) -> torch.Tensor:  # [B, T]
    log_r = (ref_logprobs - logprobs).clamp(-log_ratio_clamp, log_ratio_clamp)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return log_r.exp() - 1.0 - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is 1 (0 when the mask is empty); NaNs outside the mask are ignored."""
    m = mask.bool()
    return torch.where(m, values, 0.0).sum() / m.sum().clamp(min=1)


@torch.no_grad()
def mismatch_kl(
    engine_logprobs: torch.Tensor,  # [B, T] the rollout engine's log-probs of its samples
    actor_logprobs: torch.Tensor,  # [B, T] the actor's recomputed log-probs of the same tokens
    response_mask: torch.Tensor,  # [B, T]
) -> tuple[torch.Tensor, dict[str, float]]:
    """k3 estimate of KL(engine || actor) over response tokens -> (value, {train/mismatch_kl, ...})."""
    kl = masked_mean(kl_per_token(engine_logprobs, actor_logprobs, "k3"), response_mask)
    gap = masked_mean((engine_logprobs - actor_logprobs).abs(), response_mask)
    return kl, {"train/mismatch_kl": kl.item(), "train/mismatch_logprob_abs_diff": gap.item()}
