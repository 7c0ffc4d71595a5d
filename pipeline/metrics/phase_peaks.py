"""Each phase's resident peak: where in a step a rank's memory peaks (rolling out or updating).

The kernel keeps a process's high-water mark of resident memory (VmHWM; getrusage's ru_maxrss) and
resets it to the resident memory of the moment when "5" is written to /proc/self/clear_refs. The
loop calls `mark()` as each phase of a step ends (pipeline.trainer: what came between steps, such as
the build, evaluation and checkpoints; the rollouts and their idle window; the update and the sync):
it reads the peak since the last mark and resets it, so each phase's peak can be set beside the
memory planner's figure for that phase (launch.memory). `peak_bytes()` is the process's peak so
far over every phase: what ru_maxrss says, which the resets would otherwise shorten. Where the
reset is not permitted, a mark reads the peak so far.
"""

from __future__ import annotations

from pathlib import Path

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
_peak = 0  # the largest peak a mark has read in this process


def high_water_bytes(status: Path = STATUS) -> int:
    """The kernel's high-water mark of this process's resident memory since its last reset (VmHWM)."""
    for line in status.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{status} has no VmHWM line: phase peaks are read from Linux's /proc")


def mark() -> int:
    """The peak resident bytes since the last mark (or the process's start); resets the mark."""
    global _peak
    value = high_water_bytes()
    _peak = max(_peak, value)
    try:
        CLEAR_REFS.write_text("5")
    except OSError:  # not permitted here: the next mark reads the peak so far
        pass
    return value


def peak_bytes() -> int:
    """This process's peak resident memory so far, over every phase."""
    return max(_peak, high_water_bytes())
