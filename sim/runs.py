"""A measured run as the RL loop writes it, read into typed records.

`runs/<run>/` holds three JSONL files:
- metrics.jsonl: one flat object per RL step (`timing/rollout`, `timing/rollout/rank0`, ...,
  `spec/accept_len`, `world_size`); any key but `step` may be missing;
- decode_steps.jsonl: one object per engine decode pass of one rank (batch size, mean context,
  shape "off" or d<depth>k<topk>v<verify>, drafted / accepted / emitted summed over rows, and
  draft_s / forward_s / other_s seconds);
- rollouts.jsonl: one object per response (step, rank, prompt_id, sample, length, ...), each
  rank's in the order of its training batch;
and config.yaml, the run's resolved config (read for the trainer's mini-batches and epochs).

A *timed step* is a metrics record with `timing/rollout`. The first timed step of a run is its
*warm-up*: rank 0 runs the held-out evaluation before it while the other ranks already roll out
(so its ranks do not start together), and its first passes at each shape pay one-off costs
(allocation, kernel selection); calibration and validation leave it out, its decode passes too.
A step's *rollout time* is the barrier's: `timing/rollout_max` (the slowest rank), not the mean
over ranks in `timing/rollout`.
This module reads; it fits nothing.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

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
    accepted: int | None  # None when the record lacks it
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

    @property
    def attn_pairs(self) -> float:  # attention scores: each computed token against its row's context
        return self.query_tokens * self.context_mean


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
    config: dict[str, Any] = field(default_factory=dict)  # config.yaml; {} when the folder has none

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def world(self) -> int:
        return int(max((m.get("world_size", 1) for m in self.metrics), default=1))

    def timed_steps(self) -> list[dict[str, Any]]:
        """The metrics records of the timed steps after the warm-up, in step order."""
        timed = sorted((m for m in self.metrics if "timing/rollout" in m), key=lambda m: m["step"])
        return timed[1:]

    def settled_passes(self) -> list[DecodeStep]:
        """The decode passes after the warm-up step (all of them in a run of one step)."""
        first = min((s.step for s in self.decode_steps), default=0)
        later = [s for s in self.decode_steps if s.step != first]
        return later or self.decode_steps

    def lengths_by_rank(self) -> dict[int, dict[int, list[int]]]:
        """step -> rank -> response lengths in batch order."""
        out: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        for r in self.rollouts:
            out[r.step][r.rank].append(r.length)
        return out

    def trainer(self, key: str, default: int) -> int:
        """An integer of the run's trainer config section (e.g. mini_batches), default without config.yaml."""
        return self.setting("trainer", key, default)

    def setting(self, section: str, key: str, default: int) -> int:
        """An integer of a section of the run's config.yaml (e.g. actor.micro_batch_tokens), default without it."""
        return int((self.config.get(section) or {}).get(key, default))


def rollout_s(m: dict[str, Any]) -> float:
    """A timed step's rollout time: the slowest rank's."""
    if "timing/rollout_max" in m:
        return float(m["timing/rollout_max"])
    ranks = [v for k, v in m.items() if k.startswith("timing/rollout/rank")]
    return float(max(ranks)) if ranks else float(m["timing/rollout"])


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
            drafted=int(r.get("drafted", 0)), accepted=int(r["accepted"]) if "accepted" in r else None,
            emitted=int(r.get("emitted", batch)), draft_s=float(r.get("draft_s", 0.0)),
            forward_s=float(_need(r, "forward_s", where)), other_s=float(r.get("other_s", 0.0))))
        parse_shape(steps[-1].shape)
    rollouts = []
    for i, r in enumerate(_jsonl(folder / "rollouts.jsonl")):
        where = f"{folder / 'rollouts.jsonl'}:{i + 1}"
        rollouts.append(RolloutRecord(step=int(_need(r, "step", where)), rank=int(r.get("rank", 0)),
                                      prompt_id=str(r.get("prompt_id", "")), sample=int(r.get("sample", 0)),
                                      length=int(_need(r, "length", where))))
    config_path = folder / "config.yaml"
    config = (yaml.safe_load(config_path.read_text()) or {}) if config_path.is_file() else {}
    return MeasuredRun(folder=folder, metrics=metrics, decode_steps=steps, rollouts=rollouts, config=config)
