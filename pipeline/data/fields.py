"""Rows of a data file and the fields in them: JSONL, JSON and parquet files; dotted field paths.

`read_rows(path)` gives every row of a file with its *line*: the 1-based file line for JSONL
(blank lines are not rows), the 1-based row number for parquet and for a JSON file (one object,
or an array of objects). A JSONL line that is not valid JSON is returned as its
`json.JSONDecodeError`, so that the caller reports it with the others instead of stopping.

`field(row, path)` reads a *field path*: a top-level key, or keys joined by dots into nested
objects (`reward_model.ground_truth`, verl's layout), where a number indexes a list
(`prompt.0.content`). A key that itself holds a dot is found too: at each level the longest
dotted run of segments that is a key wins. A field that is absent, or null, is `MISSING`.

This module knows nothing about problems, prompts or answers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SUFFIXES = (".jsonl", ".json", ".parquet")


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


def read_rows(path: str | Path) -> list[tuple[int, Any]]:
    """(line, decoded row or its JSONDecodeError) for each row of a .jsonl, .json or .parquet file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    if path.suffix == ".jsonl":
        rows = []
        with path.open(encoding="utf-8") as f:
            for line, text in enumerate(f, start=1):
                if text.strip():
                    try:
                        rows.append((line, json.loads(text)))
                    except json.JSONDecodeError as e:
                        rows.append((line, e))
        return rows
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); a .json file holds one object "
                             "or an array of objects (one row per line: name it .jsonl)") from None
        return list(enumerate(data if isinstance(data, list) else [data], start=1))
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(enumerate(pq.read_table(path).to_pylist(), start=1))
    raise ValueError(f"{path}: unsupported data file type {path.suffix!r}; expected one of {', '.join(SUFFIXES)}")


def field(row: Any, path: str) -> Any:
    """The value at the dotted `path` in `row`, or MISSING where a step of it is absent or null."""
    return _walk(row, path.split("."))


def _walk(node: Any, parts: list[str]) -> Any:
    if not parts:
        return MISSING if node is None else node
    if isinstance(node, dict):
        for n in range(len(parts), 0, -1):  # longest first: a key "a.b" beside a nested "a": {"b"}
            key = ".".join(parts[:n])
            if key in node:
                found = _walk(node[key], parts[n:])
                if found is not MISSING:
                    return found
        return MISSING
    if isinstance(node, list) and parts[0].isdigit() and int(parts[0]) < len(node):
        return _walk(node[int(parts[0])], parts[1:])
    return MISSING

