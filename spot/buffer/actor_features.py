"""The DataBuffer filled from the actor's log-prob forward, for rollout engines that cannot return
hidden states (vLLM while it runs an EAGLE drafter: engine.backends.vllm_engine).

The native engine hands its features to a DataBufferSink as it decodes (spot.buffer.sink). Here the
same entries come from the forward the loop runs anyway: the actor's old-log-prob recompute over
the step's rollouts (pipeline.trainer), asked for hidden states too (`logprobs_kwargs`). Per
rollout of L response tokens, as in DataBufferSink's entries:

    tokens   = prompt + response[:L-1]     (the last response token is never fed to the target)
    features = the target's features at those positions                     [P + L - 1, F]

The feature is engine.features.target_features' (aux layer outputs, then the final post-norm
hidden state); in the actor's Hugging Face indexing the output of decoder layer i is
`hidden_states[i + 1]`, and the final one is `LogProbs.hidden`. Teacher-forced features equal the
engine's to fp tolerance (the policy is the same weights; tests/test_spot_actor_features.py).

One-step lag: the spot trainer trains in step t's idle window, which comes before step t's actor
forward, so it sees entries of steps up to t - 1 (the native sink's are in the buffer by then).
`DataBuffer.sample(step=t)` finds no step-t entries and draws from step t - 1's longest half.

`HeadTarget` is what the spot trainer's drafter reads of its target (the embedding and the LM
head: engine.spec.eagle) when no native target runs in this process; it follows the policy by
watching the weights the loop syncs to the engine (`follow`), so no second pass over them.
What this module does not know: which engine runs, how the actor computes its forward.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.types import FinishReason, Rollout
from spot.buffer.ring import BufferEntry, DataBuffer

EMBED, HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"


class ActorFeatures:
    """Builds and puts one BufferEntry per rollout from an actor forward over the step's TrainBatch."""

    lag = 1  # step t's entries arrive after step t's idle window: the spot trainer samples step t - 1's

    def __init__(self, buffer: DataBuffer, *, max_new_tokens: int, feature_layers: Sequence[int] = (),
                 num_layers: int, head: HeadTarget | None = None) -> None:
        if any(not 0 <= i < num_layers - 1 for i in feature_layers):
            # HF's hidden_states[num_layers] is the post-norm state, not the last layer's raw output.
            raise ValueError(f"feature layers {list(feature_layers)}: the actor's forward returns the outputs of "
                             f"decoder layers 0..{num_layers - 2} (and the final post-norm state)")
        self.buffer, self.max_len, self.head = buffer, max_new_tokens, head
        self.feature_layers = tuple(feature_layers)
        self.skipped = 0

    @property
    def logprobs_kwargs(self) -> dict:
        """What actor.logprobs must also return for `put`."""
        return {"hidden": True, "hidden_layers": tuple(i + 1 for i in self.feature_layers) or None}

    def features(self, out) -> torch.Tensor:
        """out: a pipeline.actors.base.LogProbs with hidden states -> [B, T, F] (target_features' layout)."""
        if out.hidden is None:
            raise ValueError("actor.logprobs returned no hidden states: call it with ActorFeatures.logprobs_kwargs")
        return torch.cat([out.hidden_layers[i + 1] for i in self.feature_layers] + [out.hidden], -1)

    def put(self, rollouts: Sequence[Rollout], prompts: Sequence[Sequence[int]], input_ids: torch.Tensor, out,
            step: int) -> int:
        """rollouts[i] is row i of input_ids [B, T] (prompts[i] + its response, right-padded) and of the
        forward `out`; puts their entries, returns how many (rollouts of < 2 tokens are skipped)."""
        feats = self.features(out)  # [B, T, F]
        put = 0
        for i, (ro, prompt) in enumerate(zip(rollouts, prompts, strict=True)):
            L = len(ro.tokens)
            if L < 2:
                self.skipped += 1
                continue
            P, n = len(prompt), min(L, self.max_len) - 1
            self.buffer.put(BufferEntry(
                key=f"{ro.prompt_id}/{ro.sample}", step=step, policy_version=ro.policy_version,
                finished=ro.finish_reason == FinishReason.STOP, prompt_len=P, tokens=input_ids[i, : P + n].cpu(),
                features=feats[i, : P + n].to("cpu", self.buffer.dtype),
            ))
            put += 1
        return put

    # spot.coordinator's sink hooks after each generate call and as the idle window opens: nothing
    # to do, the entries come later from the actor forward (`put`).
    def stash(self, rollouts: Sequence[Rollout], step: int) -> None:
        pass

    def put_stashed(self, hold: int = 0) -> int:
        return 0


class HeadTarget(nn.Module):
    """A target's embedding, LM head and final norm only, under the names an EagleModel reads
    (`model.embed_tokens`, `lm_head`, `model.norm`, `config`, `device`, `dtype`); zeros (the norm:
    ones) until the first `follow`ed weight sync."""

    def __init__(self, config: ModelConfig, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for p in self.parameters():
            p.requires_grad_(False)
            p.zero_()
        # The final norm's weight: an mtp drafter divides it out of the features (engine.spec.eagle).
        self.model.norm = nn.Module()
        self.model.norm.weight = nn.Parameter(torch.ones(config.hidden_size, device=device, dtype=dtype), requires_grad=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def follow(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Passes the policy's (HF name, tensor) pairs through, copying the embedding and LM head as they go by."""
        want = {EMBED: self.model.embed_tokens.weight, NORM: self.model.norm.weight}
        if not self.config.tie_word_embeddings:
            want[HEAD] = self.lm_head.weight
        seen = set()
        for name, t in named:
            if name in want:
                want[name].copy_(t)
                seen.add(name)
            yield name, t
        if seen != set(want):
            raise ValueError(f"the policy's weights had no {sorted(set(want) - seen)}: the spot drafter reads the "
                             "target's embedding, LM head and final norm by these Hugging Face names")
