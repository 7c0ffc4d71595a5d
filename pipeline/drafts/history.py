"""RunHistory: the run's side of history drafts (engine.spec.history).

The engine's history drafter reads a HistoryStore of earlier responses per prompt; the run keeps
that store across RL steps. After each step's rollouts are done on every rank (after the idle
window, so no rank waits on another earlier than the step already does), every rank's responses
are gathered and added to every rank's store in rank order, so the stores are equal on every
rank, whichever rank a prompt lands on next epoch, and rank 0's is the one the checkpoint saves
(RunState.components["history"]). It also gives each prompt's predicted response length (the
mean of its kept responses) for the engine's length-aware budget, and sums the history
drafter's per-rank counts into the step's `spec/history_*` metrics.

It knows the store and the ranks; nothing of how the engine drafts.
"""

from __future__ import annotations

import dataclasses

from engine.spec.config import SpecConfig
from engine.spec.factory import history_store
from engine.spec.history import history_counts, history_metrics
from engine.spec.history_index import HistoryStore
from engine.types import Request, Rollout
from pipeline.dist import Ranks, gather_floats, gather_objects
from pipeline.hooks import StepHook


class RunHistory(StepHook):
    """The store at the step's moments (pipeline.hooks): predicted lengths into each round's
    requests, every rank's responses in once the step's rollouts are done, the step's metrics."""

    name = "history"  # its key in a run checkpoint

    def __init__(self, store: HistoryStore, ranks: Ranks, source: int | None) -> None:
        self.store, self.r = store, ranks
        self.source = source  # the history part's index in the drafter composition (StepRecord.source)

    def remember(self, rollouts: list[Rollout]) -> None:
        """Collective: every rank's finished rollouts of the step into every rank's store."""
        mine = [(ro.prompt_id, ro.tokens) for ro in rollouts]
        by_prompt: dict[str, list[list[int]]] = {}
        for part in gather_objects(self.r, mine):
            for pid, tokens in part:
                by_prompt.setdefault(pid, []).append(tokens)
        for pid, responses in by_prompt.items():
            self.store.add(pid, responses)

    def requests(self, step: int, requests: list[Request]) -> list[Request]:
        predicted = self.predicted([r.prompt_id for r in requests])
        return [dataclasses.replace(r, predicted_len=predicted.get(r.prompt_id)) for r in requests]

    def collect(self, step: int, scored) -> None:
        self.remember(scored.batch.rollouts)

    def predicted(self, prompt_ids: list[str]) -> dict[str, int]:
        """The predicted response length of each prompt seen before (rounded mean of its kept responses)."""
        out = {}
        for pid in prompt_ids:
            length = self.store.predicted_length(pid)
            if length is not None:
                out[pid] = round(length)
        return out

    def metrics(self, scored) -> dict[str, float]:
        """Collective: spec/history_coverage and spec/history_accept_len over every rank's step records
        of the step (`scored`: a pipeline.rollout.stage.ScoredRollouts)."""
        per_rank = gather_floats(self.r, history_counts(scored.batch.steps, self.source))
        return history_metrics([sum(col) for col in zip(*per_rank)])

    def state_dict(self) -> dict:
        return self.store.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.store.load_state_dict(state)


def run_history(spec: SpecConfig, ranks: Ranks) -> RunHistory | None:
    """The run's history store over `ranks`, when engine.spec.drafter has a history part (else None)."""
    if not spec.enabled or spec.drafter_spec.history is None:
        return None
    return RunHistory(history_store(spec), ranks, spec.drafter_spec.history)
