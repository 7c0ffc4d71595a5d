"""A measured run as the RL loop writes it, read into typed records.

`runs/<run>/` holds three JSONL files:
- metrics.jsonl: one flat object per RL step (`timing/rollout`, `timing/rollout/rank0`, ...,
  `spec/accept_len`, `world_size`); any key but `step` may be missing;
- decode_steps.jsonl: one object per engine decode pass of one rank (batch size, mean context,
  shape "off" or d<depth>k<topk>v<verify>, drafted / accepted / emitted summed over rows, and
  draft_s / forward_s / other_s seconds);
- rollouts.jsonl: one object per response (step, rank, prompt_id, sample, length, ...).
This module reads; it fits nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHAPE = re.compile(r"^d(\d+)k(\d+)v(\d+)$")


def parse_shape(shape: str) -> tuple[int, int, int] | None:
    """(depth, topk, verify_tokens) of a shape name, None for "off"."""
    if shape == "off":
        return None
    m = SHAPE.match(shape)
    if not m:
        raise ValueError(f"decode step shape {shape!r}: expected 'off' or d<depth>k<topk>v<verify>, e.g. d6k1v6")
    return int(m[1]), int(m[2]), int(m[3])


@dataclass(frozen=True)
class DecodeStep:
    step: int
    rank: int
    batch_size: int
    context_mean: float
    shape: str
    drafted: int
    accepted: int
    emitted: int
    draft_s: float
    forward_s: float
    other_s: float

    @property
    def query_tokens(self) -> int:  # tokens the target computed: a root plus the verified nodes
        parsed = parse_shape(self.shape)
        return self.batch_size * (1 + (parsed[2] if parsed else 0))

    @property
    def kv_tokens(self) -> float:
        return self.batch_size * self.context_mean


@dataclass(frozen=True)
class RolloutRecord:
    step: int
    rank: int
    prompt_id: str
    sample: int
    length: int


@dataclass(frozen=True)
class MeasuredRun:
    folder: Path
    metrics: list[dict[str, Any]]
    decode_steps: list[DecodeStep]
    rollouts: list[RolloutRecord]

    @property
    def name(self) -> str:
        return self.folder.name


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a measured run folder holds metrics.jsonl, "
                                "decode_steps.jsonl and rollouts.jsonl")
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: not a JSON object ({e})") from e
    return out


def _need(rec: dict[str, Any], key: str, where: str) -> Any:
    if key not in rec:
        raise ValueError(f"{where}: record lacks the required key {key!r}")
    return rec[key]


def run_folder(path: str | Path) -> Path:
    """The run folder from the folder itself or any of its files (e.g. metrics.jsonl)."""
    path = Path(path)
    return path.parent if path.suffix == ".jsonl" else path


def read_run(path: str | Path) -> MeasuredRun:
    folder = run_folder(path)
    metrics = _jsonl(folder / "metrics.jsonl")
    steps = []
    for i, r in enumerate(_jsonl(folder / "decode_steps.jsonl")):
        where = f"{folder / 'decode_steps.jsonl'}:{i + 1}"
        batch = int(_need(r, "batch_size", where))
        steps.append(DecodeStep(
            step=int(_need(r, "step", where)), rank=int(r.get("rank", 0)), batch_size=batch,
            context_mean=float(_need(r, "context_mean", where)), shape=str(r.get("shape", "off")),
            drafted=int(r.get("drafted", 0)), accepted=int(r.get("accepted", 0)),
            emitted=int(r.get("emitted", batch)), draft_s=float(r.get("draft_s", 0.0)),
            forward_s=float(_need(r, "forward_s", where)), other_s=float(r.get("other_s", 0.0))))
        parse_shape(steps[-1].shape)
    rollouts = []
    for i, r in enumerate(_jsonl(folder / "rollouts.jsonl")):
        where = f"{folder / 'rollouts.jsonl'}:{i + 1}"
        rollouts.append(RolloutRecord(step=int(_need(r, "step", where)), rank=int(r.get("rank", 0)),
                                      prompt_id=str(r.get("prompt_id", "")), sample=int(r.get("sample", 0)),
                                      length=int(_need(r, "length", where))))
    return MeasuredRun(folder=folder, metrics=metrics, decode_steps=steps, rollouts=rollouts)
