"""Where reward calls run: a pool of worker processes with a deadline per call, or this process.

A *call* is one reward evaluation, `functions[fn](prompt, response, answer, extra)`; its
*outcome* is the value the function returned, the exception it raised (as text), or a timeout.
Both runners take a batch of calls and return their outcomes in order; neither retries a call,
so a reward is computed at most once per call, and neither reads the values (pipeline.tasks.
reward_scoring turns outcomes into scores and counts the failures).

`RewardPool`: `workers` processes (pipeline.tasks.reward_worker, each a fresh interpreter) hold
the pickled functions; each idle worker is sent the next call, and a call whose answer has not
come `timeout_s` after it was sent is abandoned: its worker is killed and a new one started. A
worker that dies (a crash, the OOM killer, a kill from outside) is replaced the same way: a
call it was running fails (it may have started, so it is not run again), a call not yet sent
waits for a live worker. So a pool whose workers all died is a pool of new workers at the next
call. A worker that cannot start (its reward does not load there) is an error, never retried.
Workers start at construction, and construction waits until they are ready, so a reward that
loads in the trainer but not in a worker fails before any rollout. `close()` kills them all.
Not thread-safe: one caller, the rank's main thread (Linux kills a worker when the thread that
started it ends: PR_SET_PDEATHSIG, so that no worker outlives a killed trainer).

`InProcessRunner`: the calls in this process, one after another, with no deadline (a call that
hangs, hangs the run); an exception is an outcome, as in the pool.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from pipeline.tasks.reward_worker import describe

Call = tuple[str, str, str, dict]  # (prompt, response, answer, extra): the reward's arguments
_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the `pipeline` package, for the workers' import


@dataclass(frozen=True)
class Outcome:
    value: Any = None  # what the reward returned (when neither field below is set)
    error: str | None = None  # what it raised, `Type: message (at file:line in function)`
    timed_out: bool = False

    @property
    def failed(self) -> bool:
        return self.timed_out or self.error is not None


class InProcessRunner:
    """The calls in this process, in order, without deadlines."""

    def __init__(self, functions: Sequence) -> None:
        self.functions = list(functions)

    def run(self, fn: int, calls: Sequence[Call]) -> list[Outcome]:
        outcomes = []
        for args in calls:
            try:
                outcomes.append(Outcome(value=self.functions[fn](*args)))
            except Exception as e:
                outcomes.append(Outcome(error=describe(e)))
        return outcomes

    def close(self) -> None:
        pass


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    started: float  # time.monotonic() at its start
    ready: bool = False
    call: int | None = None  # the call it is running
    deadline: float = float("inf")  # when that call is abandoned


class RewardPool:
    """`workers` reward worker processes holding `functions`; a call runs at most `timeout_s` seconds;
    a worker has `start_timeout_s` to load the rewards (math-verify's import, a plug-in's)."""

    def __init__(self, functions: Sequence, workers: int, timeout_s: float, start_timeout_s: float = 120.0) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"a reward pool needs workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.workers, self.timeout_s, self.start_timeout_s = workers, timeout_s, start_timeout_s
        names = ", ".join(sorted({f.name for f in functions}))
        try:
            self._blob = pickle.dumps(list(functions), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise ValueError(f"the reward ({names}) cannot be sent to reward worker processes ({type(e).__name__}: {e}): "
                             "define it at module level, or set task.reward_workers=0 to run it in this process") from e
        self._pool: list[_Worker] = []
        try:
            self._pool = [self._start() for _ in range(workers)]
            while not all(w.ready for w in self._pool):
                self._wait({})
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._pool]

    def run(self, fn: int, calls: Sequence[Call]) -> list[Outcome]:
        """The outcome of every call, in order (`fn`: which of the functions)."""
        outcomes: dict[int, Outcome] = {}
        todo = deque(range(len(calls)))
        for w in list(self._pool):  # died while idle: replaced before it is given a call
            if w.ready and w.proc.poll() is not None:
                self._replace(w)
        while todo or any(w.call is not None for w in self._pool):
            for w in list(self._pool):
                if todo and w.ready and w.call is None:
                    self._send(w, todo, fn, calls)
            self._wait(outcomes)
        return [outcomes[i] for i in range(len(calls))]

    def close(self) -> None:
        """Kills every worker and reaps it (idempotent)."""
        for w in self._pool:
            _reap(w)
        self._pool = []

    def _start(self) -> _Worker:
        parent, child = Pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.tasks.reward_worker", str(child.fileno()), str(os.getpid())],
                                pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        child.close()
        parent.send((list(sys.path), self._blob))
        return _Worker(proc=proc, conn=parent, started=time.monotonic())

    def _replace(self, w: _Worker) -> None:
        _reap(w)
        self._pool[self._pool.index(w)] = self._start()

    def _send(self, w: _Worker, todo: deque, fn: int, calls: Sequence[Call]) -> None:
        i = todo.popleft()
        try:
            w.conn.send((i, fn, calls[i]))
        except OSError:  # it died while idle: the call never reached it
            todo.appendleft(i)
            self._replace(w)
            return
        w.call, w.deadline = i, time.monotonic() + self.timeout_s

    def _wait(self, outcomes: dict[int, Outcome]) -> None:
        """Until an answer, a death, a deadline or a start comes; records the calls it settles."""
        waiting = [w for w in self._pool if w.call is not None or not w.ready]
        until = min([w.deadline for w in waiting if w.ready] + [w.started + self.start_timeout_s for w in waiting if not w.ready])
        by_conn = {w.conn: w for w in waiting}
        for conn in wait(list(by_conn), timeout=max(0.0, until - time.monotonic())):
            w = by_conn[conn]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                self._lost(w, outcomes)
                continue
            if w.ready:
                i, ok, payload = message
                outcomes[i] = Outcome(value=payload) if ok else Outcome(error=payload)
                w.call, w.deadline = None, float("inf")
            elif message[0] == "ready":
                w.ready = True
            else:
                raise ValueError(f"a reward worker could not load the reward:\n{message[1]}")
        now = time.monotonic()
        for w in waiting:
            if w.ready and w.call is not None and w.deadline <= now:
                outcomes[w.call] = Outcome(timed_out=True)
                self._replace(w)
            elif not w.ready and w.started + self.start_timeout_s <= now:
                raise RuntimeError(f"a reward worker (pid {w.proc.pid}) was not ready {self.start_timeout_s:.0f} s after its "
                                   "start: the reward's imports take too long, or the machine is overloaded")

    def _lost(self, w: _Worker, outcomes: dict[int, Outcome]) -> None:
        """`w` died: its call (if any) failed; a worker that died starting is an error."""
        code = _reap(w)
        if not w.ready:
            raise RuntimeError(f"a reward worker died while loading the reward (exit code {code}); its error is above, "
                               "on this process's stderr")
        if w.call is not None:
            outcomes[w.call] = Outcome(error=f"the reward worker died (exit code {code}) while running it")
            w.call = None
        self._pool[self._pool.index(w)] = self._start()


def _reap(w: _Worker) -> int:
    """Closes `w`'s connection, kills it if it is alive, waits for it; its exit code."""
    w.conn.close()
    if w.proc.poll() is None:
        w.proc.kill()
    return w.proc.wait()
