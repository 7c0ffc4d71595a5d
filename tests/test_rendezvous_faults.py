"""A job's rendezvous fails with a clear error instead of a hang: a node that never arrives ends the
first node's agent after cluster.rdzv_timeout_s (the sbatch script's own torchrun line, run here
without srun), and a rendezvous port another process holds fails the in-job preflight."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from common.config import load_config
from launch.slurm.preflight import job_checks
from launch.run.config import TrainConfig
from launch.slurm.submit import render

REPO = Path(__file__).resolve().parent.parent


def test_a_taken_rendezvous_port_fails_the_in_job_preflight_and_names_the_key(monkeypatch):
    monkeypatch.setenv("SLURM_NODEID", "0")
    cfg = load_config(TrainConfig, REPO / "configs/tiny.yaml", [])
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        check = next(c for c in job_checks(cfg, rdzv_port=port) if c.name == "rendezvous port")
        assert check.failed and "taken" in check.detail and "cluster.rdzv_port" in check.fix
    check = next(c for c in job_checks(cfg, rdzv_port=port) if c.name == "rendezvous port")
    assert not check.failed
    monkeypatch.setenv("SLURM_NODEID", "1")  # only the first node listens: the others do not check
    assert not [c for c in job_checks(cfg, rdzv_port=port) if c.name == "rendezvous port"]


def test_a_node_that_never_arrives_fails_the_job_after_the_rendezvous_timeout(tmp_path):
    timeout_s = 8
    cfg = load_config(TrainConfig, REPO / "configs/tiny.yaml", ["cluster.nodes=2", f"cluster.rdzv_timeout_s={timeout_s}"])
    script = render(cfg, "configs/tiny.yaml", ["cluster.nodes=2"])
    # The script's torchrun launch, as written, from its `srun ... -m torch.distributed.run` to its `&`;
    # only srun (one task per node: here one agent, the node that arrived) and the background `&` go.
    start = script.index('"$PY" -m torch.distributed.run')
    launch = script[start:script.index(" &\n", start)]
    assert f"--rdzv-conf=join_timeout={timeout_s}" in launch
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"PY": sys.executable, "SLURM_JOB_NUM_NODES": "2", "HEAD_ADDR": "127.0.0.1", "PORT": str(port),
           "SLURM_JOB_ID": "7", "RUN_DIR": str(tmp_path / "run"), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "-c", launch], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout_s + 90)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert "RendezvousTimeoutError" in proc.stdout + proc.stderr
    assert timeout_s <= took < timeout_s + 60, took
    assert re.search(r"--nnodes=\"\$SLURM_JOB_NUM_NODES\"", launch)


def test_a_port_whose_last_connection_is_in_time_wait_is_free_for_a_requeued_job():
    from launch.slurm.preflight import port_free

    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server side closes first: its end of the connection waits in TIME_WAIT
        client.close()
    assert port_free(port)
