"""The Drafter protocol: what the engine asks of a drafter, and what it tells it.

Each speculative decode step the engine hands the drafter a `DraftContext` for its active rows
(slots 0..b-1) and gets back a `DraftTree` (possibly empty for some rows). Around that, it keeps
the drafter informed on *every* step, speculative or not: rows admitted (with the prompt's
target features, for model drafters), the verdict of each target pass (with the target features
of root and nodes), rows moved when the batch is compacted, and rollouts finished (for drafters
that learn from sibling responses). A step without a draft (the speculation policy said off)
still reports its verdict and features, so a drafter stays current and switching speculation
back on costs no re-prefill. Hooks a drafter does not need are inherited as no-ops from
`DrafterBase`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.sampling import SamplingParams
from engine.spec.tree import DraftTree
from engine.spec.verify import Verdict


@dataclass(kw_only=True)
class DraftShape:
    depth: int = 6  # levels below the root
    topk: int = 1  # children expanded per node (1 = chain)
    verify_tokens: int = 8  # nodes kept for verification
    # Rejection verification needs siblings drawn i.i.d. from the drafter's distribution (and
    # its logits); coupled verification wants distinct siblings: the coupled sample, then top-k.
    iid_children: bool = False
    # Chains of model drafters: a row's chain ends at the first level where the product along it
    # of the drafter's probability of its own token falls below this (EAGLE-2's confidence,
    # arXiv 2406.16858); 0: always `depth` levels. Lossless: verification decides every token.
    min_confidence: float = 0.0
    # Length-aware budget (DAS, chains only): *long* rows (engine.spec.long_row_tokens generated or
    # predicted) draft chains this deep, the others `depth`; 0: every row `depth`.
    long_depth: int = 0

    @property
    def chain_len(self) -> int:
        """Tokens a chain of this shape drafts per row at most: its depth, capped by verify_tokens."""
        return min(self.depth, self.verify_tokens)

    @property
    def label(self) -> str:
        """"d6k1v8": depth, top-k, verify tokens (the name step records and the tuner use);
        "d8k1v8L16" with a length-aware budget; "d16k1v16c0.1" with a confidence stop."""
        budget = f"L{self.long_depth}" if self.long_depth else ""
        stop = f"c{self.min_confidence:g}" if self.min_confidence > 0 else ""
        return f"d{self.depth}k{self.topk}v{self.verify_tokens}{budget}{stop}"

    def for_long_rows(self) -> DraftShape:
        """The shape long rows draft with: a chain `long_depth` deep (this shape without a budget)."""
        if not self.long_depth:
            return self
        return DraftShape(depth=self.long_depth, topk=1, verify_tokens=max(self.verify_tokens, self.long_depth),
                          iid_children=self.iid_children, min_confidence=self.min_confidence)

    def check_within(self, limits: DraftShape) -> None:
        """Raises ValueError unless this shape fits the engine's maximum sizes and verify mode."""
        for key in ("depth", "topk", "verify_tokens"):
            if not 1 <= getattr(self, key) <= getattr(limits, key):
                raise ValueError(
                    f"draft shape {self.label}: {key}={getattr(self, key)} is outside 1..{getattr(limits, key)}, the "
                    f"engine's maximum (engine.spec.max_{key})"
                )
        if not 0.0 <= self.min_confidence < 1.0:
            raise ValueError(f"draft shape {self.label}: min_confidence={self.min_confidence} is outside [0, 1)")
        if self.min_confidence > 0 and self.topk != 1:
            raise ValueError(f"draft shape {self.label}: min_confidence stops chains only; use topk=1 or min_confidence=0")
        if self.long_depth and not (self.topk == 1 and self.chain_len < self.long_depth <= limits.chain_len):
            raise ValueError(f"draft shape {self.label}: a length-aware budget L<n> needs a chain (k1) and n between its "
                             f"depth and the engine's maximum ({limits.chain_len}: engine.spec.max_depth "
                             "and max_verify_tokens)")
        if self.iid_children != limits.iid_children:
            raise ValueError(f"draft shape {self.label}: iid_children must be {limits.iid_children} (fixed by engine.spec.verify)")


@dataclass
class Admission:
    """Rows that start this step: the prompts (padded) and which prompt each new slot holds."""

    slots: torch.Tensor  # [R] slots of the new rows
    owner: torch.Tensor  # [R] index into the prompts below
    tokens: torch.Tensor  # [P, T] prompt ids, right-padded
    lengths: torch.Tensor  # [P]
    features: torch.Tensor | None  # [P, T, F] the target's features at every prompt position, or None
    first_tokens: torch.Tensor  # [R] each new row's first sampled token (its root for the first step)


