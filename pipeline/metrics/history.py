"""RunHistory: a run's logged metrics read back from its folder, for the dashboard and summary.

Lines of the same step are merged (a later line's value wins), so a step logged in parts
(training metrics, then eval) reads as one row. Nothing here draws or formats.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.metrics import jsonl

TIME_SPLIT = ("rollout", "idle", "logprob", "update", "sync")  # parts of timing/step, as the loop logs them


@dataclass(kw_only=True)
class RunHistory:
    rows: dict[int, dict[str, float]]  # step -> its metrics, in step order
    lengths: dict[int, list[int]]  # step -> the response lengths of its rollouts

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the steps that logged `name` with a finite value."""
        pairs = [(s, row[name]) for s, row in self.rows.items() if name in row and math.isfinite(row[name])]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def mean(self, name: str) -> float | None:
        values = self.series(name)[1]
        return sum(values) / len(values) if values else None

    def ranks(self, metric: str) -> list[int]:
        """The ranks r for which `<metric>/rank<r>` was logged, sorted."""
        pattern = re.compile(re.escape(metric) + r"/rank(\d+)$")
        return sorted({int(m.group(1)) for row in self.rows.values() for k in row if (m := pattern.match(k))})

    def share(self, part: str, whole: str = "timing/step") -> float | None:
        """sum(part) / sum(whole) over the steps that logged both: a time-weighted share."""
        rows = [r for r in self.rows.values() if part in r and r.get(whole, 0) > 0]
        return sum(r[part] for r in rows) / sum(r[whole] for r in rows) if rows else None


def load_history(run_dir: str | Path) -> RunHistory:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run folder not found: {run_dir}")
    rows: dict[int, dict[str, float]] = {}
    for record in jsonl.read_records(run_dir / jsonl.METRICS_FILE):
        step = record.pop("step")
        rows.setdefault(step, {}).update({k: v for k, v in record.items() if isinstance(v, (int, float))})
    lengths: dict[int, list[int]] = {}
    for record in jsonl.read_records(run_dir / jsonl.LENGTHS_FILE):
        lengths[record["step"]] = list(record["lengths"])
    return RunHistory(rows=dict(sorted(rows.items())), lengths=dict(sorted(lengths.items())))
