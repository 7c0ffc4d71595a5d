"""Rollouts to a `TrainBatch`: prompt + response rows, right-padded, token-aligned (pipeline.records).

The engine's log-prob of response token i (the sampling distribution's, engine.sampling) sits in
the column of that token, like the actor's; the advantage of a rollout is broadcast over its
response tokens. Old log-probs and loss weights are filled in by the loop (they need the actor
and the mini-batch split).
"""

from __future__ import annotations

import torch

from pipeline.records import TrainBatch


def pack_rollouts(prompts: list[list[int]], responses: list[list[int]], engine_logprobs: list[list[float]],
                  advantages: torch.Tensor, pad_id: int) -> TrainBatch:
    """prompts[i] is row i's prompt (repeat it per sample); advantages [N]."""
    N = len(responses)
    T = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.full((N, T), pad_id, dtype=torch.long)
    attn = torch.zeros(N, T)
    resp = torch.zeros(N, T)
    eng = torch.zeros(N, T)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, engine_logprobs)):
        P, R = len(p), len(r)
        ids[i, :P] = torch.tensor(p)
        ids[i, P : P + R] = torch.tensor(r, dtype=torch.long)
        attn[i, : P + R] = 1
        resp[i, P : P + R] = 1
        eng[i, P : P + R] = torch.tensor(lp)
    zeros = torch.zeros(N, T)
    return TrainBatch(input_ids=ids, attention_mask=attn, response_mask=resp, old_logprobs=zeros,
                      advantages=advantages.float().unsqueeze(1) * resp, loss_weights=zeros.clone(), engine_logprobs=eng)


def gradient_rows(batch: TrainBatch) -> torch.Tensor:
    """The rows [k] whose advantage is nonzero on some token: the only ones the clipped surrogate
    takes a gradient from (pipeline.algorithms.policy_loss). With none, the shortest row, so that
    every data-parallel rank still runs a backward, which holds the gradients' all-reduce."""
    live = (batch.advantages != 0).any(-1)  # [B]
    if bool(live.any()):
        return live.nonzero().squeeze(1)
    return batch.attention_mask.sum(-1).argmin().view(1)
