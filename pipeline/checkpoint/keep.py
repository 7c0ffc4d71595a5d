"""Which run checkpoints stay on disk: the last K, and the one of best held-out accuracy.

`trainer.keep_checkpoints: K` (0 keeps every one) bounds a run's disk use at K + 1 checkpoints: a
7B run saving every 20 of 200 steps would otherwise hold ten of about 100 GB each. After each save,
rank 0 records the held-out accuracy measured at that step, if any (`checkpoints/held_out.json`,
kept across resumes), and removes the complete checkpoints (`step-N/` with state.json) that are
neither among the K latest nor the best scored one (the latest of equal best). The latest is
always kept, so `trainer.resume=auto` finds it; a folder without state.json (a save that did not
finish) is not this module's to judge and is left alone.

`kept_steps` is the rule as a pure function; `retain` applies it to a run folder.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from common.atomic import atomic_file
from pipeline.checkpoint.state import STATE

SCORES = "held_out.json"  # in runs/<run>/checkpoints/: step -> held-out accuracy measured at that step


def kept_steps(steps: Iterable[int], keep: int, scores: Mapping[int, float]) -> set[int]:
    """The checkpoint steps to keep of `steps`: the `keep` latest (all when keep is 0) and the step of
    the best score among them (`scores`: step -> held-out accuracy; ties go to the later step)."""
    if keep < 0:
        raise ValueError(f"trainer.keep_checkpoints must be >= 0 (0 keeps every checkpoint), got {keep}")
    ordered = sorted(set(steps))
    if keep == 0:
        return set(ordered)
    kept = set(ordered[-keep:])
    scored = [(scores[s], s) for s in ordered if s in scores]
    if scored:
        kept.add(max(scored)[1])
    return kept


def checkpoint_steps(run_dir: str | Path) -> dict[int, Path]:
    """The run folder's complete checkpoints (with state.json) by step."""
    found = {}
    for folder in (Path(run_dir) / "checkpoints").glob("step-*"):
        step = folder.name.removeprefix("step-")
        if step.isdigit() and (folder / STATE).is_file():
            found[int(step)] = folder
    return found


def held_out_scores(run_dir: str | Path) -> dict[int, float]:
    path = Path(run_dir) / "checkpoints" / SCORES
    return {int(k): float(v) for k, v in json.loads(path.read_text()).items()} if path.is_file() else {}


def retain(run_dir: str | Path, step: int, accuracy: float | None, keep: int) -> list[Path]:
    """After the checkpoint of `step` (held-out `accuracy` at that step, None if not evaluated):
    records the accuracy and removes the checkpoints `kept_steps` leaves out; the removed folders."""
    scores = held_out_scores(run_dir)
    if accuracy is not None:
        scores[step] = accuracy
        with atomic_file(Path(run_dir) / "checkpoints" / SCORES) as f:
            json.dump({str(k): v for k, v in sorted(scores.items())}, f, indent=2)
    found = checkpoint_steps(run_dir)
    kept = kept_steps(found, keep, scores)
    removed = [found[s] for s in sorted(found) if s not in kept]
    for folder in removed:
        shutil.rmtree(folder)
    return removed
