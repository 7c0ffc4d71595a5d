"""Advantages of sampled responses from their rewards, per group (GRPO, Dr. GRPO, RLOO).

Vocabulary: a *group* is the n responses sampled for one prompt; rewards arrive flat, one per
response, with the id of the group each belongs to (`group_ids`), or as a [G, n] tensor of equal
groups. Every group needs at least 2 responses: a baseline from one sample is the sample itself.

- GRPO (Shao et al., 2024, DeepSeekMath): A_i = (r_i - mean_g) / (std_g + eps), with the unbiased
  standard deviation of the group. Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like
  Training") drops the division: `normalize_std=False` gives A_i = r_i - mean_g.
- RLOO (Ahmadian et al., 2024): the baseline of response i is the mean of the *other* responses of
  its group, A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_g).

A group whose rewards are all equal gets advantage exactly 0 everywhere (it carries no signal;
DAPO's dynamic sampling drops such groups before this point). The group statistics are computed in
float64 for this: n equal float32 rewards r sum exactly to n * r there (n < 2^29), so the mean is r
and the centred rewards and the std are exactly 0. In float32 the sum can miss by a rounding step
(13 rewards of -1.7), leaving a std of ~1e-7 that would pass any `std > 0` test and give every
response an advantage of a sign chosen by rounding. Advantages are returned in float32.
Pure functions of tensors; each returns `(advantages, metrics)` with metrics named `train/...`.
"""

from __future__ import annotations

import torch


def _as_flat(rewards: torch.Tensor, group_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rewards [N] float, group index [N] in 0..G-1), from [G, n] or flat + ids."""
    if group_ids is None:
        if rewards.dim() != 2:
            raise ValueError(f"rewards must be [G, n] when group_ids is None, got shape {tuple(rewards.shape)}")
        G, n = rewards.shape
        return rewards.reshape(-1).float(), torch.arange(G, device=rewards.device).repeat_interleave(n)
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"flat rewards [N] need group_ids [N]; got rewards {tuple(rewards.shape)}, group_ids {tuple(group_ids.shape)}"
        )
    _, index = torch.unique(group_ids, return_inverse=True)
    return rewards.float(), index


def _group_sums(values: torch.Tensor, index: torch.Tensor, G: int) -> torch.Tensor:  # [N] -> [G]
    return torch.zeros(G, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def _centered(rewards: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (r - group mean [N], group std (unbiased) [N], group size [N]), all float64 (see the module docstring)."""
    rewards = rewards.double()
    G = int(index.max()) + 1 if index.numel() else 0
    sizes = _group_sums(torch.ones_like(rewards), index, G)  # [G]
    if bool((sizes < 2).any()):
        raise ValueError(f"every group needs >= 2 responses for a baseline; group sizes {sizes.long().tolist()}")
    centered = rewards - (_group_sums(rewards, index, G) / sizes)[index]  # [N]
    std = (_group_sums(centered**2, index, G) / (sizes - 1)).sqrt()  # [G]
    return centered, std[index], sizes[index]


def _metrics(rewards: torch.Tensor, adv: torch.Tensor, std: torch.Tensor, sizes: torch.Tensor) -> dict[str, float]:
    n_groups = float((1.0 / sizes).sum())  # each response counts 1/|group|
    return {
        "train/reward_mean": rewards.mean().item(),
        "train/reward_std_in_group": (std / sizes).sum().item() / n_groups,
        "train/zero_std_groups": ((std == 0).float() / sizes).sum().item() / n_groups,
        "train/adv_mean": adv.mean().item(),
        "train/adv_abs_mean": adv.abs().mean().item(),
    }


def grpo_advantages(
    rewards: torch.Tensor,  # [G, n], or [N] with group_ids
    group_ids: torch.Tensor | None = None,  # [N] any integer id per group
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO advantages, shaped like `rewards`; `normalize_std=False` is Dr. GRPO's."""
    flat, index = _as_flat(rewards, group_ids)
    centered, std, sizes = _centered(flat, index)
    # where(): a group of equal rewards gets 0, not 0/0, even with eps = 0
    adv = (torch.where(std > 0, centered / (std + eps), 0.0) if normalize_std else centered).float()
    return adv.reshape(rewards.shape), _metrics(flat, adv, std, sizes)


def rloo_advantages(
    rewards: torch.Tensor,  # [G, n], or [N] with group_ids
    group_ids: torch.Tensor | None = None,  # [N]
) -> tuple[torch.Tensor, dict[str, float]]:
    """RLOO advantages r_i - mean of the group's other rewards, shaped like `rewards`."""
    flat, index = _as_flat(rewards, group_ids)
    centered, std, sizes = _centered(flat, index)
    adv = (centered * sizes / (sizes - 1)).float()
    return adv.reshape(rewards.shape), _metrics(flat, adv, std, sizes)


def token_advantages(
    advantages: torch.Tensor,  # [B] one per response
    response_mask: torch.Tensor,  # [B, T]
) -> torch.Tensor:  # [B, T]
    """A sequence's advantage on each of its response tokens, 0 elsewhere (TrainBatch.advantages)."""
    if advantages.dim() != 1 or response_mask.dim() != 2 or advantages.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"advantages [B] and response_mask [B, T] expected, got {tuple(advantages.shape)} and {tuple(response_mask.shape)}"
        )
    return advantages.float()[:, None] * response_mask.float()
