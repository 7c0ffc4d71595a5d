"""The speculation config section (`engine.spec:` in configs/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.spec.drafter_spec import DrafterSpec

DRAFTERS = DrafterSpec.names()  # every valid engine.spec.drafter (command-line choices)


@dataclass(kw_only=True)
class SpecConfig:
    enabled: bool = False
    # eagle | eagle3 | eagle3_vllm | mtp (a trained one-layer drafter at `drafter_path`;
    # eagle3_vllm: EAGLE-3 in vLLM's network, mtp: a MiMo-style multi-token-prediction head, which
    # vLLM serves with its mtp method), ngram (model-free), or a
    # fallback composition "ngram+eagle": n-gram drafts where a match exists, eagle elsewhere;
    # "pregenerated+...": a row's pre-generated response first (bubble drafts, pipeline.drafts.bubble);
    # "history+...": the prompt's earlier responses and finished siblings (engine.spec.history).
    # Read it parsed: `drafter_spec` (engine.spec.drafter_spec).
    drafter: str = "eagle"
    drafter_path: str | None = None
    # The CPU kernels' copy of an EAGLE drafter's weights: float32, or bfloat16 (half the bytes a
    # draft level streams; proposals may change, emitted tokens never do: docs/BENCHMARKS.md).
    drafter_weights: Literal["float32", "bfloat16"] = "float32"
    # The CPU kernels' products of an EAGLE drafter: float32, or bf16 arithmetic (AVX512_BF16's dot
    # products; proposals may change, emitted tokens never do: docs/BENCHMARKS.md); auto: bf16 where
    # the kernels were built with AVX512_BF16 (engine.spec.factory).
    drafter_products: Literal["float32", "bf16", "auto"] = "float32"
    depth: int = 6  # draft levels below the root
    topk: int = 1  # children per expanded node; 1 = chain
    verify_tokens: int = 8  # draft nodes verified per row per step
    # Chains only: end a row's chain once the drafter's confidence in it (the product of its
    # probabilities of its own tokens) falls below this (engine.spec.drafter.DraftShape); 0: off.
    min_confidence: float = 0.0
    verify: Literal["coupled", "rejection"] = "coupled"
    # Speculate only while at most this many rows are active (the long tail); None: every step.
    max_active_batch: int | None = None
    # The tuner: arms like ["off", "d4k1v4", "d16k1v16"]; empty: no tuner.
    tuner_arms: list[str] = field(default_factory=list)
    # Which tuner chooses among them: bandit (BEG-MAB, engine.spec.tuner: learns each arm's tokens/s
    # per batch-size bucket by pulling it), or cost (engine.spec.cost_policy: this machine's measured
    # pass costs and the live acceptance; an arm runs only where it is predicted faster than off).
    tuner: Literal["bandit", "cost"] = "bandit"
    tuner_buckets: list[int] = field(default_factory=lambda: [1, 2, 5, 21])  # TLT's thresholds
    tuner_epsilon: float = 0.1
    tuner_window: int = 300
    # Explore (epsilon) only arms whose median reward in the bucket is >= this x the best's; 0: all.
    tuner_explore_within: float = 0.0
    # The history drafter's store (engine.spec.history_index), kept across RL steps by the run:
    # at most this many prompts (least recently used evicted first), corpus tokens in all, and
    # responses per prompt (oldest dropped); a row's draft needs a match of history_min_match
    # tokens, extended backwards up to history_max_match over history_max_candidates occurrences.
    # None: 12 with a learned drafter after history (a long match leaves the rows at a branch
    # point to the coupled drafter, where another sample's branch is the worse guess), else 3
    # (docs/BENCHMARKS.md, "History drafts"); `history_match()` resolves it.
    history_max_prompts: int = 4096
    history_max_tokens: int = 2_000_000
    history_max_responses: int = 16
    history_min_match: int | None = None
    history_max_match: int = 32
    history_max_candidates: int = 8
    # Length-aware budget: an arm "d8k1v8L16" drafts 16 deep for *long* rows (at least this many
    # tokens generated, or predicted from the prompt's earlier responses) and 8 for the others.
    long_row_tokens: int = 256
    # The fixed shape's length-aware budget: long rows draft chains this deep (<= max_depth and
    # max_verify_tokens); 0: off. Tuner arms carry their own (the L<n> suffix).
    long_depth: int = 0
    # The engine's maximum sizes (cache margin, RoPE reach, drafter buffers): a speculation
    # policy may pick any shape within them on any step. None: the fixed shape above.
    max_depth: int | None = None
    max_topk: int | None = None
    max_verify_tokens: int | None = None

    @property
    def drafter_spec(self) -> DrafterSpec:
        """`drafter` parsed (by validate(), and again only if `drafter` changed since); ValueError
        naming engine.spec.drafter and the valid parts if it is not a drafter."""
        parsed = self.__dict__.get("_drafter_spec")
        if parsed is None or parsed.name != self.drafter:
            parsed = self._drafter_spec = DrafterSpec.parse(self.drafter)
        return parsed

    def validate(self) -> None:
        learned = self.drafter_spec.learned
        if self.drafter_weights not in ("float32", "bfloat16"):
            raise ValueError(f"engine.spec.drafter_weights must be float32 or bfloat16, got {self.drafter_weights!r}")
        if self.drafter_products not in ("float32", "bf16", "auto"):
            raise ValueError(f"engine.spec.drafter_products must be float32, bf16 or auto, got {self.drafter_products!r}")
        if self.tuner_arms:
            from engine.spec.tuner import Bandit, parse_arm

            if self.max_active_batch is not None:
                raise ValueError("engine.spec.tuner_arms and engine.spec.max_active_batch both choose when to speculate; set one")
            for label in self.tuner_arms:
                parse_arm(label)
            Bandit(len(self.tuner_arms), self.tuner_buckets, epsilon=self.tuner_epsilon, window=self.tuner_window,
                   explore_within=self.tuner_explore_within)
        if self.tuner not in ("bandit", "cost"):
            raise ValueError(f"engine.spec.tuner must be bandit or cost, got {self.tuner!r}")
        if self.tuner == "cost" and not [a for a in self.tuner_arms if a != "off"]:
            raise ValueError("engine.spec.tuner=cost chooses among engine.spec.tuner_arms: give it at least one draft "
                             "shape, e.g. tuner_arms: [\"off\", \"d2k1v2\", \"d4k1v4\"]")
        for key in ("history_max_prompts", "history_max_tokens", "history_max_responses", "history_max_candidates",
                    "long_row_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"engine.spec.{key} must be >= 1, got {getattr(self, key)}")
        if self.history_min_match is not None and self.history_min_match < 1:
            raise ValueError(f"engine.spec.history_min_match must be >= 1 (or null: chosen by the drafter), got "
                             f"{self.history_min_match}")
        if self.history_max_match < self.history_match():
            raise ValueError(f"engine.spec.history_max_match={self.history_max_match} is below the minimum match "
                             f"{self.history_match()} (engine.spec.history_min_match); raise it")
        if self.max_active_batch is not None and self.max_active_batch < 1:
            raise ValueError(f"engine.spec.max_active_batch must be >= 1 (or null: every step), got {self.max_active_batch}")
        for key in ("depth", "topk", "verify_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"engine.spec.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("depth", "topk", "verify_tokens"):
            top = getattr(self, f"max_{key}")
            if top is not None and top < getattr(self, key):
                raise ValueError(f"engine.spec.max_{key}={top} is below engine.spec.{key}={getattr(self, key)}")
        if self.long_depth:
            top = self.max_chain_len
            if self.topk != 1 or not self.chain_len < self.long_depth <= top:
                raise ValueError(f"engine.spec.long_depth={self.long_depth} needs a chain (topk=1) and a value above "
                                 f"engine.spec.depth and verify_tokens, at most {top} (engine.spec.max_depth and "
                                 "max_verify_tokens); 0 turns it off")
        if not 0.0 <= self.min_confidence < 1.0:
            raise ValueError(f"engine.spec.min_confidence must be in [0, 1) (0: off), got {self.min_confidence}")
        if self.min_confidence > 0 and self.topk != 1:
            raise ValueError("engine.spec.min_confidence stops chains only: set engine.spec.topk=1 or min_confidence=0")
        depth, topk, verify = self.limits()
        if depth * topk > 512:
            raise ValueError(f"engine.spec (max_)depth * (max_)topk must be <= 512, got {depth} * {topk}")
        if verify > 64:
            raise ValueError(f"engine.spec (max_)verify_tokens must be <= 64, got {verify}")
        if self.enabled and learned is not None and not self.drafter_path:
            raise ValueError(
                f"engine.spec.drafter={self.drafter} needs engine.spec.drafter_path (a folder from "
                "`python -m spot.warmstart` or `make drafters`)"
            )

    def history_match(self) -> int:
        """The history drafter's minimum match: history_min_match, or by default 12 when a learned
        drafter follows history in the composition and 3 when none does."""
        if self.history_min_match is not None:
            return self.history_min_match
        return 12 if self.drafter_spec.learned is not None else 3

    @property
    def chain_len(self) -> int:
        """Tokens the configured shape drafts per row as a chain: depth, capped by verify_tokens."""
        return min(self.depth, self.verify_tokens)

    @property
    def max_chain_len(self) -> int:
        """The longest chain the engine is built for: its maximum depth, capped by its maximum verify tokens."""
        depth, _, verify = self.limits()
        return min(depth, verify)

    def limits(self) -> tuple[int, int, int]:
        """(depth, topk, verify_tokens): the largest shape the engine is built for."""
        pick = lambda key: getattr(self, f"max_{key}") or getattr(self, key)  # noqa: E731
        return pick("depth"), pick("topk"), pick("verify_tokens")
