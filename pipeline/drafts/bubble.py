"""Bubble drafts: idle ranks pre-generate the next step's rollouts, which become its drafts.

A token is argmax(logits / T + g) with Gumbel noise g keyed by (seed, RL step, prompt, sample,
position). In its idle window a rank rolls out *what it will roll out at step t+1* (its shard of
the data loader's next step, or with rollout.split_groups its part of every group of it) with
policy t and step t+1's sampling params, so with step t+1's noise keys. At step t+1
the engine's `pregenerated` drafter proposes each row's pre-generated continuation; the draft
and the target's own sample differ only where one policy update flipped an argmax, so with RL's
small learning rates most of a response is accepted. The target still decides every token: the
rollouts are those of autoregressive decoding, always.

Pre-generation is preempted at the end of its part of the idle window (`engine.generate(...,
should_stop)`, checked after every decode step; common.idle.ScheduledIdle decides the part); a
row cut there keeps its prefix, which is still a draft. The `BubbleStore` holds the drafts of one future step, keyed by (prompt id,
sample), bounded by `bubble.max_tokens`; it lives in the rank's process, because a rank
pre-generates only the samples it will roll out itself (its loader shard, or its part of every
group: both fixed), so no draft has to cross ranks or nodes. (Stealing another rank's shard would need the drafts in the
node's shared memory, as spot training's DataBuffer does, and across nodes a broadcast.)

With spot training on too, a window is split (common.idle.schedule): pre-generation first, for
at most `bubble.share` of the window this rank expects (its recent windows' mean), then spot
training for the rest. `work` returns without a collective; the window's figures are summed over ranks in
`settle`, after the actor's update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from common.idle import ControlPlane, IdleWindow, IdleWork, RankState
from engine.backend import RolloutBackend
from engine.sampling import SamplingParams
from engine.types import FinishReason, Request, Rollout
from pipeline.hooks import StepHook


@dataclass(kw_only=True)
class BubbleConfig:
    enabled: bool = False  # pre-generate the next step's rollouts in idle windows (needs engine.spec.drafter pregenerated+...)
    share: float = 1.0  # of the last idle window given to pre-generation (the rest: spot training)
    max_tokens: int = 1_000_000  # the store's bound (tokens over all drafts)
    order: Literal["longest_prompt", "loader"] = "longest_prompt"  # which prompts are pre-generated first

    def validate(self) -> None:
        if not 0 < self.share <= 1:
            raise ValueError(f"bubble.share must be in (0, 1], got {self.share}")
        if self.max_tokens < 1:
            raise ValueError(f"bubble.max_tokens must be >= 1, got {self.max_tokens}")


class BubbleStore:
    """The pre-generated responses of one future RL step, by (prompt id, sample); bounded in tokens."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.step: int | None = None
        self.drafts: dict[tuple[str, int], list[int]] = {}
        self.tokens = 0

    def put(self, step: int, rollouts: Sequence[Rollout]) -> int:
        """Keeps whole responses (or preempted prefixes) for `step` while they fit; returns how many."""
        if step != self.step:
            self.step, self.drafts, self.tokens = step, {}, 0
        kept = 0
        for ro in rollouts:
            key, n = (ro.prompt_id, ro.sample), len(ro.tokens)
            if n == 0 or key in self.drafts or self.tokens + n > self.max_tokens:
                continue
            self.drafts[key] = list(ro.tokens)
            self.tokens += n
            kept += 1
        return kept

    def take(self, step: int) -> dict[str, dict[int, list[int]]]:
        """The drafts for `step` by prompt id, then sample; the store is empty afterwards."""
        out: dict[str, dict[int, list[int]]] = {}
        if step == self.step:
            for (pid, sample), tokens in self.drafts.items():
                out.setdefault(pid, {})[sample] = tokens
        self.clear()
        return out

    def clear(self) -> None:
        self.step, self.drafts, self.tokens = None, {}, 0


class BubbleDrafts(StepHook):
    """Bubble drafts at the step's moments (pipeline.hooks): each generation round's requests take
    the store's drafts of the step, and the round's rollouts measure how far they held. The
    metrics are this rank's, averaged over the ranks (the decode steps saved: summed)."""

    reduce = {"bubble/coverage": "mean", "bubble/token_coverage": "mean", "bubble/prefix_match": "mean",
              "bubble/accept_len": "mean", "bubble/decode_steps_saved": "sum"}

    def __init__(self, store: BubbleStore) -> None:
        self.store = store
        self.drafts: dict[str, dict[int, list[int]]] = {}  # the last round's
        self.round_metrics: dict[str, float] = {}

    def requests(self, step: int, requests: list[Request]) -> list[Request]:
        self.drafts = self.store.take(step)
        return [dataclasses.replace(r, drafts=self.drafts.get(r.prompt_id)) for r in requests]

    def rolled_out(self, step: int, scored) -> None:
        self.round_metrics = coverage_metrics(self.drafts, scored.batch.rollouts) | draft_metrics(scored.batch.steps)

    def metrics(self, scored) -> dict[str, float]:
        return self.round_metrics


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    diff = (torch.tensor(a[:n]) != torch.tensor(b[:n])).nonzero()
    return int(diff[0]) if diff.numel() else n


