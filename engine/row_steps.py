"""Which row each entry of a decode step's records is, and what each emitted token cost.

A `StepRecord`'s per-row lists carry `rollout`: each row's index in the call's
`RolloutBatch.rollouts`, so a row-step is known by the sample it decoded: (prompt id, sample) and
the response position its first emitted token takes. A response's first token is drawn at
admission (no decode step), so a row-step that starts after c tokens of the response emits
positions c .. c + emitted - 1.

Two ways of decoding the same requests give the same tokens (speculation is exact), so their
accept lengths can be compared on the *same tokens*: a row-step that emits e tokens costs each of
them 1/e of a step, and a way's accept length over a set of tokens is their count over their
summed cost. Over the tokens of a chosen set of one way's own row-steps that is those row-steps'
mean emitted tokens (their accept length); over the same tokens another way's cost gives that
way's accept length exactly there (bench.history: EAGLE's on the tokens history drafts emitted).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from engine.types import Rollout, RolloutBatch, StepRecord

Token = tuple[str, int, int]  # (prompt id, sample, response position)


def finished_only(rollouts: list[Rollout | None], steps: list[StepRecord]) -> tuple[list[Rollout], list[StepRecord]]:
    """The rollouts that exist (a preempted call leaves None for rows it never finished) and the step
    records with `rollout` renumbered to index that shorter list (-1 for a row left out)."""
    index, kept = [], []
    for r in rollouts:
        index.append(len(kept) if r is not None else -1)
        if r is not None:
            kept.append(r)
    renumber = lambda s: s if s.rollout is None else dataclasses.replace(s, rollout=[index[i] for i in s.rollout])  # noqa: E731
    return kept, [renumber(s) for s in steps]


def row_step_tokens(batch: RolloutBatch, keep: Callable[[StepRecord, int], bool] | None = None
                    ) -> dict[Token, float]:
    """Every token a row-step of `batch` emitted -> its cost in decode steps (1 / the row-step's
    emitted tokens); only the row-steps `keep(step, row)` selects, when given. Needs the steps'
    `rollout` (every record the engine writes has it)."""
    done: dict[int, int] = {}  # rollout index -> response tokens so far (the first drawn at admission)
    out: dict[Token, float] = {}
    for s in batch.steps:
        if s.rollout is None:
            raise ValueError(f"step record {s.index} has no rollout per row: written by an engine before row identities")
        for i, (r, e) in enumerate(zip(s.rollout, s.emitted)):
            start = done.get(r, 1)
            done[r] = start + e
            if e == 0 or r < 0 or (keep is not None and not keep(s, i)):
                continue
            roll = batch.rollouts[r]
            for pos in range(start, start + e):
                out[(roll.prompt_id, roll.sample, pos)] = 1.0 / e
    return out


def accept_on(tokens: list[Token] | set[Token] | dict[Token, float], costs: dict[Token, float]) -> float:
    """Tokens emitted per decode step over `tokens`, at the cost `costs` gives each (row_step_tokens
    of a way that emitted every one of them); a token `costs` lacks is an error naming it."""
    missing = [t for t in tokens if t not in costs]
    if missing:
        raise KeyError(f"{len(missing)} tokens were not emitted by a decode step of this way, e.g. {missing[0]}: "
                       f"compare ways over the same requests and sampling")
    total = sum(costs[t] for t in tokens)
    return len(tokens) / total if total else 0.0
