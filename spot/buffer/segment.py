"""A DataBuffer segment's lifetime: its name, its header's owner, and reclaiming a dead run's.

Names are per node: `segment_name(run)` for a run's own buffer, `node_segment(name)` for a job's
buffer that several processes name alike (`spot.buffer_name`, a spot pool's `--buffer`). A node is
`node_name()`: Slurm's name for it in a job's tasks (SLURMD_NODENAME), else the host name, so that
the nodes of one job never share a segment, also where several slurmd run on one host (the
cluster rehearsals: launch.slurm.rehearse).

A segment is a plain file /dev/shm/<name> whose header names the owner process by pid and start
time (clock ticks since boot, so a reused pid is not mistaken for the owner). A segment whose
owner is gone (a crashed run) is reclaimed: at the next `create` of its name, or by
`reclaim_stale` for every tailspec segment on the node (`python -m spot.buffer.segment --reclaim`, which
a Slurm job runs on each node after its run: launch.slurm.sbatch).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
from pathlib import Path

import numpy as np

SHM = Path("/dev/shm")
_MAGIC = int.from_bytes(b"TSPOTBUF", "little")
_HEADER = np.dtype([
    ("magic", "<u8"), ("version", "<u8"), ("owner_pid", "<i8"), ("owner_start", "<i8"),
    ("capacity", "<i8"), ("feature_size", "<i8"), ("dtype", "<i8"), ("max_entries", "<i8"),
    ("data_offset", "<i8"), ("head", "<i8"), ("tail", "<i8"), ("wp", "<i8"),
])


def node_name() -> str:
    """This process's node: Slurm's name for it inside a job step (SLURMD_NODENAME), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def segment_name(run: str, node: str | None = None) -> str:
    """-> "tailspec-<run>-<node or node_name()>", other characters than [A-Za-z0-9_.-] replaced by '_'."""
    return _safe(f"tailspec-{run}-{node or node_name()}")


def node_segment(name: str, node: str | None = None) -> str:
    """This node's segment of a job's buffer `name` (spot.buffer_name, a pool's --buffer): "<name>-<node>"."""
    return _safe(f"{name}-{node or node_name()}")


def reclaim_stale(prefix: str = "tailspec-") -> list[str]:
    """Unlinks the segments (and leftover temporary ones) whose owner process is dead; -> their names."""
    out = []
    for path in sorted(SHM.glob(f"{prefix}*")) + sorted(SHM.glob(f".{prefix}*")):
        head = _read_header(path)
        if head is not None and not _alive(int(head["owner_pid"]), int(head["owner_start"])):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            out.append(path.name)
    return out


def _start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (tells a reused pid apart); -1 if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return -1
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime field 22
    return -1 if fields[0] in ("Z", "X") else int(fields[19])


def _alive(pid: int, start: int) -> bool:
    return _start_time(pid) == start != -1


def _read_header(path: Path) -> np.ndarray | None:
    """The header of a tailspec segment at path, or None if it is absent or not one."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER.itemsize)
    except FileNotFoundError:
        return None
    if len(raw) < _HEADER.itemsize:
        return None
    head = np.frombuffer(raw, _HEADER)[0]
    return head if int(head["magic"]) == _MAGIC else None


def _reclaim_if_dead(path: Path) -> None:
    """Unlinks a segment left by a dead owner; a live owner or a foreign file -> ValueError."""
    if not path.exists():
        return
    head = _read_header(path)
    if head is None:
        raise ValueError(f"{path} exists and is not a tailspec DataBuffer segment; remove it or use another run name")
    pid = int(head["owner_pid"])
    if _alive(pid, int(head["owner_start"])):
        raise ValueError(f"DataBuffer segment {path} is owned by the live process {pid} (another run with the same "
                         f"name on this node?): stop it, or give this run another name (segment_name(run))")
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spot.buffer.segment", description="this node's DataBuffer segments")
    p.add_argument("--reclaim", action="store_true", help="remove the segments whose owner process is dead")
    p.add_argument("--prefix", default="tailspec-", help="segment names to consider (default: tailspec-)")
    args = p.parse_args(argv)
    if args.reclaim:
        gone = reclaim_stale(args.prefix)
        print(f"{node_name()}: removed {len(gone)} DataBuffer segment(s) of dead owners" + (f": {', '.join(gone)}" if gone else ""),
              flush=True)
        return 0
    live = sorted(p.name for p in SHM.glob(f"{args.prefix}*") if _read_header(p) is not None)
    print(f"{node_name()}: {len(live)} DataBuffer segment(s)" + (f": {', '.join(live)}" if live else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
