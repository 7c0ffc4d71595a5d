"""The run folder's JSONL files: one record per line, each with an integer "step".

`metrics.jsonl` holds `{"step": s, "<name>": value, ...}` (a step may have several lines, e.g.
its training metrics and then its eval); `lengths.jsonl` holds `{"step": s, "lengths": [...]}`,
the response lengths of the step's rollouts. Writers append a whole line and flush it, so a
crash loses at most the line being written; readers skip such a torn last line.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from common.atomic import atomic_file

METRICS_FILE = "metrics.jsonl"
LENGTHS_FILE = "lengths.jsonl"


def read_records(path: str | Path) -> list[dict]:
    """The records of a JSONL file ([] when it does not exist), without a torn last line."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):  # no newline after it: the write was cut short by a crash
                warnings.warn(f"{path}: skipping a torn last line (a crash mid-write)", RuntimeWarning,
                              stacklevel=2)
                continue
            raise ValueError(f"{path}:{number} is not JSON ({e}); fix or delete that line") from e
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{number} is not a record with an integer 'step': {line[:80]!r}")
        records.append(record)
    return records


def truncate_after(path: str | Path, step: int) -> int:
    """Rewrite `path` atomically keeping only records of steps <= step; returns how many were dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    records = read_records(path)
    kept = [r for r in records if r["step"] <= step]
    with atomic_file(path) as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    return len(records) - len(kept)
