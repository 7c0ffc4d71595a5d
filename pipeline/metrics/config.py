"""The metrics config section (`metrics:` in configs/*.yaml)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

_PROJECT = re.compile(r"^[A-Za-z0-9][\w.-]*$")


@dataclass(kw_only=True)
class MetricsConfig:
    wandb: bool = True
    wandb_project: str = "tailspec"
    # offline writes runs/<run>/wandb/offline-run-* (`wandb sync` uploads it later); online needs an
    # account (`wandb login`); the environment's WANDB_MODE, when set, wins over this.
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    # W&B's system metrics (CPU, GPU utilisation and memory, host memory) sampled by a thread in rank
    # 0's process; the run's own memory/* metrics cover every rank either way.
    wandb_system_stats: bool = True
    console: bool = True  # a line per step on rank 0
    dashboard: bool = True  # dashboard.png and summary.txt in the run folder at the end

    def validate(self) -> None:
        if not _PROJECT.match(self.wandb_project):
            raise ValueError(f"metrics.wandb_project must be a W&B project name (letters, digits, '_', '-', "
                             f"'.'), got {self.wandb_project!r}")
