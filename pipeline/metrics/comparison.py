"""A run's step times measured against a reference run's (typically the same run with every
speedup off), and the record of that measurement in the run folder.

Vocabulary: *this* run is the one whose folder holds the record; the *reference* run is the one
it is compared with. The *step ratio* of a step is reference step time / this run's step time
(above 1: this run is faster). The run's `step_ratio` is mean reference step time / mean step
time over the steps both runs timed except the first, which pays one-time costs (compilation,
graph capture, allocator warm-up): for an RL run of steps 1..N, steps 2..N.

`comparison.json` in this run's folder (written by `record_comparison`, e.g. by a bench that ran
both runs):

    {"reference_run": "<folder>", "steps": [1, 2, ...], "step_s": [...], "reference_step_s": [...],
     "step_ratio": 1.23, "identical": true | false | null}

`step_s` / `reference_step_s` are each run's `timing/step` of `steps`; `step_ratio` is derived
from them (written for readers of the file, recomputed on reading); `identical` is whether the
two runs were the same run (rewards, losses, final weights), null when nobody checked. A run's
summary states a speedup only from such a measurement; nothing here draws or formats.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from common.atomic import atomic_write
from pipeline.metrics.history import RunHistory, load_history

COMPARISON_FILE = "comparison.json"


@dataclass(kw_only=True)
class Comparison:
    reference_run: str  # the reference run's folder
    steps: list[int]  # [S] the steps both runs timed, ascending
    step_s: list[float]  # [S] this run's timing/step
    reference_step_s: list[float]  # [S] the reference run's timing/step
    identical: bool | None = None  # the runs were the same run; None: not checked

    def __post_init__(self) -> None:
        if len(self.steps) < 2:
            raise ValueError(f"a comparison with {self.reference_run} needs at least 2 steps timed by both runs "
                             f"(the first is left out of the mean), got steps {self.steps}")
        if not len(self.steps) == len(self.step_s) == len(self.reference_step_s):
            raise ValueError(f"comparison: {len(self.steps)} steps but {len(self.step_s)} step_s and "
                             f"{len(self.reference_step_s)} reference_step_s")
        if not all(isinstance(s, int) for s in self.steps) or self.steps != sorted(set(self.steps)):
            raise ValueError(f"comparison steps must be ascending distinct integers, got {self.steps}")
        for name, times in (("step_s", self.step_s), ("reference_step_s", self.reference_step_s)):
            if not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in times):
                raise ValueError(f"comparison {name} must be positive finite seconds, got {times}")
        if self.identical is not None and not isinstance(self.identical, bool):
            raise ValueError(f"comparison identical must be true, false or null, got {self.identical!r}")

    @property
    def step_ratios(self) -> list[float]:
        """[S] reference / this, per step."""
        return [ref / this for this, ref in zip(self.step_s, self.reference_step_s)]

    @property
    def timed_steps(self) -> list[int]:
        """The steps the mean is over: all but the first."""
        return self.steps[1:]

    @property
    def step_ratio(self) -> float:
        """Mean reference step time / mean step time over `timed_steps`."""
        return sum(self.reference_step_s[1:]) / sum(self.step_s[1:])

    def to_dict(self) -> dict:
        return {**asdict(self), "step_ratio": self.step_ratio}

    @classmethod
    def from_dict(cls, record: dict) -> Comparison:
        names = {f.name for f in fields(cls)}
        unknown = set(record) - names - {"step_ratio"}
        if unknown:
            raise ValueError(f"comparison record has unknown keys {sorted(unknown)}; expected {sorted(names)}")
        missing = names - set(record) - {"identical"}
        if missing:
            raise ValueError(f"comparison record lacks {sorted(missing)}")
        return cls(**{k: v for k, v in record.items() if k in names})


def compare_histories(history: RunHistory, reference: RunHistory, *, reference_run: str,
                      identical: bool | None = None) -> Comparison:
    """The step times of the steps both histories timed (`timing/step`), side by side."""
    this_s, ref_s = dict(zip(*history.series("timing/step"))), dict(zip(*reference.series("timing/step")))
    steps = sorted(this_s.keys() & ref_s.keys())
    return Comparison(reference_run=reference_run, steps=steps, step_s=[this_s[s] for s in steps],
                      reference_step_s=[ref_s[s] for s in steps], identical=identical)


def compare_runs(run_dir: str | Path, reference_dir: str | Path, *, identical: bool | None = None) -> Comparison:
    """The comparison of two run folders' metrics.jsonl (FileNotFoundError if a folder is missing)."""
    return compare_histories(load_history(run_dir), load_history(reference_dir), reference_run=str(reference_dir),
                             identical=identical)


def record_comparison(run_dir: str | Path, reference_dir: str | Path, *, identical: bool | None) -> Comparison:
    """Compare the two runs and write <run_dir>/comparison.json; returns the comparison."""
    comparison = compare_runs(run_dir, reference_dir, identical=identical)
    text = json.dumps(comparison.to_dict(), indent=1) + "\n"
    atomic_write(Path(run_dir) / COMPARISON_FILE, lambda tmp: tmp.write_text(text))
    return comparison


def read_comparison(run_dir: str | Path) -> Comparison | None:
    """<run_dir>/comparison.json, or None when the run holds none."""
    path = Path(run_dir) / COMPARISON_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict):
            raise ValueError(f"expected a JSON object, got {type(record).__name__}")
        return Comparison.from_dict(record)
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path}: {e} (rewrite it with pipeline.metrics.comparison.record_comparison or "
                         "delete it)") from e
