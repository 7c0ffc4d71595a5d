"""Records passed between the engine and its callers: requests in, rollouts and step records out.

Token ids only (tokenisation lives with the caller). Vocabulary: a *rollout* is one finished
sample of a request; a *decode step* is one target forward over every active row (its root,
plus the row's draft when speculating); per row a step *drafts* nodes, *accepts* some of them
and *emits* the accepted ones plus one bonus token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token was emitted (it is the rollout's last token)
    LENGTH = "length"  # max_new_tokens, or the context, ran out
    PREEMPTED = "preempted"  # generate(..., should_stop) was told to stop: a prefix of the full response


@dataclass(kw_only=True)
class Request:
    prompt_id: str  # keys the sampling noise: the same id gives the same samples anywhere
    prompt: list[int]  # token ids
    n: int = 1  # samples (a GRPO group, or a part of one: see first_sample)
    # Pre-generated responses by sample index (bubble drafts): the drafter proposes from them.
    drafts: dict[int, list[int]] | None = None
    # The response length expected from the prompt's earlier responses (pipeline.drafts.history), or None;
    # the length-aware budget drafts deeper for rows predicted long. It changes no token.
    predicted_len: int | None = None
    # The request's samples are first_sample .. first_sample + n - 1 of its prompt's group: a group
    # split across ranks (pipeline.rollout.schedule, rollout.split_groups) asks each rank for its part.
    # The sample index keys the noise, so a sample is the same tokens whichever request holds it.
    first_sample: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"request {self.prompt_id!r}: n must be >= 1, got {self.n}")
        if self.first_sample < 0:
            raise ValueError(f"request {self.prompt_id!r}: first_sample must be >= 0, got {self.first_sample}")
        if not self.prompt:
            raise ValueError(f"request {self.prompt_id!r}: the prompt is empty")
        if self.predicted_len is not None and self.predicted_len < 0:
            raise ValueError(f"request {self.prompt_id!r}: predicted_len must be >= 0 (or None), got {self.predicted_len}")
        if self.drafts is not None and any(k not in self.samples for k in self.drafts):
            raise ValueError(f"request {self.prompt_id!r}: drafts are keyed by sample index {self.samples.start}.."
                             f"{self.samples.stop - 1}, got {sorted(self.drafts)}")

    @property
    def samples(self) -> range:
        """The sample indices this request asks for."""
        return range(self.first_sample, self.first_sample + self.n)


@dataclass(kw_only=True)
class Rollout:
    prompt_id: str
    sample: int
    prompt_tokens: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int = 0  # the engine's weights version that produced it (engine.load_weights)
    timings: dict[str, float] = field(default_factory=dict)  # seconds since generate() started


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One decode step. Per-row lists are over the step's active rows, in slot order."""

    index: int  # decode step number within the generate() call
    batch_size: int  # active rows
    shape: str  # the draft shape used ("d6k1v8": depth, top-k, verify tokens) or "off"
    drafted: list[int]  # draft nodes verified per row
    accepted: list[int]  # of them accepted per row
    emitted: list[int]  # tokens emitted per row (accepted + 1, cut at a stop or the limit)
    context_mean: float  # mean committed tokens per row before the step (prompt + response)
    draft_s: float  # proposing drafts
    forward_s: float  # the target forward (device-synchronised)
    other_s: float  # sampling, verification, KV commit, emission, drafter and sink updates
    source: list[int] | None = None  # per row, which drafter of a composition drafted it (None: one drafter, or off)
    rollout: list[int] | None = None  # per row, its index in the call's RolloutBatch.rollouts (engine.row_steps)

    @property
    def seconds(self) -> float:
        return self.draft_s + self.forward_s + self.other_s

    @property
    def speculative(self) -> bool:
        return self.shape != "off"

    def as_dict(self) -> dict:
        """The flat JSON form (summed over rows), as in decode_steps.jsonl."""
        return {
            "index": self.index, "batch_size": self.batch_size, "shape": self.shape, "drafted": sum(self.drafted),
            "accepted": sum(self.accepted), "emitted": sum(self.emitted), "context_mean": round(self.context_mean, 2),
            "draft_s": self.draft_s, "forward_s": self.forward_s, "other_s": self.other_s,
        }


@dataclass
class GenerateStats:
    """A summary of step records: what one generate() call (or several, merged) did."""

    batch_sizes: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # target forwards of decode steps
    draft_s: float = 0.0
    other_s: float = 0.0
    new_tokens: int = 0
    wall_s: float = 0.0
    drafted: int = 0  # draft nodes verified
    accepted: int = 0  # draft nodes accepted
    accept_hist: list[int] = field(default_factory=list)  # tokens emitted per row per speculative step
    speculative_steps: int = 0

    @classmethod
    def from_records(cls, steps: list[StepRecord], prefill_s: float, wall_s: float, new_tokens: int) -> GenerateStats:
        s = cls(prefill_s=prefill_s, wall_s=wall_s, new_tokens=new_tokens)
        for r in steps:
            s.batch_sizes.append(r.batch_size)
            s.decode_s += r.forward_s
            s.draft_s += r.draft_s
            s.other_s += r.other_s
            if r.speculative:
                s.speculative_steps += 1
                s.drafted += sum(r.drafted)
                s.accepted += sum(r.accepted)
                s.accept_hist.extend(r.emitted)
        return s

    @classmethod
    def from_counters(cls, counters: dict[str, int], wall_s: float, new_tokens: int) -> GenerateStats:
        """From a backend's counters (vLLM's): no per-step times or histogram, the totals only."""
        return cls(wall_s=wall_s, new_tokens=new_tokens, drafted=counters["draft_tokens"],
                   accepted=counters["accepted_tokens"], speculative_steps=counters["drafts"])

    @property
    def accept_len(self) -> float:
        """Mean tokens emitted per row per speculative step (accepted drafts + 1); 1 without any."""
        if self.accept_hist:
            return sum(self.accept_hist) / len(self.accept_hist)
        if self.speculative_steps:  # counters only: each speculative row-step emits its accepted drafts + 1
            return (self.accepted + self.speculative_steps) / self.speculative_steps
        return 1.0

    @property
    def accept_rate(self) -> float:
        """Accepted draft nodes / verified draft nodes."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def merge(self, other: GenerateStats) -> None:
        """Adds another call's figures to these (benchmarks over several calls)."""
        self.batch_sizes += other.batch_sizes
        self.accept_hist += other.accept_hist
        for name in ("prefill_s", "decode_s", "draft_s", "other_s", "new_tokens", "wall_s", "drafted", "accepted",
                     "speculative_steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(kw_only=True)
class RolloutBatch:
    """What generate() returns: the rollouts (request order, then sample order) and the step records.

    It is a sequence of its rollouts (`batch[i]`, `len(batch)`, iteration)."""

    rollouts: list[Rollout]
    steps: list[StepRecord]
    prefill_s: float
    wall_s: float
    policy_version: int
    # A backend without step records (vLLM) reports its speculation counters instead:
    # drafts (row-steps that speculated), draft_tokens (verified), accepted_tokens.
    counters: dict[str, int] | None = None

    @property
    def stats(self) -> GenerateStats:
        new_tokens = sum(len(r.tokens) for r in self.rollouts)
        if self.counters is not None and not self.steps:
            return GenerateStats.from_counters(self.counters, self.wall_s, new_tokens)
        return GenerateStats.from_records(self.steps, self.prefill_s, self.wall_s, new_tokens)

    def __len__(self) -> int:
        return len(self.rollouts)

    def __getitem__(self, i):
        return self.rollouts[i]

    def __iter__(self):
        return iter(self.rollouts)
