"""The logger's sinks: JSONL files in the run folder, a W&B run, and a console line per step.

A sink receives every logged step as `write(step, metrics, lengths)` (`lengths` is the step's
response lengths or None) and is closed once. Sinks raise on failure; the logger decides what a
failure means for the run (see pipeline.metrics.logger). None of them knows about ranks.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from pipeline.metrics import jsonl
from pipeline.metrics.lengths import length_metric

WANDB_MODES = {"online": "online", "offline": "offline", "disabled": "disabled",
               "run": "online", "dryrun": "offline"}  # wandb's own aliases, as WANDB_MODE may use them


class Sink(Protocol):
    name: str

    def write(self, step: int, metrics: Mapping[str, float], lengths: Sequence[int] | None) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """metrics.jsonl and lengths.jsonl in the run folder, appended and flushed line by line."""

    name = "jsonl"

    def __init__(self, run_dir: str | Path) -> None:
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = run_dir / jsonl.METRICS_FILE
        self.lengths_path = run_dir / jsonl.LENGTHS_FILE
        self._metrics = open(self.metrics_path, "a")
        self._lengths = open(self.lengths_path, "a")

    def truncate_after(self, step: int) -> None:
        """On resume from a checkpoint of `step`: drop the lines of later steps (the run redoes them)."""
        for f, path in ((self._metrics, self.metrics_path), (self._lengths, self.lengths_path)):
            f.close()
            jsonl.truncate_after(path, step)
        self._metrics = open(self.metrics_path, "a")
        self._lengths = open(self.lengths_path, "a")

    def write(self, step: int, metrics: Mapping[str, float], lengths: Sequence[int] | None) -> None:
        _append(self._metrics, {"step": step, **metrics})
        if lengths is not None:
            _append(self._lengths, {"step": step, "lengths": list(lengths)})

    def close(self) -> None:
        self._metrics.close()
        self._lengths.close()


def _append(f: TextIO, record: dict) -> None:
    f.write(json.dumps(record) + "\n")
    f.flush()
    os.fsync(f.fileno())  # a step takes seconds; an fsync per line costs nothing next to it


def resolve_wandb_mode(config_mode: str, environ: Mapping[str, str] = os.environ) -> str:
    """The W&B mode to run in: the environment's WANDB_MODE when set, else the config's."""
    env = environ.get("WANDB_MODE")
    if not env:
        return config_mode
    if env not in WANDB_MODES:
        raise ValueError(f"WANDB_MODE={env!r} is not a W&B mode; use one of online, offline, disabled")
    mode = WANDB_MODES[env]
    if mode != config_mode:
        warnings.warn(f"metrics.wandb_mode={config_mode} is ignored: WANDB_MODE={env} is set in the "
                      "environment", UserWarning, stacklevel=2)
    return mode


RUN_ID_FILE = "run_id"  # in <run_dir>/wandb/: the W&B run id every start of this run folder logs to


def wandb_run_id(run_dir: str | Path) -> str:
    """The W&B run id of `run_dir`: made at its first start and kept in <run_dir>/wandb/run_id, so a
    requeued or resumed job (the same run.dir) logs to the same W&B run, online or offline."""
    import secrets

    path = Path(run_dir) / "wandb" / RUN_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    run_id = f"{Path(run_dir).name[:48]}-{secrets.token_hex(4)}"
    run_id = "".join(c if c.isalnum() or c in "-_." else "-" for c in run_id)
    path.write_text(run_id + "\n")
    return run_id


class WandbSink:
    """One W&B run whose files live in `<run_dir>/wandb/`; offline unless asked otherwise. Its id is
    the run folder's (`wandb_run_id`), resumed when it exists: an offline run's attempts are
    `offline-run-*-<id>` folders that `wandb sync` joins into one W&B run, in order. W&B keeps the
    steps it already has, so steps a resumed run redoes keep their first values there (the run
    folder's metrics.jsonl holds the redone ones). `system_stats`: W&B's sampler of CPU, GPU and
    memory use (a thread in this process)."""

    name = "wandb"

    def __init__(self, run_dir: str | Path, *, project: str, run_name: str, config: dict[str, Any] | None,
                 mode: str, system_stats: bool = True) -> None:
        import wandb  # slow to import: only runs that log to W&B pay it

        self._wandb = wandb
        settings = wandb.Settings(
            silent=True,  # the console sink is the run's voice; W&B's banners would interleave with it
            console="off",  # do not wrap stdout / stderr
            x_disable_stats=not system_stats,
            x_disable_machine_info=not system_stats,
        )
        self.run_id = wandb_run_id(run_dir)
        self._run = wandb.init(project=project, name=run_name, dir=str(run_dir), config=config or {},
                               mode=mode, settings=settings, id=self.run_id, resume="allow")

    def write(self, step: int, metrics: Mapping[str, float], lengths: Sequence[int] | None) -> None:
        payload: dict[str, Any] = dict(metrics)
        if lengths:
            payload["rollout/response_length/hist"] = self._wandb.Histogram(list(lengths))
        self._run.log(payload, step=step)

    def close(self) -> None:
        self._run.finish()


CONSOLE_FIELDS = (  # (label, metric, format): the fields of a step's line, in order
    ("reward", "reward/mean", "{:.3f}"),
    ("eval", "eval/accuracy", "{:.3f}"),
    ("len p50", length_metric("p50"), "{:.0f}"),  # the median and the tail: a long-tailed step's time is its max
    ("max", length_metric("max"), "{:.0f}"),
    ("rollout", "timing/rollout", "{:.1f}s"),
    ("accept", "spec/accept_len", "{:.2f}"),
    ("tok/s", "rollout/tokens_per_s", "{:.0f}"),
)


def console_line(step: int, metrics: Mapping[str, float]) -> list[tuple[str, str]]:
    """(label, value) pairs of a step's line; fields the step did not log are left out."""
    parts = [("step", str(step))]
    parts += [(label, fmt.format(metrics[name])) for label, name, fmt in CONSOLE_FIELDS if name in metrics]
    if metrics.get("timing/step", 0) > 0 and "timing/idle" in metrics:
        parts.append(("idle", f"{metrics['timing/idle'] / metrics['timing/step']:.0%}"))
    return parts


class ConsoleSink:
    """A line per logged step: styled by rich on a terminal, plain text otherwise (logs, CI)."""

    name = "console"

    def __init__(self, file: TextIO | None = None) -> None:
        from rich.console import Console

        self._file = file if file is not None else sys.stdout
        self._console = Console(file=self._file, highlight=False)

    def write(self, step: int, metrics: Mapping[str, float], lengths: Sequence[int] | None) -> None:
        parts = console_line(step, metrics)
        if self._console.is_terminal:
            self._console.print("  ".join(f"[dim]{label}[/dim] [bold]{value}[/bold]" for label, value in parts),
                                soft_wrap=True)
        else:
            print("  ".join(f"{label} {value}" for label, value in parts), file=self._file, flush=True)

    def close(self) -> None:
        self._file.flush()
