"""Problem files: the rows of a JSONL / JSON / parquet file as Problems, every bad row reported.

`load_problems(path, fields, ...)` reads one problem per row through `RowFields`, field paths
(pipeline.data.fields) naming where the row keeps its prompt, answer, id and (optionally) a
worked solution:

- the *prompt* is text, or chat messages (pipeline.data.chat), kept as the problem's `messages`
  with its `prompt` the last user turn's text;
- the *answer* is non-empty text (a number is taken as its decimal text);
- the *id* is the row's own where it has one, else `prompt_id(prompt)`: a hash of the prompt,
  the same in every run, on every machine, whatever the row's position (a file re-sorted or
  extended keeps its ids, so its noise keys and its held-out split);
- the problem's `extra` holds the row's other top-level fields, for a plug-in reward.

A *bad row* (not a JSON object, a missing or empty field, malformed messages, a repeated id, or
whatever the caller's `check` finds) is never dropped silently: each is logged as
`file:line (id X): what is wrong` and listed in the returned `LoadReport`; if more than
`max_bad_share` of the rows are bad the load fails with a ValueError that shows the first ones.
Two rows with the same prompt under different ids are not bad; they are reported as *duplicate
prompts* (logged, counted).

This module knows nothing about tokenizers, rewards or configs: a check that needs one (an
answer math-verify can read, a prompt that fits the engine) is the caller's `check`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.data.chat import parse_messages
from pipeline.data.fields import MISSING, field, read_rows
from pipeline.tasks.arith import Problem

log = logging.getLogger(__name__)

MAX_SHOWN = 5  # bad rows quoted in an error message
Check = Callable[[Problem], "str | None"]  # a problem -> what is wrong with it, or None


@dataclass(frozen=True)
class RowFields:
    """Where a row keeps each part of its problem (field paths; pipeline.data.fields)."""

    prompt: str = "prompt"
    answer: str = "answer"
    id: str | None = "id"  # None, or a row without it: the id is a hash of the prompt
    response: str | None = None  # a worked solution, if the file has one


@dataclass(frozen=True)
class BadRow:
    path: str
    line: int
    reason: str
    id: str | None = None  # the row's id, where it got that far

    def __str__(self) -> str:
        return f"{self.path}:{self.line}{f' (id {self.id})' if self.id else ''}: {self.reason}"


@dataclass(frozen=True)
class LoadReport:
    path: str
    rows: int  # rows read, good and bad
    bad: tuple[BadRow, ...]
    duplicate_prompts: tuple[BadRow, ...] = ()  # kept rows whose prompt an earlier row has too

    @property
    def metrics(self) -> dict[str, float]:
        return {"data/rows": float(self.rows), "data/bad_rows": float(len(self.bad)),
                "data/duplicate_prompts": float(len(self.duplicate_prompts))}


def prompt_key(prompt: str | list | tuple) -> str:
    """The canonical text of a prompt (text or messages) that ids and duplicate checks compare."""
    return json.dumps(prompt, ensure_ascii=False, sort_keys=True, separators=(",", ":"), default=str)


def prompt_id(prompt: str | list | tuple) -> str:
    """The id of a row without one: `h-` and 16 hex digits of the SHA-256 of the prompt's key."""
    return "h-" + hashlib.sha256(prompt_key(prompt).encode()).hexdigest()[:16]


def _text(value: Any, name: str, *, numbers: bool = False) -> str:
    """`value` as non-empty text (a number as its decimal text if allowed), else ValueError naming `name`."""
    if numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if value is MISSING:
        raise ValueError(f"missing field {name!r}")
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"field {name!r} must be a non-empty string, got {value!r:.80}")
    return value


