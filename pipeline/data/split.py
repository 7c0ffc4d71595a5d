"""The held-out split of a problem set, by a hash of each problem's id.

`position(id)` places an id in [0, 1) by the SHA-256 of `"held-out:" + id`; a problem is
*held out* at share s when its position is below s. The split depends on the id alone, so it is
the same in every run, on every rank and machine, whatever the file's order or the world size;
a larger share holds out a superset of a smaller one's problems; and a problem keeps its side
when rows are added to the file. `first_by_position(problems, n)` takes the n problems of
smallest position, a fixed uniform sample of a set (the held-out problems a run evaluates).

`pipeline.data.prepare` splits train from test with the same positions, so `prepare
--test-share s` and a run's `task.eval_share=s` on the unsplit file hold out the same rows.

This module knows nothing about files or configs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from pipeline.tasks.arith import Problem


def position(problem_id: str) -> float:
    """The id's place in [0, 1): the first 8 bytes of a SHA-256, as a fraction of 2^64."""
    digest = hashlib.sha256(f"held-out:{problem_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def is_held_out(problem_id: str, share: float) -> bool:
    return position(problem_id) < share


def hold_out(problems: Sequence[Problem], share: float) -> tuple[list[Problem], list[Problem]]:
    """(kept, held out) at `share`, each in the given order."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"a held-out share must be in [0, 1], got {share}")
    kept, held = [], []
    for p in problems:
        (held if is_held_out(p.id, share) else kept).append(p)
    return kept, held


def first_by_position(problems: Sequence[Problem], n: int) -> list[Problem]:
    """The n problems (all, if fewer) of smallest position, in that order."""
    return sorted(problems, key=lambda p: position(p.id))[:n]
