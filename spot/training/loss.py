"""The drafter loss (TLT / EAGLE) and the held-out predictors of speculative acceptance.

Pure functions of tensors over M loss pairs (see spot.training.pairs):

- `eagle_loss`: smooth-L1 between the predicted and the target's next feature (weight 1.0) plus
  0.1 x the soft cross-entropy -sum_x p(x) log q(x), where p is the target's distribution of the
  next token restricted to the draft vocabulary and renormalised, and q the drafter's.
- `acceptance_metrics`: top-1 agreement (the drafter's argmax is the target's argmax over the
  full vocabulary) and the expected acceptance sum_x min(p(x), q(x)) at temperature 1 with p
  the target's full distribution: the probability that one drafted token survives standard
  speculative sampling (1 - total variation). Both predict the acceptance length.

Both return `(value, metrics)`; metrics are floats named `spot/...`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def eagle_loss(
    pred: torch.Tensor,  # [M, F] predicted f_{t+1}
    target: torch.Tensor,  # [M, F] the target's f_{t+1}
    draft_logits: torch.Tensor,  # [M, Vd] the drafter's logits from pred
    target_logits: torch.Tensor,  # [M, Vd] the target's logits on the same draft-vocabulary rows
    *,
    feature_weight: float = 1.0,
    ce_weight: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    feat = F.smooth_l1_loss(pred.float(), target.float())
    p = target_logits.detach().float().softmax(-1)  # renormalised over the draft vocabulary
    logq = draft_logits.float().log_softmax(-1)
    ce = -(p * logq).sum(-1).mean()
    loss = feature_weight * feat + ce_weight * ce
    with torch.no_grad():
        top1 = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
    return loss, {
        "spot/drafter_loss": loss.item(), "spot/feature_loss": feat.item(), "spot/ce_loss": ce.item(),
        "spot/top1_draft_vocab": top1.item(),
    }


@torch.no_grad()
def acceptance_metrics(
    draft_logits: torch.Tensor,  # [M, Vd]
    target_logits: torch.Tensor,  # [M, V] full vocabulary
    vocab_ids: torch.Tensor | None,  # [Vd] target ids of the draft rows; None: Vd == V
) -> tuple[torch.Tensor, dict[str, float]]:
    """-> (per-pair expected acceptance [M], {top1_agreement, expected_acceptance})."""
    p = target_logits.float().softmax(-1)  # [M, V]
    q = draft_logits.float().softmax(-1)  # [M, Vd]
    draft_top = draft_logits.argmax(-1)
    if vocab_ids is not None:
        p_on_draft = p[:, vocab_ids]  # [M, Vd]; q is 0 outside the draft vocabulary
        draft_top = vocab_ids[draft_top]
    else:
        p_on_draft = p
    accept = torch.minimum(p_on_draft, q).sum(-1)  # [M]
    top1 = (draft_top == target_logits.argmax(-1)).float()
    return accept, {"spot/top1_agreement": top1.mean().item(), "spot/expected_acceptance": accept.mean().item()}
