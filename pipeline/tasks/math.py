"""Math problems from JSONL or parquet files, checked with math-verify; the `math` task's reward.

`load_math_file(path, ...)` reads one problem per JSONL line or parquet row, taking the question,
the answer and an id from configurable fields (an optional field holds a worked solution). A
*bad row* (not a JSON object, a missing or empty field, an answer math-verify cannot parse, a
repeated id) is never dropped silently: each is logged as `file:line: what is wrong` and listed
in the returned `LoadReport`; if more than `max_bad_share` of the rows are bad the load fails
with a ValueError that shows the first ones. Line numbers are 1-based file lines for JSONL and
1-based row numbers for parquet; blank JSONL lines are not rows.

Prompts are the raw question. `chat_prompt` turns one into a chat-model prompt with the
tokenizer's own template, asking for the final answer in `\\boxed{}` (what the reward reads).

The built-in `math` task (pipeline.tasks.TASKS) draws its problems from
`pipeline.tasks.make_math` (the shipped files are its output) and scores with `reward`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.tasks.arith import Problem
from pipeline.tasks.rewards import MathVerifyReward, parse_gold

log = logging.getLogger(__name__)

BOXED_INSTRUCTION = "Put your final answer within \\boxed{}."
_MAX_SHOWN = 5  # bad rows quoted in an error message


@dataclass(frozen=True)
class BadRow:
    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass(frozen=True)
class LoadReport:
    path: str
    rows: int  # rows read, good and bad
    bad: tuple[BadRow, ...]

    @property
    def metrics(self) -> dict[str, float]:
        return {"data/rows": float(self.rows), "data/bad_rows": float(len(self.bad))}


def _read_rows(path: Path) -> list[tuple[int, Any]]:
    """(line, decoded row or its JSONDecodeError) for each row of a .jsonl or .parquet file."""
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
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(enumerate(pq.read_table(path).to_pylist(), start=1))
    raise ValueError(f"{path}: unsupported math file type {path.suffix!r}; expected .jsonl or .parquet")


def _text(row: dict, field: str, *, numbers: bool = False, hint: str = "") -> str:
    """The row's non-empty text in `field` (numbers as their decimal text if allowed), else ValueError."""
    if field not in row:
        raise ValueError(f"missing field {field!r}{hint}")
    value = row[field]
    if numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"field {field!r} must be a non-empty string, got {value!r}")
    return value


def load_math_file(
    path: str | Path,
    *,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    id_field: str | None = "id",  # None: ids are "<file stem>-<line>"
    response_field: str | None = None,  # a worked solution, if the file has one
    max_bad_share: float = 0.01,
) -> tuple[list[Problem], LoadReport]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"math file not found: {path}")
    if not 0.0 <= max_bad_share <= 1.0:
        raise ValueError(f"max_bad_share must be in [0, 1], got {max_bad_share}")
    problems: list[Problem] = []
    bad: list[BadRow] = []
    first_line: dict[str, int] = {}  # id -> line it first appeared on
    rows = _read_rows(path)
    if not rows:
        raise ValueError(f"{path}: the file holds no rows")
    for line, row in rows:
        try:
            if isinstance(row, json.JSONDecodeError):
                raise ValueError(f"not valid JSON ({row.msg})")
            if not isinstance(row, dict):
                raise ValueError(f"a row must be an object, got {type(row).__name__}")
            prompt = _text(row, prompt_field)
            answer = _text(row, answer_field, numbers=True)
            pid = (_text(row, id_field, numbers=True, hint=" (id_field=None numbers the rows instead)") if id_field
                   else f"{path.stem}-{line}")
            response = _text(row, response_field) if response_field else ""
            if not parse_gold(answer):
                raise ValueError(f"math-verify cannot parse the answer {answer!r}")
            if pid in first_line:
                raise ValueError(f"duplicate id {pid!r} (first on line {first_line[pid]})")
        except ValueError as e:
            bad.append(BadRow(str(path), line, str(e)))
            log.warning("%s", bad[-1])
            continue
        first_line[pid] = line
        problems.append(Problem(id=pid, prompt=prompt, answer=answer, response=response))
    if len(bad) > max_bad_share * len(rows):
        shown = "\n  ".join(str(b) for b in bad[:_MAX_SHOWN])
        more = f"\n  ... and {len(bad) - _MAX_SHOWN} more" if len(bad) > _MAX_SHOWN else ""
        raise ValueError(
            f"{path}: {len(bad)} of {len(rows)} rows are malformed ({len(bad) / len(rows):.1%}, more than "
            f"max_bad_share={max_bad_share:.1%}); fix them or raise max_bad_share:\n  {shown}{more}"
        )
    return problems, LoadReport(path=str(path), rows=len(rows), bad=tuple(bad))


def chat_prompt(tokenizer: Any, question: str, instruction: str = BOXED_INSTRUCTION) -> str:
    """The question as one user turn in the tokenizer's chat template, ready for the assistant's reply."""
    messages = [{"role": "user", "content": f"{question}\n{instruction}" if instruction else question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


_REWARD = MathVerifyReward()


def reward(text: str, answer: str) -> float:
    """1.0 if math-verify finds the response's final answer equal to `answer`, else 0.0."""
    return _REWARD(text, answer)[0]
