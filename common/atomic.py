"""Atomic writes: a file or a folder appears whole under its final name, or not at all.

One rule for every writer of the project (checkpoints, run configs, rollouts, drafters): write
under a temporary name beside the target, then `os.replace` it into place. A crash mid-write
leaves the previous version (or nothing) and a `*.tmp*` leftover that the next write removes.
A folder is replaced whole: the old one is renamed aside first, so there is never a moment
where neither exists under a name a reader would look for (`path` or `path.old`).

A write that fails for the file system's sake (no space, a quota, an I/O fault, a read-only
mount; also as a Rust writer such as safetensors reports it) removes its temporary and raises
`WriteError`, an OSError with the same errno whose message names the target and the free space
where it was written: the caller decides whether the run stops, this module only makes the error
say where and why.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

# What a full or failing file system reports; any other OSError (a missing input, a permission) passes unchanged.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS})


class WriteError(OSError):
    """Writing `path` failed on its file system; the message names the path and the space left there."""


def free_space(path: str | Path) -> str:
    """'<free> free of <total> on <the nearest existing folder of path>', or why it could not be read."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError as e:
        return f"free space on {where} unknown ({e.strerror})"
    return f"{_size(usage.free)} free of {_size(usage.total)} on {where}"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def write_error(path: str | Path, e: OSError) -> WriteError:
    """A WriteError for `e` raised while writing `path` (kept as it is when already one)."""
    if isinstance(e, WriteError):
        return e
    return WriteError(e.errno, f"writing {path} failed: {e.strerror or e} ({free_space(Path(path).parent)}); "
                               "free space there or write to another file system")


# Writers in Rust (safetensors) raise their own exception type and carry the OS error only in the
# text of std::io::Error: "No space left on device (os error 28)".
RUST_IO_ERROR = re.compile(r"(.*?) \(os error (\d+)\)")


def storage_error(e: BaseException) -> OSError | None:
    """`e` as an OSError when it is a file system's fault (STORAGE_ERRNOS), Rust writers' included; else None."""
    if isinstance(e, OSError):
        return e if e.errno in STORAGE_ERRNOS else None
    if isinstance(e, Exception) and (m := RUST_IO_ERROR.search(str(e))) and int(m[2]) in STORAGE_ERRNOS:
        return OSError(int(m[2]), os.strerror(int(m[2])))
    return None


@contextlib.contextmanager
def _named_storage_errors(path: Path) -> Iterator[None]:
    try:
        yield
    except Exception as e:
        if (os_error := storage_error(e)) is None:
            raise
        raise write_error(path, os_error) from e


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator:
    """`with atomic_file(p) as f: f.write(...)`: p holds all of it or its previous content."""
    path = Path(path)
    with _named_storage_errors(path):
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
    tmp = path.with_name(f".{path.name}.tmp")
    with _named_storage_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
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
    tmp = path.with_name(path.name + ".tmp")
    with _named_storage_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
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
