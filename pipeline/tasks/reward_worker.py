"""A reward worker process: `python -m pipeline.tasks.reward_worker FD PARENT_PID`, started by
pipeline.tasks.reward_pool (never by hand).

The worker reads the parent's `sys.path` and its reward functions (pickled: built-ins by value,
plug-ins by name, loaded here) from the connection on file descriptor FD, answers `("ready",
pid)` (or `("failed", traceback)`), then runs calls `(index, function, args)` one at a time in its
main thread, so that math-verify's signal-based timeouts work here too, answering `(index, True,
result)` or `(index, False, what failed)`, until the connection closes. It dies with its parent
(Linux: PR_SET_PDEATHSIG), ignores SIGINT (Ctrl-C is the parent's to handle), and leaves stdout
and stderr, which are the parent's, to the reward.

It is a fresh interpreter (not a fork of the trainer, whose torch and OpenMP threads make fork
unsafe; not multiprocessing's spawn, whose children import the parent's `__main__`, here the
whole trainer) that imports only what the rewards need.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def describe(exc: BaseException) -> str:
    """`Type: message (at file:line in function)`: the exception and the innermost frame it came from."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _die_with(parent: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent was gone before the signal was armed
        os._exit(1)


def serve(conn: Connection) -> int:
    sys_path, functions = conn.recv()
    sys.path[:] = sys_path
    try:
        functions = pickle.loads(functions)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return 1
    conn.send(("ready", os.getpid()))
    while True:
        try:
            index, fn, args = conn.recv()
        except EOFError:
            return 0
        try:  # pickled here: a result that cannot travel back is the reward's failure, not the worker's
            reply = pickle.dumps((index, True, functions[fn](*args)), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as e:  # SystemExit too: a reward's exit is its failure, the worker goes on
            reply = pickle.dumps((index, False, describe(e)), protocol=pickle.HIGHEST_PROTOCOL)
        conn.send_bytes(reply)


def main(argv: list[str] | None = None) -> int:
    fd, parent = (int(x) for x in (argv if argv is not None else sys.argv[1:]))
    _die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return serve(Connection(fd))


if __name__ == "__main__":
    sys.exit(main())
