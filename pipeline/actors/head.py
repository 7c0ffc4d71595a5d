"""The actor model's LM head, which hands back token log-probs (and entropies) instead of logits.

`install_head(model, chunk_tokens, float32)` swaps the class of a Hugging Face causal LM's output
embedding (an `nn.Linear`) for `LogprobHead`: the parameters, their names and their tying to the
input embedding stay what they were, so checkpoints, weight sync and optimizers see the same model.
Called plainly, the head returns logits as `nn.Linear` does (in float32 when `float32` is set: the
bf16-mixed actor's rule, pipeline/actors/precision.py). Inside `picking(model, input_ids, entropy)`,
the next call of the head returns instead, for every position, the log-prob of the next input token
and the entropy of the distribution it was drawn from, computed a chunk of tokens at a time
(pipeline/actors/chunked_head.py): the [tokens, V] logits of a micro-batch never exist.

Why inside the model's own forward rather than after it: the forward must go through the training
wrapper. DDP prepares its gradient reduction in its forward, and DeepSpeed ZeRO-3 gathers a module's
partitioned parameters when the module is called and again, through hooks on the module's outputs,
before its backward, then reduces and re-partitions the gradient after it. The head called as a
module, by the model, under the wrapper, gets all of that as any layer does: the head weight (the
embedding's, when tied) is whole while the chunked function uses it in the forward and in the
backward, and its gradient is handed back the usual way.

What it does not know: the loss, micro-batches, padding (the caller masks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pipeline.actors.chunked_head import chunked_token_logprobs

# Model settings under which the head's output is post-processed (a soft cap, a scale): the
# packed log-probs would be, too, so such models are refused rather than silently miscomputed.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclass
class _Pick:
    targets: torch.Tensor  # [b, T] the ids: position t's log-prob is that of targets[:, t + 1]
    scored: torch.Tensor  # [b, T] bool: the tokens whose log-probs are wanted; the others get 0 and cost nothing
    entropy: bool


class LogprobHead(torch.nn.Linear):
    """An nn.Linear LM head (class swapped in by `install_head`) that computes log-probs in chunks when asked."""

    chunk_tokens: int
    float32: bool
    pick: _Pick | None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [b, T, H] -> logits [b, T, V]; under `picking`, [b, T, 1 or 2] (log-prob, entropy)
        instead, token-aligned: [:, t] is log p(ids[t] | ids[:t]) and its entropy at the scored tokens, 0
        elsewhere (column 0 always)."""
        pick, self.pick = self.pick, None
        if pick is None:
            if not self.float32:
                return super().forward(hidden)
            with torch.autocast(hidden.device.type, enabled=False):
                return torch.nn.functional.linear(hidden.float(), self.weight, self.bias)
        b, T, H = hidden.shape
        if pick.targets.shape != (b, T):
            raise ValueError(f"LogprobHead: hidden states {tuple(hidden.shape)} for ids {tuple(pick.targets.shape)}")
        scored = pick.scored[:, 1:]  # [b, T-1]: position t predicts token t + 1, computed where that token is scored
        logprobs, entropy = chunked_token_logprobs(hidden[:, :-1][scored], self.weight, pick.targets[:, 1:][scored],
                                                   chunk_tokens=self.chunk_tokens, entropy=pick.entropy,
                                                   float32=self.float32)  # [n] each, n real targets
        columns = torch.stack([logprobs] + ([entropy] if pick.entropy else []), -1)  # [n, 1 or 2]
        packed = columns.new_zeros(b, T - 1, columns.shape[1]).index_put((scored,), columns)  # [b, T-1, 1 or 2]
        return torch.nn.functional.pad(packed, (0, 0, 1, 0))  # [b, T, 1 or 2]


def unwrapped(model) -> torch.nn.Module:
    """The Hugging Face model inside DDP / DeepSpeed wrappers (both keep it in `.module`)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def install_head(model, chunk_tokens: int, float32: bool = False) -> LogprobHead:
    """Make `model`'s output embedding a LogprobHead computing `chunk_tokens` tokens at a time."""
    config = getattr(model, "config", None)
    for key in _LOGIT_TRANSFORMS:
        if getattr(config, key, None) not in (None, 1.0):
            raise ValueError(f"the actor computes log-probs inside the LM head and cannot apply this model's "
                             f"{key}={getattr(config, key)} to its logits; models without it (Llama, Qwen2, Qwen3) "
                             "are supported")
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(f"the actor computes log-probs in chunks through an nn.Linear LM head without bias, got "
                         f"{type(head).__name__}{' with a bias' if getattr(head, 'bias', None) is not None else ''}")
    head.__class__ = LogprobHead
    head.chunk_tokens, head.float32, head.pick = chunk_tokens, float32, None
    return head


@contextlib.contextmanager
def picking(model, input_ids: torch.Tensor, scored: torch.Tensor, entropy: bool, chunk_tokens: int) -> Iterator[None]:
    """While open, the next call of `model`'s head returns the [b, T, 1 or 2] log-probs (and
    entropies) of `input_ids` [b, T] at the tokens `scored` [b, T] marks, 0 elsewhere, instead of logits.

    `model` may be wrapped (DDP, DeepSpeed). A head that is not yet a LogprobHead (a model not
    loaded by pipeline.actors.forward.load_policy) is made one, computing `chunk_tokens` at a time.
    """
    head = unwrapped(model).get_output_embeddings()
    if not isinstance(head, LogprobHead):
        head = install_head(unwrapped(model), chunk_tokens)
    head.pick = _Pick(targets=input_ids, scored=scored.bool(), entropy=entropy)
    try:
        yield
    finally:
        head.pick = None
