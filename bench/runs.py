"""Whole RL runs side by side, for the benches that compare ways of one run (bench.e2e,
bench.spot, bench.bubble --steps): run a plan of configs through launch.run.build in this process
group, read their metrics, and check two runs were the same run."""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from pathlib import Path

import torch

from common import heap
from common.config import load_config
from launch.run.config import TrainConfig
from launch.run.build import run as train_run
from pipeline.dist import Ranks, init_ranks, shutdown

# Per-step metrics two identical runs agree on exactly.
COMPARED = ("reward/mean", "train/pg_loss", "train/grad_norm", "rollout/response_length/mean")


def bench_overrides(steps: int, overrides: list[str]) -> list[str]:
    """A bench run: N steps, no evaluation beyond one problem, no W&B, console or dashboard, the weights saved once at the end."""
    return [f"trainer.steps={steps}", "trainer.eval_every=0", "trainer.save_every=0", "metrics.wandb=false",
            "metrics.console=false", "metrics.dashboard=false", "task.eval_problems=1", *overrides]


def train_runs(config: str, plan: list[tuple[str, list[str]]], common: list[str], out: Path, prefix: str,
               check: Callable[[TrainConfig, Ranks], None] | None = None) -> tuple[dict[str, Path], Ranks]:
    """Runs each (name, overrides) of the plan in order, in folder out/name; returns their run
    folders and this process's ranks. `check(cfg, ranks)` may refuse a config with a ValueError.
    Load errors raise FileNotFoundError or ValueError; the process group is shut down either way."""
    runs: dict[str, Path] = {}
    r = None
    try:
        for name, extra in plan:
            cfg = plan_config(config, common, extra, out / name, f"{prefix}-{name}")
            r = r or init_ranks(cfg.actor.device)
            if check is not None:
                check(cfg, r)
            runs[name] = Path(train_run(cfg, r)["run_dir"])
            release_heap()
    finally:
        shutdown()
    return runs, r


def release_heap() -> None:
    """Frees what a finished run left: its parts sit in reference cycles (GBs of a real model's
    tensors, until the collector's next full pass) and glibc keeps freed heap pages; without this a
    bench's next way starts with the previous way's memory still resident."""
    gc.collect()
    heap.trim()


def plan_config(config: str, common: list[str], extra: list[str], out_dir: Path, name: str) -> TrainConfig:
    """The config of one run of a plan (validated: ValueError naming a bad key or value)."""
    return load_config(TrainConfig, config, [*common, *extra, f"run.out_dir={out_dir}", f"run.name={name}"])


def read_metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "timing/step" in r]


def final_weights(run_dir: Path, steps: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folder = run_dir / "checkpoints" / f"step-{steps}" / "actor"
    return load_file(str(next(folder.glob("*.safetensors"))))


def same_weights(a: Path, b: Path, steps: int) -> bool:
    wa, wb = final_weights(a, steps), final_weights(b, steps)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def same_steps(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.get(k) == y.get(k) for x, y in zip(a, b) for k in COMPARED)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
