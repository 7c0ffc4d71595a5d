"""MetricsLogger: the one place every rank sends its step metrics; rank 0 writes them out.

Names are namespaced (`reward/*`, `eval/*`, `rollout/*`, `spec/*`, `train/*`, `timing/*`) and
values are plain numbers (a tensor must be `.item()`-ed by the caller: a metric is never a
hidden device sync). Only rank 0 holds sinks; other ranks' loggers check what they are given
and write nothing, so the same loop code runs on every rank.

Given a step's `lengths` (every response length of the step, all ranks), the logger adds their
statistics as `rollout/response_length/{mean,p50,p90,max}` (pipeline.metrics.lengths) before any
sink sees the step; these replace a caller's values of the same names, which may be one rank's.

A sink that fails never stops the run: the logger warns once, naming the sink and the error,
and leaves that sink out from then on; the other sinks go on. Bad input (a step or a value
that is not a number) is the caller's bug and raises ValueError.

At close, rank 0 renders `dashboard.png` and `summary.txt` from the run folder's files (when
`report=True`) and prints both paths.
"""

from __future__ import annotations

import numbers
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.metrics.config import MetricsConfig
from pipeline.metrics.lengths import length_stats
from pipeline.metrics.sinks import ConsoleSink, JsonlSink, Sink, WandbSink, resolve_wandb_mode


class MetricsLogger:
    def __init__(self, run_dir: str | Path, sinks: Sequence[Sink], rank: int = 0, *, report: bool = False) -> None:
        if rank != 0 and sinks:
            raise ValueError(f"rank {rank} was given sinks; only rank 0 writes them (build them on rank 0 only, "
                             "as MetricsLogger.from_config does)")
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.report = report and rank == 0
        self._sinks = list(sinks)
        self._closed = False

    @classmethod
    def from_config(cls, run_dir: str | Path, config: MetricsConfig, *, rank: int = 0, run_name: str | None = None,
                    resolved_config: dict[str, Any] | None = None, resume_after_step: int | None = None,
                    environ: Mapping[str, str] = os.environ) -> MetricsLogger:
        """The run's logger. `resume_after_step`: the step of the checkpoint a resumed run starts
        from; JSONL lines of later steps are dropped, as the run logs those steps again."""
        if rank != 0:
            return cls(run_dir, [], rank)
        mode = resolve_wandb_mode(config.wandb_mode, environ) if config.wandb else "disabled"
        factories = [("jsonl", lambda: JsonlSink(run_dir))]
        if mode != "disabled":
            factories.append(("wandb", lambda: WandbSink(
                run_dir, project=config.wandb_project, run_name=run_name or Path(run_dir).name,
                config=resolved_config, mode=mode, system_stats=config.wandb_system_stats)))
        if config.console:
            factories.append(("console", ConsoleSink))
        sinks = []
        for name, make in factories:
            try:
                sinks.append(make())
            except Exception as e:  # noqa: BLE001  (a sink must not stop the run; reported here)
                _warn(name, "could not start", e)
        if resume_after_step is not None:
            for sink in sinks:
                if isinstance(sink, JsonlSink):
                    sink.truncate_after(resume_after_step)
        return cls(run_dir, sinks, rank, report=config.dashboard)

    @property
    def sink_names(self) -> list[str]:
        return [sink.name for sink in self._sinks]

    def log(self, step: int, metrics: Mapping[str, Any], *, lengths: Sequence[int] | None = None) -> None:
        """Record `metrics` for RL step `step`; `lengths`: the step's response lengths in tokens, every
        rank's (their mean, p50, p90 and max are logged with the step)."""
        if self._closed:
            raise ValueError("MetricsLogger.log after close()")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        values = {name: _number(name, value) for name, value in metrics.items()}
        if values.pop("step", step) != step:
            raise ValueError(f"metrics['step']={metrics['step']} disagrees with step={step}")
        if lengths is not None:
            lengths = [int(_number("lengths", n)) for n in lengths]
            values.update(length_stats(lengths))
        for sink in list(self._sinks):
            try:
                sink.write(int(step), values, lengths)
            except Exception as e:  # noqa: BLE001  (a sink must not stop the run; reported here)
                self._drop(sink, "failed", e)

    def close(self) -> tuple[Path, Path] | None:
        """Close the sinks; on rank 0 with report on, write the dashboard and summary and return their paths."""
        if self._closed:
            return None
        self._closed = True
        for sink in list(self._sinks):
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001
                _warn(sink.name, "failed to close", e)
        self._sinks = []
        if not self.report:
            return None
        from pipeline.metrics.dashboard import write_report  # matplotlib loads only when a report is made

        try:
            return write_report(self.run_dir)
        except Exception as e:  # noqa: BLE001  (the run's results are in the JSONL files either way)
            _warn("dashboard", f"could not be written (rebuild it with `python -m pipeline.metrics.dashboard "
                  f"{self.run_dir}`)", e)
            return None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _drop(self, sink: Sink, what: str, error: Exception) -> None:
        _warn(sink.name, f"{what}; it is off for the rest of the run", error)
        self._sinks.remove(sink)
        try:
            sink.close()
        except Exception:  # noqa: BLE001, S110  (the sink's failure was just reported; this is its echo)
            pass


def _warn(sink: str, what: str, error: Exception) -> None:
    warnings.warn(f"metrics sink '{sink}' {what}: {type(error).__name__}: {error}", RuntimeWarning, stacklevel=3)


def _number(name: str, value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"metric '{name}' must be a number, got {type(value).__name__} {value!r:.60} "
                         "(call .item() on a tensor)")
    return int(value) if isinstance(value, numbers.Integral) else float(value)
