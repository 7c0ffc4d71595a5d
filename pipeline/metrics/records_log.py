"""Per-rank records of every RL step, for the simulator's calibration (sim.calibration.runs reads them).

`decode_steps.jsonl`: one line per engine decode step of one rank (engine.types.StepRecord.as_dict
plus the RL step and the rank that generated); `rollouts.jsonl`: one line per rollout, written by
the rank that trained it, in its training order (step, that rank, the rank that generated it as
`gen_rank`, prompt id, sample, length, finish reason, reward; and `mini_batch`, the index of the
trainer's mini-batch that took it, where the schedule dealt the rows: pipeline.shares.row_shares).
Every rank appends to the same files, one `write` per line on a file opened with O_APPEND, which
Linux keeps whole for lines this short; a resumed run first drops the lines of the steps it is
about to redo (rank 0, before the others start).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from common.atomic import atomic_file

FILES = ("decode_steps.jsonl", "rollouts.jsonl")


def _append(path: Path, rows: list[dict]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        for row in rows:
            os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)


def log_step(run_dir: Path, step: int, rank: int, decode_steps, scored) -> None:
    """decode_steps: this rank's engine.types.StepRecords of the step; scored: the
    pipeline.rollout.stage.ScoredRollouts this rank trained on, or None (a separated run's rollout rank)."""
    _append(run_dir / FILES[0], [{"step": step, "rank": rank, **r.as_dict()} for r in decode_steps])
    if scored is None:
        return
    generated_on = scored.generated_on or [rank] * len(scored.batch.rollouts)
    rows = scored.trained
    mini_batch = ([k for k, size in enumerate(scored.mini_batch_rows) for _ in range(size)]
                  if scored.mini_batch_rows is not None else None)
    rewards = scored.rewards.tolist()
    _append(run_dir / FILES[1], [
        {"step": step, "rank": rank, "gen_rank": generated_on[i], "prompt_id": scored.batch[i].prompt_id,
         "sample": scored.batch[i].sample, "prompt_len": len(scored.prompts[i // scored.n]),
         "length": len(scored.batch[i].tokens), "finish_reason": scored.batch[i].finish_reason.value,
         "reward": float(rewards[i])} | ({"mini_batch": mini_batch[j]} if mini_batch is not None else {})
        for j, i in enumerate(rows)
    ])


def truncate_after(run_dir: Path, step: int) -> None:
    """Keeps the lines of steps <= step (a resumed run logs the later ones again)."""
    for name in FILES:
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        with atomic_file(path) as f:
            f.write("".join(line + "\n" for line in keep))
