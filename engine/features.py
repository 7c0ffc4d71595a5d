"""The target's features, and the sink that receives them for every committed token.

`target_features(out, aux_layers)` is the one definition of "the features" a drafter reads and
the DataBuffer stores: the outputs of the target's auxiliary layers (eagle3) in the given order,
then its final hidden state after the final norm: [..., F] with F = H * (len(aux_layers) + 1).
The engine computes them on every decode and verify pass; drafter training (spot.training.features)
computes them by a teacher-forced pass; both call this function.

A `FeatureSink` (optional, attached to the engine) receives them as they are computed:
`prompt(...)` once per request at its prefill (the features at every prompt position), and
`tokens(CommittedFeatures)` after every decode step for every token that entered the KV cache
and stays in the rollout: per rollout of L response tokens, positions 0..L-2 (the last token is
never fed to the target). The feature at response position i is the target's hidden state with
token i as input: it predicts token i + 1 (an EAGLE training pair is (f_i, x_{i+1})).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


def target_features(out, aux_layers: Sequence[int]) -> torch.Tensor:
    """out: an engine.model.ModelOutput -> [B, T, F]: aux layer outputs in order, then the final hidden."""
    return torch.cat([out.layer_hidden[i] for i in aux_layers] + [out.hidden], -1)


@dataclass
class CommittedFeatures:
    """One decode step's committed tokens: M entries over the step's b active rows.

    Valid during the `tokens` call only: a sink that keeps a tensor copies it (`features` may be a
    view of the engine's own output). Rollout indices are given out in increasing order as rows
    are admitted, and an admitted row is in every step's entries until it retires, so a sink can
    tell a newly admitted row by its index alone."""

    prompt_ids: list[str]  # [b] per active row
    samples: torch.Tensor  # [b] sample index per active row
    rollouts: torch.Tensor  # [b] per active row: its rollout's index in this generate call (unique per prompt and sample)
    row: torch.Tensor  # [M] the active row of each entry
    position: torch.Tensor  # [M] response index of the entry's token
    tokens: torch.Tensor  # [M] the token (input at that position)
    features: torch.Tensor  # [M, F]
    policy_version: int
    every_row: bool = False  # a plain step: M == b, row == arange(b) (a sink may skip the gather)


class FeatureSink(Protocol):
    feature_layers: tuple[int, ...]  # auxiliary target layers wanted (besides the final hidden)

    def prompt(self, prompt_id: str, tokens: torch.Tensor, features: torch.Tensor, policy_version: int) -> None:
        """tokens [P], features [P, F] at every prompt position."""

    def tokens(self, entries: CommittedFeatures) -> None: ...
