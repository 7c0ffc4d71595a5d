"""Atomic writes: a file or a folder appears whole under its final name, or not at all.

One rule for every writer of the project (checkpoints, run configs, rollouts, drafters): write
under a temporary name beside the target, then `os.replace` it into place. A crash mid-write
leaves the previous version (or nothing) and a `*.tmp*` leftover that the next write removes.
A folder is replaced whole: the old one is renamed aside first, so there is never a moment
where neither exists under a name a reader would look for (`path` or `path.old`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator:
    """`with atomic_file(p) as f: f.write(...)`: p holds all of it or its previous content."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the mode a plain open() would
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, write) -> None:
    """Calls write(tmp_path) (a writer that wants a path, e.g. safetensors' save_file), then renames."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """`with atomic_folder(out) as tmp: <write files into tmp>`: out is replaced by tmp on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