def problem_of(row: Any, fields: RowFields) -> Problem:
    """The problem a decoded row holds; ValueError saying what is wrong with the row."""
    if isinstance(row, json.JSONDecodeError):
        raise ValueError(f"not valid JSON ({row.msg})")
    if not isinstance(row, dict):
        raise ValueError(f"a row must be an object, got {type(row).__name__}")
    raw = field(row, fields.prompt)
    if isinstance(raw, (list, tuple)):
        messages = parse_messages(raw)
        prompt = messages[-1][1]
    else:
        messages, prompt = (), _text(raw, fields.prompt)
    own = field(row, fields.id) if fields.id else MISSING
    pid = prompt_id(raw) if own is MISSING else _text(own, fields.id, numbers=True)
    answer = _text(field(row, fields.answer), fields.answer, numbers=True)
    response = _text(field(row, fields.response), fields.response) if fields.response else ""
    read = {fields.prompt, fields.answer, fields.id, fields.response}  # dotted paths keep their container
    extra = {k: v for k, v in row.items() if k not in read}
    return Problem(id=pid, prompt=prompt, answer=answer, response=response, extra=extra, messages=messages)


def _reported_id(row: Any, fields: RowFields) -> str | None:
    """The id to name a bad row by: its own, else its prompt's hash; None where it has neither."""
    if not isinstance(row, dict):
        return None
    own = field(row, fields.id) if fields.id else MISSING
    if isinstance(own, (str, int)) and not isinstance(own, bool) and str(own).strip():
        return str(own)
    raw = field(row, fields.prompt)
    return None if raw is MISSING or own is not MISSING else prompt_id(raw)


def refuse_past_share(source: str, bad: list[BadRow], rows: int, max_bad_share: float) -> None:
    """ValueError showing the first bad rows when more than `max_bad_share` of `rows` are bad."""
    if len(bad) > max_bad_share * rows:
        shown = "\n  ".join(str(b) for b in bad[:MAX_SHOWN])
        more = f"\n  ... and {len(bad) - MAX_SHOWN} more" if len(bad) > MAX_SHOWN else ""
        raise ValueError(f"{source}: {len(bad)} of {rows} rows are malformed ({len(bad) / rows:.1%}, more than "
                         f"max_bad_share={max_bad_share:.1%}); fix them or raise max_bad_share:\n  {shown}{more}")


def load_problems(path: str | Path, fields: RowFields = RowFields(), *, max_bad_share: float = 0.01,
                  check: Check | None = None) -> tuple[list[Problem], LoadReport]:
    """The file's problems in file order and its LoadReport (the module's docstring says what is bad)."""
    path = Path(path)
    if not 0.0 <= max_bad_share <= 1.0:
        raise ValueError(f"max_bad_share must be in [0, 1], got {max_bad_share}")
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"{path}: the file holds no rows")
    problems: list[Problem] = []
    bad: list[BadRow] = []
    duplicates: list[BadRow] = []
    first_line: dict[str, int] = {}  # id -> the line it first appeared on
    first_prompt: dict[str, tuple[int, str]] = {}  # prompt key -> (line, id) of its first row
    for line, row in rows:
        try:
            p = problem_of(row, fields)
            pid = p.id
            if pid in first_line:
                raise ValueError(f"duplicate id {pid!r} (first on line {first_line[pid]})")
            reason = check(p) if check else None
            if reason:
                raise ValueError(reason)
        except ValueError as e:
            bad.append(BadRow(str(path), line, str(e), _reported_id(row, fields)))
            log.warning("%s", bad[-1])
            continue
        first_line[pid] = line
        key = prompt_key(p.messages or p.prompt)
        if key in first_prompt:
            earlier = first_prompt[key]
            duplicates.append(BadRow(str(path), line, f"the same prompt as line {earlier[0]} (id {earlier[1]})", pid))
            log.warning("%s", duplicates[-1])
        else:
            first_prompt[key] = (line, pid)
        problems.append(p)
    refuse_past_share(str(path), bad, len(rows), max_bad_share)
    return problems, LoadReport(path=str(path), rows=len(rows), bad=tuple(bad), duplicate_prompts=tuple(duplicates))
