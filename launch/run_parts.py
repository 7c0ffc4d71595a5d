"""What both placements' builders (launch.colocated, launch.separated) share: the `Run` they
return, with its loop over the steps (evaluation, metrics, checkpoints) and its release; the
rank's log (`RankLog`); the state a resumed run continues from (`resume_state`).
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from engine.backend import RolloutBackend
from launch.run_config import TrainConfig
from pipeline.actors import Actor
from pipeline.checkpoint_keep import retain
from pipeline.data import PromptLoader
from pipeline.dist import Ranks
from pipeline.metrics import MetricsLogger
from pipeline.metrics.device_memory import cuda_memory_metrics
from pipeline.records_log import log_step, truncate_after
from pipeline.run_state import RunState, load_run
from pipeline.tasks import Problem, Task
from pipeline.trainer import StepDriver, peak_rss_gb


class RankLog:
    """Rank 0 prints; every rank appends to its own file."""

    def __init__(self, run_dir: Path, r: Ranks) -> None:
        self.r, self.path = r, run_dir / f"rank{r.rank}.log"

    def __call__(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        with self.path.open("a") as f:
            f.write(line + "\n")
        if self.r.main:
            print(line, flush=True)


@dataclass
class Run:
    cfg: TrainConfig
    ranks: Ranks
    run_dir: Path
    log: RankLog
    task: Task
    held_out: list[Problem]
    held_out_source: str  # names the held-out set in the eval log (launch.problems.RunProblems)
    loader: PromptLoader
    engine: RolloutBackend | None  # None on a separated run's actor ranks
    actor: Actor | None  # None on a separated run's rollout ranks
    trainer: StepDriver  # colocated: the Trainer; separated: this rank's side (launch.separated)
    logger: MetricsLogger
    start_step: int  # RL steps done before this process (a resumed run's checkpoint)
    resources: ExitStack = field(default_factory=ExitStack)  # closed by close(), last built first

    def train(self) -> dict:
        """Runs the remaining steps: eval before the first, every `trainer.eval_every` steps and at the
        end; metrics every step; checkpoints every `trainer.save_every` steps and at the end, the
        `trainer.keep_checkpoints` latest and the best held-out kept (pipeline.checkpoint_keep)."""
        cfg, r, trainer, log = self.cfg, self.ranks, self.trainer, self.log
        tc = cfg.trainer
        accuracy: dict[int, float] = {}
        with self.logger:
            if self.start_step == 0:
                accuracy[0] = trainer.evaluate()
                if r.main:
                    self.logger.log(0, {"eval/accuracy": accuracy[0]})
                    log(f"held-out greedy accuracy before training: {accuracy[0]:.1%} on {self.held_out_source}")
            t0 = time.perf_counter()
            for _ in range(self.start_step, tc.steps):
                result = trainer.step()
                step = trainer.step_index
                log_step(self.run_dir, step, r.rank, result.decode_steps, result.rollouts)
                log(f"step {step}: peak RSS {peak_rss_gb():.2f} GB on rank {r.rank}")
                metrics = result.metrics | cuda_memory_metrics(r)
                if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
                    acc = trainer.evaluate()
                    if acc is not None:
                        metrics["eval/accuracy"] = accuracy[step] = acc
                self.logger.log(step, metrics, lengths=result.lengths)
                if (tc.save_every and step % tc.save_every == 0) or step == tc.steps:
                    trainer.save()
                    if r.main and tc.keep_checkpoints:
                        for folder in retain(self.run_dir, step, accuracy.get(step), tc.keep_checkpoints):
                            log(f"removed checkpoint {folder.name} (trainer.keep_checkpoints={tc.keep_checkpoints}: "
                                "the latest and the best held-out stay)")
            train_s = time.perf_counter() - t0
        summary = {"run_dir": str(self.run_dir), "steps": tc.steps, "world_size": r.world, "train_seconds": round(train_s, 1),
                   "heldout_accuracy": {str(k): v for k, v in accuracy.items()}}
        if r.main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            for name in ("dashboard.png", "summary.txt"):
                if (self.run_dir / name).exists():
                    log(f"wrote {self.run_dir / name}")
        return summary

    def close(self) -> None:
        self.resources.close()


def resume_state(cfg: TrainConfig, r: Ranks, run_dir: Path, log: RankLog) -> tuple[Path | None, RunState]:
    """The checkpoint to continue from (None: a fresh start) and its state; rank 0 drops the run
    folder's records of the steps about to be redone."""
    resume = Path(cfg.trainer.resume) if cfg.trainer.resume else None
    if resume is None:
        return None, RunState(step=0, loader={}, engine_version=0)
    state = load_run(resume)
    if r.main:
        truncate_after(run_dir, state.step)
    log(f"resumed from {resume} at step {state.step}")
    return resume, state
