"""The records a DataBuffer (spot.buffer.ring) stores and lists: `BufferEntry`, one rollout's tokens and
target features as written and read, and `EntryInfo`, an entry's header without its payload."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spot.training.records import HiddenStateRows


@dataclass(kw_only=True)
class BufferEntry:
    key: str  # rollout key, "<prompt_id>/<sample>"
    step: int  # RL step whose rollouts produced it
    policy_version: int
    finished: bool  # the response ended with a stop token (False: cut by max_new_tokens or preempted)
    prompt_len: int
    tokens: torch.Tensor  # [T] long (prompt + response, as fed to the target)
    # [T, F] float32 or bfloat16 (the buffer's dtype); a producer may give parts [T_i, F] in order
    # along T (a prompt's features, then a view of the response's): they are written to the ring
    # one by one, with no concatenated copy made first. `read` always gives one tensor.
    features: torch.Tensor | tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        T = self.tokens.shape[0] if self.tokens.dim() == 1 else -1
        parts = self.feature_parts()
        shapes = [tuple(f.shape) for f in parts]
        if any(f.dim() != 2 or f.shape[1] != parts[0].shape[1] for f in parts) or sum(f.shape[0] for f in parts) != T:
            raise ValueError(f"entry {self.key!r}: tokens [T] and features [T, F] must agree, got "
                             f"{tuple(self.tokens.shape)} and {shapes[0] if len(shapes) == 1 else shapes}")
        if not 0 < self.prompt_len <= T:
            raise ValueError(f"entry {self.key!r}: prompt_len {self.prompt_len} not in 1..{T}")

    @property
    def length(self) -> int:
        return self.tokens.shape[0]

    def feature_parts(self) -> tuple[torch.Tensor, ...]:
        return self.features if isinstance(self.features, tuple) else (self.features,)

    def to_row(self) -> HiddenStateRows:
        features = self.features if isinstance(self.features, torch.Tensor) else torch.cat(self.features)
        return HiddenStateRows(prompt_id=self.key, step=self.step, tokens=self.tokens, features=features,
                               prompt_len=self.prompt_len)


@dataclass(frozen=True)
class EntryInfo:
    """An entry's header as seen by `infos` (no payload copy); `read` it to get the payload."""

    slot: int
    seq: int
    key: str
    step: int
    policy_version: int
    finished: bool
    prompt_len: int
    length: int  # T
    nbytes: int  # payload bytes: tokens and features

    @property
    def response_len(self) -> int:
        return self.length - self.prompt_len
