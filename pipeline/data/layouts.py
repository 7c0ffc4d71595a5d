"""The public dataset layouts a user downloads, each row converted to the run's layout.

The run's layout (what `task.*_field` read by default): `id`, `prompt` (text, or chat messages),
`answer` (the gold final answer, for math-verify), `solution` where the source has a worked one,
and the source row's other fields unchanged (a plug-in reward sees them as the problem's extra
fields). The id is the row's own `id` where it has one, else `pipeline.data.files.prompt_id`,
what the run would give the row.

| format | prompt | answer | kept as solution |
|---|---|---|---|
| gsm8k | `question` | the number after `####` in `answer` (commas dropped) | `answer` |
| math | `problem` | `answer` where present, else the last `\\boxed{}` of `solution` | `solution` |
| verl, dapo | `prompt` (chat messages, verl's and DAPO-Math-17k's parquet) | `reward_model.ground_truth` | |
| trl | `prompt` (text or messages) | the last `\\boxed{}` of `solution`, else `solution` | `solution` |

`convert(format, row)` raises ValueError saying what the row lacks. This module knows nothing
about files.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pipeline.data.chat import parse_messages
from pipeline.data.fields import MISSING, field
from pipeline.data.files import prompt_id

_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)
_NUMBER_WITH_COMMAS = re.compile(r"^[-+]?\d{1,3}(,\d{3})+(\.\d+)?$")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`; None if none closes."""
    starts = list(_BOXED.finditer(text))
    for match in reversed(starts):
        i = match.end()
        if i < len(text) and text[i] != "{":  # `\boxed 5`: up to the next space or `$`
            found = re.match(r"[^\s$]+", text[i:])
            return found.group(0) if found else None
        depth = 0
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                inner = text[i + 1:j].strip()
                if inner:
                    return inner
                break
    return None


def _text(row: dict, path: str) -> str:
    value = field(row, path)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if value is MISSING:
        raise ValueError(f"missing field {path!r}")
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"field {path!r} must be a non-empty string, got {value!r:.80}")
    return value


def _prompt(row: dict, path: str) -> str | list[dict]:
    """The row's prompt: text, or chat messages (checked, kept as role / content objects)."""
    value = field(row, path)
    if isinstance(value, (list, tuple)):
        return [{"role": role, "content": content} for role, content in parse_messages(value)]
    return _text(row, path)


def _gsm8k(row: dict) -> dict:
    worked = _text(row, "answer")
    found = _GSM8K_ANSWER.search(worked)
    if not found:
        raise ValueError(f"field 'answer' has no '#### N' final answer line: {worked[-80:]!r}")
    answer = found.group(1).rstrip(".")
    if _NUMBER_WITH_COMMAS.match(answer):
        answer = answer.replace(",", "")
    return {"prompt": _text(row, "question"), "answer": answer, "solution": worked}


def _math(row: dict) -> dict:
    solution = _text(row, "solution")
    own = field(row, "answer")
    answer = _text(row, "answer") if own is not MISSING and str(own).strip() else last_boxed(solution)
    if not answer:
        raise ValueError("no final answer: field 'answer' is absent or empty and 'solution' holds no \\boxed{}")
    return {"prompt": _text(row, "problem"), "answer": answer, "solution": solution}


def _verl(row: dict) -> dict:
    return {"prompt": _prompt(row, "prompt"), "answer": _text(row, "reward_model.ground_truth")}


def _trl(row: dict) -> dict:
    solution = _text(row, "solution")
    return {"prompt": _prompt(row, "prompt"), "answer": last_boxed(solution) or solution.strip(), "solution": solution}


_LAYOUTS: dict[str, tuple[Callable[[dict], dict], tuple[str, ...]]] = {  # format -> (convert, source fields it reads)
    "gsm8k": (_gsm8k, ("question", "answer")),
    "math": (_math, ("problem", "solution", "answer")),
    "verl": (_verl, ("prompt", "reward_model")),
    "dapo": (_verl, ("prompt", "reward_model")),
    "trl": (_trl, ("prompt", "solution")),
}
FORMATS = tuple(_LAYOUTS)


def convert(fmt: str, row: Any) -> dict:
    """The row in the run's layout (id, prompt, answer, solution, the source's other fields)."""
    if fmt not in _LAYOUTS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if not isinstance(row, dict):
        raise ValueError(f"a row must be an object, got {type(row).__name__}")
    to_run, read = _LAYOUTS[fmt]
    converted = to_run(row)
    own = row.get("id")
    row_id = str(own) if isinstance(own, (str, int)) and not isinstance(own, bool) and str(own).strip() else None
    rest = {k: v for k, v in row.items() if k not in read and k != "id"}
    return {"id": row_id or prompt_id(converted["prompt"]), **converted, **rest}
