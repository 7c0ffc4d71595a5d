"""The clipped policy-gradient surrogate (PPO / GRPO / DAPO), with dual clip and an optional KL penalty.

Per response token, with ratio rho = exp(clamp(log p - log p_old, +-log_ratio_clamp)) and
advantage A (Schulman et al., 2017, PPO; Yu et al., 2025, DAPO's clip-higher; Ye et al., 2020,
"Mastering Complex Control in MOBA Games with Deep RL", dual clip):

    pg        = max(-A * rho, -A * clip(rho, 1 - clip_low, 1 + clip_high))
    pg        = min(pg, -A * clip_ratio_c)  where A < 0   (dual clip; skipped when clip_ratio_c is None)
    per_token = pg + kl_coef * KL_k(p, p_ref)
    loss      = sum(per_token * loss_weights)            (see pipeline.algorithms.aggregation)

A token is *clipped high* when A > 0 and rho > 1 + clip_high, *clipped low* when A < 0 and
rho < 1 - clip_low, *dual-clipped* when A < 0 and rho > clip_ratio_c: in each case the loss is a
constant there and its gradient is 0. Without the dual clip, a token with A < 0 whose ratio grew
(one sampled far off-policy) adds -A * rho without bound and can dominate the batch's loss; with
it, it adds at most -A * clip_ratio_c. This is verl's `compute_policy_loss` (`clip_ratio_c`, whose
`actor/pg_clipfrac_lower` is `train/pg_clipfrac_dual` here). The log-ratio is clamped before
`exp`, so a token the policy moved far gives a finite loss even without the dual clip.

Metrics are over this call's response tokens: `train/pg_loss` is this call's share of the
mini-batch loss (micro-batches' values add up to the mini-batch's); the fractions and means are
token means (average micro-batches' values weighted by `train/response_tokens`).
"""

from __future__ import annotations

import torch

from pipeline.algorithms.kl import KLEstimator, kl_per_token, masked_mean


def policy_loss(
    logprobs: torch.Tensor,  # [B, T] the current policy's log-probs of the sampled tokens (with grad)
    old_logprobs: torch.Tensor,  # [B, T] the sampling policy's
    advantages: torch.Tensor,  # [B, T]
    loss_weights: torch.Tensor,  # [B, T] aggregation weights, 0 off the response
    response_mask: torch.Tensor,  # [B, T]
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,  # dual clip's bound on the ratio for A < 0; None: no dual clip
    log_ratio_clamp: float = 20.0,
    ref_logprobs: torch.Tensor | None = None,  # [B, T]
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy: torch.Tensor | None = None,  # [B, T] the policy's entropy per position, for the metric only
) -> tuple[torch.Tensor, dict[str, float]]:
    shape = logprobs.shape
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages), ("loss_weights", loss_weights),
                    ("response_mask", response_mask), ("ref_logprobs", ref_logprobs), ("entropy", entropy)):
        if t is not None and t.shape != shape:
            raise ValueError(f"policy_loss: {name} has shape {tuple(t.shape)}, logprobs {tuple(shape)}")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("policy_loss: kl_coef != 0 needs ref_logprobs")
    mask = response_mask.bool()
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = log_ratio.exp()
    adv = advantages.detach()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(unclipped, clipped)  # [B, T]
    if clip_ratio_c is not None:
        dual = (adv < 0) & (pg > -adv * clip_ratio_c)  # [B, T]
        pg = torch.where(dual, -adv * clip_ratio_c, pg)
    pg = torch.where(mask, pg, 0.0)
    weights = loss_weights.detach()
    pg_loss = (pg * weights).sum()
    loss = pg_loss

    with torch.no_grad():
        high = mask & (adv > 0) & (ratio > 1.0 + clip_high)
        low = mask & (adv < 0) & (ratio < 1.0 - clip_low)
        metrics = {
            "train/pg_loss": pg_loss.item(),
            "train/pg_clipfrac": masked_mean((high | low).float(), mask).item(),
            "train/pg_clipfrac_high": masked_mean(high.float(), mask).item(),
            "train/pg_clipfrac_low": masked_mean(low.float(), mask).item(),
            "train/ratio_mean": masked_mean(ratio, mask).item(),
            "train/approx_kl_old": masked_mean(-log_ratio, mask).item(),
            "train/response_tokens": float(mask.sum()),
        }
        if clip_ratio_c is not None:
            metrics["train/pg_clipfrac_dual"] = masked_mean(dual.float(), mask).item()
    if ref_logprobs is not None:
        kl = torch.where(mask, kl_per_token(logprobs, ref_logprobs.detach(), kl_estimator, log_ratio_clamp), 0.0)
        if kl_coef != 0.0:
            loss = loss + kl_coef * (kl * weights).sum()
        metrics["train/kl"] = masked_mean(kl.detach(), mask).item()
    if entropy is not None:
        metrics["train/entropy"] = masked_mean(entropy.detach(), mask).item()
    return loss, metrics