@dataclass
class DraftContext:
    roots: torch.Tensor  # [b] each row's last sampled token (not yet in the KV cache)
    positions: torch.Tensor  # [b] response index of the root; depth-d nodes sit at positions + d
    keys: torch.Tensor  # [b] noise keys (engine.sampling.row_keys) of each row
    responses: torch.Tensor  # [b, max_new] tokens generated so far; responses[r, generated[r]-1] == roots[r]
    generated: torch.Tensor  # [b]
    prompts: list[torch.Tensor]  # per row: prompt token ids
    prompt_ids: list[str]  # per row: rows of one prompt (a GRPO group) share it
    samples: torch.Tensor  # [b] each row's sample index within its request
    drafts: list[torch.Tensor | None]  # per row: a pre-generated response for this sample, or None
    params: SamplingParams
    shape: DraftShape
    # per row: the pre-generated responses of the request's other samples joined by engine.spec.ngram.SEP
    # (pregenerated.sibling_corpus: bubble drafts to re-align against once the row's own draft has
    # diverged), or None; an empty list: none for any row
    siblings: list[torch.Tensor | None] = field(default_factory=list)
    # [b, D + 1, V] the target's Gumbel noise at response positions generated + 0..D (D: the
    # shape's depth), which the verify pass samples with, when the step computed it ahead (chains
    # under sampling); a drafter coupled to the target may draft with it instead of drawing it again
    noise: torch.Tensor | None = None


class Drafter(Protocol):
    name: str
    feature_layers: tuple[int, ...]  # target layers whose outputs the drafter needs; () = none
    wants_features: bool  # the target's features at admission and every pass (DrafterBase says when)
    wants_noise: bool  # drafts with the target's own noise: the step draws a chain's noise once

    def reset(self, max_batch: int, max_len: int, params: SamplingParams, limits: DraftShape) -> None: ...

    def admit(self, adm: Admission) -> None: ...

    def propose(self, ctx: DraftContext) -> DraftTree: ...

    def update(self, verdict: Verdict, features: torch.Tensor | None) -> None: ...

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None: ...

    def finish(self, prompt_id: str, tokens: list[int]) -> None: ...

    def target_changed(self) -> None: ...

    def stale(self) -> str | None: ...

    def parts(self) -> list[Drafter]: ...

    def network(self) -> torch.nn.Module | None: ...

    def load_weights(self, named_tensors, version: int) -> None: ...


class DrafterBase:
    """No-op hooks; subclasses override what they use.

    Hook arguments:
      reset(max_batch, max_len, params, limits): a generate() call starts; rows hold at most
        max_len committed tokens (plus the tentative tree); every shape proposed for will fit
        within `limits` (the engine's maximum sizes).
      admit(Admission): rows start in their slots; features are the target's features at every
        prompt position (None unless the drafter sets `wants_features` or `feature_layers`).
      update(verdict, features [b, 1+N, F] or None): after every target pass over [root, nodes]
        (N = 0 on a step without a draft).
      move_rows(src [R], dst [R]): row src now lives in slot dst (batch compaction).
      finish(prompt_id, tokens): a rollout of that prompt finished with these response tokens.
      target_changed(): the target's weights changed (drafters sharing its embedding or head
        re-read them).
      stale(): the name of a weight changed since the drafter last packed its own, or None.
      parts(): the drafters it consists of (a composition's, in order); [self] for one drafter.
      network(): the network a model drafter drafts with (its RoPE table sized by the engine, its
        weights replaced by load_weights), or None for a model-free drafter.
      load_weights(named_tensors, version): a model drafter's new weights (names as in its state
        dict); a drafter without a network refuses.

    `wants_noise`: the drafter drafts with the target's own noise (a coupled model drafter), so
    the step draws a chain's noise once, for it and the verifier (`DraftContext.noise`).
    """

    name = "base"
    feature_layers: tuple[int, ...] = ()
    wants_features = False
    wants_noise = False

    def reset(self, max_batch: int, max_len: int, params: SamplingParams, limits: DraftShape) -> None:
        pass

    def admit(self, adm: Admission) -> None:
        pass

    def propose(self, ctx: DraftContext) -> DraftTree:
        return DraftTree.empty(ctx.roots.shape[0], ctx.roots.device)

    def update(self, verdict: Verdict, features: torch.Tensor | None) -> None:
        pass

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        pass

    def finish(self, prompt_id: str, tokens: list[int]) -> None:
        pass

    def target_changed(self) -> None:
        pass

    def stale(self) -> str | None:
        return None

    def parts(self) -> list[Drafter]:
        return [self]

    def network(self) -> torch.nn.Module | None:
        return None

    def load_weights(self, named_tensors, version: int) -> None:
        raise ValueError(f"the {self.name} drafter has no weights to load (only a model drafter, such as eagle, has)")
