"""Where the PPO ratio's old log-probs come from, and the update forward's own kept for later epochs.

Sources (`trainer.old_logprobs`; `auto` picks in this order where each holds):

    engine  the rollout engine's own log-probs of the sampled tokens: exactly the old policy's in
            synchronous mode when the sampling distribution is the policy's (T = 1, no top-k / top-p)
            and the backend's log-probs are exact (pipeline.update.learner.uses_engine_logprobs); free.
    update  the update's own forward, detached, for the rows whose first pass through the actor comes
            before any optimizer step of the RL step (the first mini-batch of the first epoch: every
            row with one mini-batch), the ratio is then exactly 1 there; one no-grad forward before
            the update over the rows of the later mini-batches only. TRL's GRPO does the same at
            `num_iterations=1` (`old_per_token_logps = per_token_logps.detach()`).
    actor   one no-grad actor forward over every row before the update.

`auto` keeps `actor` where `update` does not apply: the asynchronous mode (the behaviour policy is
one update behind, and the importance weight on the advantages needs the old log-probs before the
update starts), and spot training that reads its features from the actor (spot.buffer.actor_features:
the update's forward returns no hidden states through `Actor.update`, and leaves rows of advantage
0 out, which the DataBuffer still wants).

`UpdateLogprobs` keeps what the first mini-batch's forward computed, for the same rows' later
epochs. What it does not know: how the actor backend cuts a mini-batch into micro-batches.
"""

from __future__ import annotations

from typing import Literal

import torch

from pipeline.records import TrainBatch

Source = Literal["engine", "update", "actor"]


def old_logprobs_source(trainer_cfg, engine_exact: bool, actor_features: bool) -> Source:
    """The source of `trainer_cfg.old_logprobs` (auto resolved); `engine_exact`: the engine's log-probs
    are the old policy's (pipeline.update.learner.uses_engine_logprobs); `actor_features`: spot training
    fills the DataBuffer from the actor's forward."""
    choice = trainer_cfg.old_logprobs
    if choice == "engine" or (choice == "auto" and engine_exact):
        return "engine"
    if choice == "update":
        if trainer_cfg.async_steps:
            raise ValueError("trainer.old_logprobs=update needs trainer.async_steps=0 (asynchronous rollouts come from "
                             "the policy one update behind): use actor or auto")
        if actor_features:
            raise ValueError("trainer.old_logprobs=update cannot fill the DataBuffer from the actor's forward (spot "
                             "training with an engine that returns no hidden states): use actor or auto")
        return "update"
    if choice == "auto" and not trainer_cfg.async_steps and not actor_features:
        return "update"
    return "actor"


def _row_key(ids: torch.Tensor, mask: torch.Tensor) -> tuple[int, ...]:
    """A row's real tokens (ids [T], mask [T]), which every micro-batch cut of it keeps."""
    return tuple(ids[mask.bool()].tolist())


class UpdateLogprobs:
    """The log-probs of a mini-batch's rows as the update's forward computed them, gathered from its
    micro-batches (`put`, from inside the loss) into one [B, T] tensor (`logprobs`).

    The actor backend regroups, trims and pads the mini-batch's rows into micro-batches without
    saying which row is which, so a row is recognised by its real tokens. Rows with equal tokens
    have equal log-probs (the same input to the same weights), so which of them takes which copy
    does not matter. Rows of a micro-batch without response tokens (a backend's zero-weight filler
    copies) carry nothing to keep and are passed over.
    """

    def __init__(self, mb: TrainBatch) -> None:
        self.slots: dict[tuple[int, ...], list[int]] = {}
        for i in range(mb.size):
            if bool(mb.response_mask[i].any()):
                self.slots.setdefault(_row_key(mb.input_ids[i], mb.attention_mask[i]), []).append(i)
        self.logprobs = torch.zeros_like(mb.old_logprobs)  # [B, T]

    def put(self, micro: TrainBatch, logprobs: torch.Tensor) -> None:
        """micro: rows of the mini-batch, trimmed to their first L columns; logprobs [b, L] detached."""
        ids, mask = micro.input_ids.cpu(), micro.attention_mask.cpu()
        has_response = micro.response_mask.bool().any(-1).tolist()  # [b]
        for j, live in enumerate(has_response):
            if live:
                i = self.slots[_row_key(ids[j], mask[j])].pop()
                self.logprobs[i, : ids.shape[1]] = logprobs[j].cpu()

    def complete(self) -> bool:
        """Whether every row with response tokens was put."""
        return not any(self.slots.values())
