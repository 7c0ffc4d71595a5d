"""Response lengths: drawn from a distribution, and dealt out to rollout groups.

Vocabulary: a *request* is one (prompt, sample) to generate; its *length* is the response's
token count; a *group* is one data-parallel rollout engine (tensor-parallel devices together).
Randomness comes only from the `numpy.random.Generator` passed in.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from sim.config import LengthSpec


def draw_lengths(spec: LengthSpec, n: int, rng: np.random.Generator,
                 empirical: np.ndarray | None = None) -> np.ndarray:
    """[n] int64 response lengths >= 1. `empirical` (lengths read from spec.path) is needed for
    kind=empirical; it is resampled with replacement."""
    if spec.kind == "lognormal":
        x = rng.lognormal(mean=np.log(spec.median), sigma=spec.sigma, size=n)
        return np.clip(np.rint(x), 1, spec.max_len).astype(np.int64)
    if empirical is None or len(empirical) == 0:
        raise ValueError(f"rollout.lengths.kind=empirical: no lengths read from {spec.path}")
    return rng.choice(np.asarray(empirical, dtype=np.int64), size=n, replace=True)


def read_rollout_lengths(path: str | Path) -> np.ndarray:
    """The `length` of every line of a rollouts.jsonl, [n] int64."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"rollouts file not found: {path} (expected runs/<run>/rollouts.jsonl)")
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            rec = json.loads(line)
            if "length" not in rec:
                raise ValueError(f"{path}:{i + 1}: a rollout record needs a 'length' field")
            out.append(int(rec["length"]))
    return np.asarray(out, dtype=np.int64)


def deal(lengths: np.ndarray, groups: int) -> list[np.ndarray]:
    """Split requests into `groups` contiguous, near-equal parts (a prompt's samples stay together
    when they are adjacent, as GRPO groups are)."""
    if groups < 1:
        raise ValueError(f"need at least one rollout group, got {groups}")
    return [part.copy() for part in np.array_split(np.asarray(lengths), groups)]

