"""The memory guard: a run sheds its optional work, or stops, before host memory runs out.

Every step the colocated loop gathers each rank's peak resident memory and the share of its host's
memory still available (/proc/meminfo's MemAvailable over MemTotal), and asks `MemoryGuard.verdict`
what to do. The plan it holds each rank to is launch.memory's for the run's config (the role's
peak, the figure `python -m launch.memory` prints and the preflight checks), given at construction.

- **shed** (the default): a rank whose peak passes its plan by more than `over_plan` (50%; a CPU
  rank runs up to ~30% over with glibc's heap) and `over_plan_gb` (1 GB: a small run's plan is
  mostly the runtime's, whose imports vary), or a host
  whose available memory falls under `min_available`, turns off the run's optional work for the
  rest of the run: bubble drafts and spot training (each step hook's `shed()`; they change no token,
  so the run stays the same run). When nothing is left to shed, an over-plan rank is logged once
  and a host under `min_available` stops the run.
- **stop**: either condition stops the run at once.
- **warn**: both are logged (once each); nothing changes.
- **off**: no check.

A stop raises MemoryGuardStop on every rank at the same step (the verdict is computed from gathered
values, so every rank reaches the same one); the run's loop saves a checkpoint first, so the run
resumes from that step once the config fits (its message names the knobs). On a GPU the plan is
the device's (torch's allocator, `memory/cuda_*` metrics): the host guard then watches only the
host's available share.

Pure: the decision is `verdict`'s, over numbers; the loop (pipeline.trainer) gathers them and acts.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

MEMINFO = Path("/proc/meminfo")
KNOBS = ("actor.micro_batch_tokens", "engine.max_batch", "engine.max_len", "fewer ranks on this host")


@dataclass(kw_only=True)
class MemoryGuardConfig:
    mode: Literal["shed", "stop", "warn", "off"] = "shed"
    # act when a rank's peak RSS passes the memory plan's peak by this share and by at least over_plan_gb:
    # a CPU rank runs up to ~30% over its plan with glibc's heap (docs/BENCHMARKS.md, "Memory"), and a
    # small run's plan is mostly the runtime's imports
    over_plan: float = 0.5
    over_plan_gb: float = 1.0
    min_available: float = 0.05  # act when a host's available memory falls under this share of its total
    # hand glibc's free heap back to the OS as each update starts and ends (common.heap): the resident
    # peak then follows the live tensors the plan counts (a SmolLM2 rank held 2.5 GB free without it)
    trim_heap: bool = True

    def validate(self) -> None:
        if self.over_plan < 0:
            raise ValueError(f"memory_guard.over_plan must be >= 0 (a share of the plan), got {self.over_plan}")
        if self.over_plan_gb < 0:
            raise ValueError(f"memory_guard.over_plan_gb must be >= 0 (GB), got {self.over_plan_gb}")
        if not 0 <= self.min_available < 1:
            raise ValueError(f"memory_guard.min_available must be in [0, 1) (a share of the host's memory), "
                             f"got {self.min_available}")


class Action(str, enum.Enum):
    NONE = "none"
    WARN = "warn"
    SHED = "shed"
    STOP = "stop"


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str = ""


class MemoryGuardStop(RuntimeError):
    """The guard stopped the run: its message names the rank, the bytes and the knobs."""


def available_share(meminfo: Path = MEMINFO) -> float:
    """MemAvailable / MemTotal of this host (1.0 where /proc/meminfo does not say)."""
    fields = {}
    try:
        for line in meminfo.read_text().splitlines():
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return 1.0
    total = fields.get("MemTotal", 0)
    return fields.get("MemAvailable", total) / total if total else 1.0


class MemoryGuard:
    """The run's guard over `planned_gb` (each rank's planned peak in GB, by rank; None: no plan to
    hold ranks to, e.g. a GPU run's host); `log` says what it did."""

    def __init__(self, cfg: MemoryGuardConfig, planned_gb: Sequence[float] | None,
                 log: Callable[[str], None] = print) -> None:
        self.cfg, self.log = cfg, log
        self.planned = list(planned_gb) if planned_gb is not None else None
        self.shed_done = False  # optional work is off (or was never on)
        self.warned: set[str] = set()

    def verdict(self, peaks_gb: Sequence[float], available: Sequence[float], *, can_shed: bool) -> Verdict:
        """What to do after a step whose ranks peaked at `peaks_gb` with `available` shares of their
        hosts free (by rank); `can_shed`: optional work is still running."""
        c = self.cfg
        if c.mode == "off":
            return Verdict(Action.NONE)
        problems = []
        if self.planned is not None:
            over = [(r, p, plan) for r, (p, plan) in enumerate(zip(peaks_gb, self.planned, strict=True))
                    if p > max(plan * (1 + c.over_plan), plan + c.over_plan_gb)]
            if over:
                r, p, plan = max(over, key=lambda x: x[1] / x[2])
                problems.append(("over", f"rank {r} peaked at {p:.2f} GB, {p / plan - 1:+.0%} over the memory plan's "
                                         f"{plan:.2f} GB (memory_guard.over_plan={c.over_plan:g}, over_plan_gb={c.over_plan_gb:g})"))
        low = min(range(len(available)), key=lambda r: available[r]) if available else None
        if low is not None and available[low] < c.min_available:
            problems.append(("low", f"rank {low}'s host has {available[low]:.1%} of its memory available "
                                    f"(memory_guard.min_available={c.min_available:.0%})"))
        if not problems:
            return Verdict(Action.NONE)
        reason = "; ".join(text for _, text in problems)
        kinds = {kind for kind, _ in problems}
        if c.mode == "stop":
            return Verdict(Action.STOP, reason)
        if c.mode == "shed" and can_shed and not self.shed_done:
            return Verdict(Action.SHED, reason)
        if c.mode == "shed" and "low" in kinds:
            return Verdict(Action.STOP, reason)
        new = kinds - self.warned
        self.warned |= kinds
        return Verdict(Action.WARN, reason) if new else Verdict(Action.NONE)

    def stop_message(self, reason: str, step: int) -> str:
        return (f"memory guard stopped the run after step {step}: {reason}. A checkpoint of step {step} is "
                f"saved; make the run smaller ({', '.join(KNOBS)}; `python -m launch.memory --config ...` shows "
                "each part) and resume it with trainer.resume")
