"""The frozen reference policy for the KL term (`algorithm.kl_coef > 0`): the starting weights.

Loaded from the same Hugging Face folder as the actor, never updated; its log-prob forward is
the actor's (pipeline.actors.forward, in its precision), micro-batched by the same token budget.
"""

from __future__ import annotations

import torch

from pipeline.actors.base import ActorConfig
from pipeline.actors.forward import batched_logprobs, forward_in, load_policy
from pipeline.actors.torch_actor import actor_device


class ReferencePolicy:
    def __init__(self, cfg: ActorConfig, model_path) -> None:
        self.cfg, self.device = cfg, actor_device(cfg)
        self.model = load_policy(model_path, cfg).to(self.device).eval().requires_grad_(False)
        self.forward = forward_in(self.model, cfg)

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return batched_logprobs(self.forward, input_ids.to(self.device), attention_mask.to(self.device),
                                self.cfg.micro_batch_tokens).logprobs.cpu()
