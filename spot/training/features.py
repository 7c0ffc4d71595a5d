"""The target's features for whole sequences, by one teacher-forced forward (no KV cache).

The feature is engine.features.target_features (one definition, shared with the engine's
feature sink): the outputs of the target's auxiliary layers (eagle3), then its final hidden
state after the final norm. `target` is the model or, faster, the engine's runtime of it
(engine.runtime.TargetRuntime: packed layers, compiled kernels). Sequences are sorted by length and run in right-padded batches
of at most `batch_tokens` padded tokens; the causal mask keeps padding out of real positions.
Runs under no_grad: the rows hold detached copies, so no gradient can reach the target.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.features import target_features
from spot.training.records import HiddenStateRows


@dataclass
class TokenSequence:
    prompt_id: str
    sample: int
    tokens: list[int]  # prompt + response
    prompt_len: int


@torch.no_grad()
def capture_features(
    target,
    sequences: Sequence[TokenSequence],
    aux_layers: Sequence[int] = (),
    *,
    batch_tokens: int = 4096,
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int], None] | None = None,
) -> list[HiddenStateRows]:
    """One HiddenStateRows per sequence, in input order; `progress(tokens done)` after each batch."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].tokens))
    rows: list[HiddenStateRows | None] = [None] * len(sequences)
    device, done = target.device, 0
    while order:
        take = 1  # a batch always holds one sequence, however long
        while take < len(order) and (take + 1) * len(sequences[order[take]].tokens) <= batch_tokens:
            take += 1
        batch, order = order[:take], order[take:]
        T = len(sequences[batch[-1]].tokens)
        ids = torch.zeros(len(batch), T, dtype=torch.long)  # [B, T] right-padded
        for j, i in enumerate(batch):
            ids[j, : len(sequences[i].tokens)] = torch.tensor(sequences[i].tokens)
        pos = torch.arange(T).expand(len(batch), T)
        out = target(ids.to(device), pos.to(device), logits=False, hidden_layers=tuple(aux_layers))
        feats = target_features(out, aux_layers).to("cpu", dtype)  # [B, T, F]
        for j, i in enumerate(batch):
            s = sequences[i]
            n = len(s.tokens)
            rows[i] = HiddenStateRows(
                prompt_id=s.prompt_id, sample=s.sample, tokens=ids[j, :n].clone(), features=feats[j, :n].clone(),
                prompt_len=s.prompt_len,
            )
            done += n
        if progress is not None:
            progress(done)
    return rows  # type: ignore[return-value]
