"""One line of a preflight table (launch.slurm.preflight, launch.slurm.preflight_data): a check, its
result, and how to fix it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    fatal: bool = True  # False: a warning
    table: str = ""  # printed under the line (the memory plan)

    @property
    def failed(self) -> bool:
        return not self.ok and self.fatal
