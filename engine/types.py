"""Records passed between the engine and its callers: requests in, rollouts out (token ids only)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class Request:
    prompt_id: str  # keys the sampling noise: the same id gives the same samples anywhere
    prompt: list[int]  # token ids
    n: int = 1  # samples (a GRPO group)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"request {self.prompt_id!r}: n must be >= 1, got {self.n}")
        if not self.prompt:
            raise ValueError(f"request {self.prompt_id!r}: the prompt is empty")


@dataclass(kw_only=True)
class Rollout:
    prompt_id: str
    sample: int
    prompt_tokens: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    timings: dict[str, float] = field(default_factory=dict)  # seconds since generate() started


@dataclass
class GenerateStats:
    """What one generate() call did: the batch size of every decode step shows the long tail."""

    batch_sizes: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    sample_s: float = 0.0
    draft_s: float = 0.0
    new_tokens: int = 0
    wall_s: float = 0.0
    drafted: int = 0  # draft nodes verified
    accepted: int = 0  # draft nodes accepted
    accept_hist: list[int] = field(default_factory=list)  # tokens emitted per row per verify step

    @property
    def accept_len(self) -> float:
        """Mean tokens emitted per row per verify step (accepted drafts + 1)."""
        return sum(self.accept_hist) / len(self.accept_hist) if self.accept_hist else 1.0

    def merge(self, other: GenerateStats) -> None:
        """Adds another call's figures to these (benchmarks over several calls)."""
        self.batch_sizes += other.batch_sizes
        self.accept_hist += other.accept_hist
        for name in ("prefill_s", "decode_s", "sample_s", "draft_s", "new_tokens", "wall_s", "drafted", "accepted"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0
