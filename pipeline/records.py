"""Records passed between the RL loop's stages (rollouts -> rewards -> advantages -> the actor).

Alignment rule, used by every per-token tensor here: column t describes token input_ids[:, t];
its log-prob is log p(input_ids[:, t] | input_ids[:, :t]) (column 0, the first prompt token,
has none and is 0). Only response tokens carry loss: `response_mask` is 1 exactly there.

`loss_weights` makes micro-batching exact: the aggregation mode (token-mean, seq-mean-token-mean,
seq-mean-token-sum-norm) is turned, once per mini-batch, into a weight per token, and a loss is
`sum(per_token_loss * loss_weights)`. Splitting a mini-batch into micro-batches then only
splits that sum, so gradient accumulation gives the same gradient whatever the micro-batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class TrainBatch:
    input_ids: torch.Tensor  # [B, T] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, T] 1 on real tokens (prompt and response)
    response_mask: torch.Tensor  # [B, T] 1 on response tokens
    old_logprobs: torch.Tensor  # [B, T] the sampling-time policy's log-probs (recomputed by the actor)
    advantages: torch.Tensor  # [B, T] per token (a sequence's advantage broadcast over its response)
    loss_weights: torch.Tensor  # [B, T] aggregation weights: loss = sum(per_token_loss * loss_weights)
    ref_logprobs: torch.Tensor | None = None  # [B, T] reference policy, when a KL term is on
    engine_logprobs: torch.Tensor | None = None  # [B, T] the rollout engine's, for train/mismatch_kl

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        if self.input_ids.dim() != 2:
            raise ValueError(f"TrainBatch.input_ids must be [B, T], got {tuple(shape)}")
        for name in ("attention_mask", "response_mask", "old_logprobs", "advantages", "loss_weights",
                     "ref_logprobs", "engine_logprobs"):
            t = getattr(self, name)
            if t is not None and t.shape != shape:
                raise ValueError(f"TrainBatch.{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor | slice) -> TrainBatch:
        """The sub-batch of these rows (a micro- or mini-batch); weights are kept as they are."""
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return TrainBatch(**{name: pick(getattr(self, name)) for name in self.__dataclass_fields__})

    def to(self, device) -> TrainBatch:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TrainBatch(**{name: move(getattr(self, name)) for name in self.__dataclass_fields__})
