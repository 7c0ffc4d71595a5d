"""SlotState: the per-slot state of a running batch (a slot is a row of the KV cache).

Tensors hold what every decode step reads and writes; plain lists hold per-slot objects the
drafters need (prompt, prompt id, pre-generated draft). Active rows are slots 0..active-1;
when rows finish, the others are moved into the holes (`move`), tensors and lists together.
"""

from __future__ import annotations

import torch


class SlotState:
    def __init__(self, max_batch: int, max_new: int, device) -> None:
        z = lambda dtype=torch.long: torch.zeros(max_batch, dtype=dtype, device=device)  # noqa: E731
        self.keys = z()  # noise key per row
        self.generated = z()  # tokens emitted so far (the last one is the root)
        self.limit = z()  # most tokens this row may emit (max_new_tokens, or the context)
        self.rollout = z()  # index of the rollout this row produces
        self.sample = z()  # sample index within its request
        self.stopped = z(torch.bool)
        self.done = z(torch.bool)
        self.preempted = z(torch.bool)  # ended by generate's should_stop (the run ends with this step)
        self.predicted = z()  # the request's predicted response length (Request.predicted_len), 0: none
        self.tokens = torch.zeros(max_batch, max_new, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(max_batch, max_new, dtype=torch.float32, device=device)
        self.prompt_ids: list[str] = [""] * max_batch
        self.prompts: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long)] * max_batch
        self.drafts: list[torch.Tensor | None] = [None] * max_batch
        self.siblings: list[torch.Tensor | None] = [None] * max_batch  # the request's other samples' drafts, joined
        self.active = 0

    def _tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.generated, self.limit, self.rollout, self.sample, self.stopped, self.done, self.preempted,
                self.predicted, self.tokens, self.logprobs]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in self._tensors():
            t[dst] = t[src]
        for s, d in zip(src.tolist(), dst.tolist()):
            self.prompt_ids[d], self.prompts[d], self.drafts[d] = self.prompt_ids[s], self.prompts[s], self.drafts[s]
            self.siblings[d] = self.siblings[s]

    def preempt(self) -> None:
        """Ends every active row that is not done yet, as preempted."""
        b = self.active
        self.preempted[:b] = ~self.done[:b]
        self.done[:b] = True

    def roots(self, b: int) -> torch.Tensor:  # [b] last emitted token of each active row
        return self.tokens[:b].gather(1, (self.generated[:b] - 1).unsqueeze(1)).squeeze(1)
