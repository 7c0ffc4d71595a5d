"""A run's problem sets from its data files: the training problems and the held-out set, named.

`file_sets` loads a training file and / or a held-out file (pipeline.data.files) and makes:

- the *training problems*: the training file's, less its held-out share, if it has one;
- the *held-out set*: the held-out file's problems, or the training file's held-out share
  (pipeline.data.split: by a hash of the id, the same on every run and rank, disjoint from
  training); of those the run evaluates the `eval_problems` of smallest hash position, a fixed
  uniform sample. The set carries its *source*, the words the eval log names it by: the file,
  the share and the counts.

A held-out file whose prompts or ids also occur in the training file is allowed (a team may
evaluate on what it trains on) and reported: logged and counted in the summary.

This module knows nothing about tokenizers or configs; the caller's `check(problem)` says what
is wrong with a problem (a prompt too long for the engine's room) and makes it a bad row of its
file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from pipeline.data.files import Check, LoadReport, RowFields, load_problems, prompt_key
from pipeline.data.split import first_by_position, hold_out
from pipeline.tasks.arith import Problem

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class HeldOut:
    problems: list[Problem]  # the ones the run evaluates
    source: str  # the eval log's name for them: file, share, counts


@dataclass(frozen=True)
class FileSets:
    train: list[Problem] | None  # None: no training file (the task generates its problems)
    held_out: HeldOut | None  # None: neither a held-out file nor a share (the task's own test split)
    reports: tuple[LoadReport, ...]
    overlap: int = 0  # held-out-file problems whose id or prompt is also a training problem's

    def summary(self) -> list[str]:
        """One line per file (rows, bad rows, duplicate prompts) and one for the split."""
        lines = [f"{r.path}: {r.rows} rows, {len(r.bad)} bad, {len(r.duplicate_prompts)} duplicate prompts"
                 for r in self.reports]
        split = [f"{len(self.train)} training problems"] if self.train is not None else []
        if self.held_out is not None:
            split.append(f"held out: {self.held_out.source}")
        if self.overlap:
            split.append(f"{self.overlap} held-out problems are also training problems")
        return lines + ["; ".join(split)] if split else lines


def _evaluated(problems: list[Problem], where: str, eval_problems: int) -> HeldOut:
    chosen = first_by_position(problems, eval_problems)
    capped = " (the task.eval_problems of smallest id hash)" if len(chosen) < len(problems) else ""
    return HeldOut(chosen, f"{where}, {len(chosen)} of {len(problems)} problems{capped}")


def file_sets(file: str | Path | None, eval_file: str | Path | None, *, eval_share: float, eval_problems: int,
              fields: RowFields = RowFields(), max_bad_share: float = 0.01, check: Check | None = None) -> FileSets:
    """The training problems and held-out set of a run's files (the module's docstring says which)."""
    if eval_share and (eval_file or not file):
        raise ValueError("task.eval_share holds out a share of task.file: give it with task.file and without "
                         "task.eval_file")
    if eval_problems < 1:
        raise ValueError(f"task.eval_problems must be >= 1, got {eval_problems}")
    reports, train, held = [], None, None
    if file:
        problems, report = load_problems(file, fields, max_bad_share=max_bad_share, check=check)
        reports.append(report)
        train, shared = hold_out(problems, eval_share)
        if eval_share:
            if not shared or not train:
                raise ValueError(f"task.eval_share={eval_share:g} of {file}'s {len(problems)} problems leaves "
                                 f"{len(shared)} held out and {len(train)} for training; choose a share that "
                                 "leaves both some, or give task.eval_file"
                                 + (" (a train file written by pipeline.data.prepare has had its test share taken "
                                    "out by the same id hash: give its test file as task.eval_file)"
                                    if not shared else ""))
            held = _evaluated(shared, f"{file}'s held-out share {eval_share:g}", eval_problems)
    overlap = 0
    if eval_file:
        problems, report = load_problems(eval_file, fields, max_bad_share=max_bad_share, check=check)
        reports.append(report)
        held = _evaluated(problems, str(eval_file), eval_problems)
        if train:
            ids, prompts = {p.id for p in train}, {prompt_key(p.messages or p.prompt) for p in train}
            shared = [p for p in problems if p.id in ids or prompt_key(p.messages or p.prompt) in prompts]
            overlap = len(shared)
            if shared:
                log.warning("%s: %d of %d held-out problems are also in %s (first: %s)", eval_file, overlap,
                            len(problems), file, shared[0].id)
    return FileSets(train=train, held_out=held, reports=tuple(reports), overlap=overlap)
