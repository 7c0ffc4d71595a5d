"""DAPO's soft overlong punishment: a length penalty added to the reward near the length limit.

With the maximum response length L_max and a buffer of L_buf tokens (Yu et al., 2025, eq. 13):

    penalty(L) = 0                                  if L <= L_max - L_buf
               = -factor * (L - (L_max - L_buf)) / L_buf   if L_max - L_buf < L <= L_max
               = -factor                            if L > L_max

so a response loses reward linearly over the last L_buf tokens before truncation, reaching
-factor at the limit. `buffer = 0` turns it off. Pure tensor math.
"""

from __future__ import annotations

import torch


def overlong_penalty(
    lengths: torch.Tensor,  # [N] response lengths in tokens
    max_response_len: int,
    buffer: int,
    factor: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:  # penalty [N] float, <= 0
    if not 0 <= buffer <= max_response_len:
        raise ValueError(f"overlong buffer must be in 0..max_response_len={max_response_len}, got {buffer}")
    if buffer == 0:
        penalty = torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    else:
        excess = (lengths.float() - (max_response_len - buffer)).clamp(min=0.0)
        penalty = -factor * (excess / buffer).clamp(max=1.0)
    return penalty, {
        "train/overlong_penalty_mean": penalty.mean().item() if penalty.numel() else 0.0,
        "train/overlong_penalized_frac": (penalty < 0).float().mean().item() if penalty.numel() else 0.0,
    }