def coverage_metrics(drafts: dict[str, dict[int, list[int]]], rollouts: Sequence[Rollout]) -> dict[str, float]:
    """How much of a step the bubble drafts covered, and how far they held: the share of rollouts
    with a draft, of response tokens under a draft, and the mean share of a covered response
    that equals its draft from the start (the first flipped argmax ends it)."""
    covered = [(ro, drafts[ro.prompt_id][ro.sample]) for ro in rollouts
               if ro.prompt_id in drafts and ro.sample in drafts[ro.prompt_id]]
    total = sum(len(ro.tokens) for ro in rollouts)
    out = {"bubble/coverage": len(covered) / max(len(rollouts), 1),
           "bubble/token_coverage": sum(min(len(d), len(ro.tokens)) for ro, d in covered) / max(total, 1)}
    if covered:
        out["bubble/prefix_match"] = sum(common_prefix(ro.tokens, d) / max(len(ro.tokens), 1) for ro, d in covered) / len(covered)
    return out


def draft_metrics(steps, source: int = 0) -> dict[str, float]:
    """From a generate call's step records: the rows the bubble drafter (part `source` of the
    composition, `pregenerated` first) drafted: their accept length (tokens per verify) and the
    target passes it saved them (every accepted draft token is one decode step less for its row)."""
    rows = emitted = accepted = 0
    for s in steps:
        if s.source is None:
            continue
        for src, e, a in zip(s.source, s.emitted, s.accepted):
            if src == source:
                rows, emitted, accepted = rows + 1, emitted + e, accepted + a
    if rows == 0:
        return {}
    return {"bubble/accept_len": emitted / rows, "bubble/decode_steps_saved": float(accepted)}


class BubbleWork(IdleWork):
    """Pre-generates this rank's requests of the next step in its part of the idle window
    (common.idle.ScheduledIdle decides how long that is)."""

    name = "bubble"

    def __init__(self, engine: RolloutBackend, requests_for: Callable[[], list[Request]],
                 sampling_for: Callable[[int], SamplingParams], store: BubbleStore, cfg: BubbleConfig,
                 control: ControlPlane | None = None) -> None:
        self.engine, self.requests_for, self.sampling_for = engine, requests_for, sampling_for
        self.store, self.cfg, self.control = store, cfg, control
        self.window: IdleWindow | None = None  # the last window's part, settled after the update
        self.local: list[float] = []  # that window's figures on this rank: pregen_s, rollouts, kept, tokens, preempted

    def order(self, requests: list[Request]) -> list[Request]:
        if self.cfg.order == "longest_prompt":  # longer problems, longer answers: the tail's rows first
            return sorted(requests, key=lambda r: -len(r.prompt))
        return requests

    def work(self, window: IdleWindow) -> dict[str, float]:
        """Pre-generates until `window.others_done()` (the schedule's end of this part); no collective."""
        if self.control is not None:
            self.control.set(window.step, RankState.PREGENERATING)
        rollouts: list[Rollout] = []
        if not window.others_done():
            sink, self.engine.sink = self.engine.sink, None  # pre-generated rows are not training data
            try:
                batch = self.engine.generate(self.order(self.requests_for()), self.sampling_for(window.step + 1),
                                             should_stop=window.others_done)
            finally:
                self.engine.sink = sink
            rollouts = batch.rollouts
        kept = self.store.put(window.step + 1, rollouts)
        spent = window.elapsed()
        self.window = window
        self.local = [spent, float(len(rollouts)), float(kept), float(sum(len(r.tokens) for r in rollouts)),
                      float(sum(r.finish_reason == FinishReason.PREEMPTED for r in rollouts))]
        return {}

    def release(self) -> None:
        """Shed (pipeline.memory_guard): nothing more is pre-generated; the drafts kept are dropped."""
        self.store.clear()
        self.window = None

    def settle(self) -> dict[str, float]:
        """The last window's figures summed over ranks (one all-reduce), with this rank's window length."""
        if self.window is None:
            return {}
        idle_s = max(0.0, self.window.all_done_at() - self.window.started)
        budget_s = idle_s if self.window.budget is None else self.window.budget
        sums = torch.tensor([*self.local, idle_s, budget_s], dtype=torch.float64)
        self.window = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        return {"bubble/pregen_s": float(sums[0]), "bubble/pregenerated": float(sums[1]), "bubble/kept": float(sums[2]),
                "bubble/pregen_tokens": float(sums[3]), "bubble/preempted": float(sums[4]),
                "bubble/idle_s": float(sums[5]), "bubble/budget_s": float(sums[6]),
                "bubble/store_tokens": float(self.store.tokens)}
