"""The spot pool's supervision in a Slurm job (launch.pool_job): an agent killed by a signal is started
again until its restarts are used or the pool stops; one that exits by itself is not; SIGTERM reaches
the agent; the rendezvous store serves clients until SIGTERM. (tests/slurm/test_rehearse_pool.py
kills a real pool agent in a two-node job.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from launch.pool_job import should_restart, supervise
from tests.conftest import REPO
from tests.mp import free_port

# An "agent" that counts its starts in argv[1] and, while it has started fewer than argv[2] times,
# dies of SIGKILL; then it exits with status argv[3].
AGENT = ("import os, pathlib, signal, sys; p = pathlib.Path(sys.argv[1]); n = int(p.read_text()) if p.exists() else 0; "
         "p.write_text(str(n + 1)); n + 1 < int(sys.argv[2]) or sys.exit(int(sys.argv[3])); "
         "os.kill(os.getpid(), signal.SIGKILL)")


def agent(tmp_path: Path, killed: int, status: int = 0) -> list[str]:
    return [sys.executable, "-c", AGENT, str(tmp_path / "starts"), str(killed + 1), str(status)]


def starts(tmp_path: Path) -> int:
    return int((tmp_path / "starts").read_text())


@pytest.mark.parametrize("status, restarts, stopping, again", [
    (-9, 0, False, True), (-15, 3, False, True), (-9, 10, False, False), (-9, 0, True, False),
    (0, 0, False, False), (1, 0, False, False), (3, 0, False, False)])
def test_only_an_agent_a_signal_killed_is_restarted_while_restarts_remain_and_the_pool_runs(status, restarts, stopping,
                                                                                            again):
    assert should_restart(status, restarts, 10, stopping) == again


def test_an_agent_killed_twice_is_started_again_twice_and_its_final_status_is_returned(tmp_path, capsys):
    assert supervise(agent(tmp_path, killed=2, status=3), max_restarts=5, stop=None) == 3
    assert starts(tmp_path) == 3
    assert capsys.readouterr().err.count("was killed by signal 9: starting it again") == 2


def test_an_agent_killed_past_its_restarts_ends_as_a_shell_reports_a_sigkill(tmp_path):
    assert supervise(agent(tmp_path, killed=5), max_restarts=1, stop=None) == 128 + signal.SIGKILL
    assert starts(tmp_path) == 2


def test_an_agent_killed_after_the_pool_stopped_is_not_started_again(tmp_path):
    (tmp_path / "STOP").touch()
    assert supervise(agent(tmp_path, killed=1), max_restarts=5, stop=tmp_path / "STOP") == 128 + signal.SIGKILL
    assert starts(tmp_path) == 1


def wait_for(check, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_sigterm_reaches_the_agent_which_is_then_not_started_again(tmp_path):
    sleeper = f"import pathlib, time; pathlib.Path({str(tmp_path / 'up')!r}).touch(); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-m", "launch.pool_job", "agent", "--", sys.executable, "-c", sleeper],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE, text=True)
    try:
        wait_for((tmp_path / "up").exists, "the agent to start")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert "starting it again" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_store_serves_rendezvous_clients_until_sigterm(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "launch.pool_job", "store", "--port", str(port)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    try:
        assert f"listens on port {port}" in proc.stdout.readline()
        a = dist.TCPStore("127.0.0.1", port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=30))
        b = dist.TCPStore("127.0.0.1", port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=30))
        a.set("round", "2")
        assert b.get("round") == b"2"
        del a, b
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
