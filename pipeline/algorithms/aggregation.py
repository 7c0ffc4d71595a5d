"""Loss aggregation as per-token weights: loss = sum(per_token_loss * loss_weights).

Modes, for a mini-batch of B responses with response lengths L_i (tokens where the mask is 1):

- `token-mean` (DAPO): every response token of the mini-batch weighs 1 / sum_i L_i, so long
  responses weigh more in total.
- `seq-mean-token-mean` (the original GRPO): each response's token mean, averaged over the B
  responses: weight 1 / (L_i * B).
- `seq-mean-token-sum-norm` (Dr. GRPO): each response's token sum divided by a constant, the
  maximum response length, averaged over B: weight 1 / (B * max_response_len). No length bias.

The weights are computed once per mini-batch (the optimizer step) and sliced with it into
micro-batches, so gradient accumulation reproduces the mini-batch gradient exactly. A response
with no tokens contributes nothing and still counts in B. Pure tensor math.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


def loss_weights(
    response_mask: torch.Tensor,  # [B, T] 1 on response tokens
    mode: Aggregation,
    max_response_len: int | None = None,
) -> torch.Tensor:  # [B, T] float
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got shape {tuple(response_mask.shape)}")
    mask = response_mask.float()
    B = mask.shape[0]
    if mode == "token-mean":
        return mask / mask.sum().clamp(min=1.0)
    if mode == "seq-mean-token-mean":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1.0) * B)
    if mode == "seq-mean-token-sum-norm":
        if max_response_len is None or max_response_len < 1:
            raise ValueError(f"seq-mean-token-sum-norm needs max_response_len >= 1, got {max_response_len}")
        return mask / (B * max_response_len)
    raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {', '.join(AGGREGATIONS)}")
