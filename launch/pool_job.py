"""What keeps an elastic spot pool up inside a Slurm job; launch.slurm.sbatch renders both commands.

- `python -m launch.pool_job store --port P`: the pool's c10d rendezvous store, held by the batch
  script on the batch host for the job's life. The agents join it with `is_host=false`. torchrun's
  default lets the first agent host the store, and the store dies with that agent: every other
  agent's rendezvous then fails and the pool is gone for the rest of the job.
- `python -m launch.pool_job agent [--restarts N] [--stop FILE] -- CMD ...`: one node's agent
  (CMD: `torchrun ... -m launch.spot_pool ...`), started again when a signal killed it (the OOM
  killer, a SIGKILL), at most N times, unless FILE (the pool's STOP) exists. torchrun restarts its
  worker after a failure (`--max-restarts`), but nothing restarts a dead agent: without this, a
  node whose agent died trains nothing until the job ends. The restarted agent joins the pool's
  rendezvous like any late member. An agent that exits by itself is not started again: 0 (the
  pool finished) or an error (bad input, its worker's restarts used up) is this command's status.
  SIGTERM and SIGINT are passed to the agent, and an agent stopped that way is not restarted.

This module knows nothing of the pool's training (spot.pool.elastic) or of the job script (launch.slurm.sbatch).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

AGENT_RESTARTS = 10  # per node and job: an agent the OOM killer takes again and again stays down after these


def should_restart(status: int, restarts: int, max_restarts: int, stopping: bool) -> bool:
    """Whether to start an agent again after it ended with `status` (Popen's: -N for signal N),
    having been restarted `restarts` times already; `stopping`: the pool or the job is ending."""
    return status < 0 and not stopping and restarts < max_restarts


def log(msg: str) -> None:
    node = os.environ.get("SLURMD_NODENAME", "this node")
    print(f"[spot-pool agent on {node}] {msg}", file=sys.stderr, flush=True)


def supervise(cmd: list[str], max_restarts: int, stop: Path | None) -> int:
    """Runs the agent `cmd` until it ends by itself (see the module docstring); -> its exit status,
    128 + N for a signal N, as a shell reports it."""
    forwarded: list[int] = []
    agent: subprocess.Popen | None = None

    def forward(signum, frame) -> None:
        forwarded.append(signum)
        if agent is not None and agent.poll() is None:
            agent.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    restarts = 0
    while True:
        agent = subprocess.Popen(cmd)
        status = agent.wait()
        stopping = bool(forwarded) or (stop is not None and stop.exists())
        if not should_restart(status, restarts, max_restarts, stopping):
            return status if status >= 0 else 128 - status
        restarts += 1
        log(f"the agent (pid {agent.pid}) was killed by signal {-status}: starting it again, restart {restarts} of "
            f"{max_restarts}")


def hold_store(port: int) -> int:
    """Hosts a c10d rendezvous store on `port` (every address) until SIGTERM or SIGINT."""
    import torch.distributed as dist

    signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    print(f"[spot-pool store] the pool's rendezvous store listens on port {port} (pid {os.getpid()})", flush=True)
    signal.sigwait(signals)
    del store
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.pool_job", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    store = sub.add_parser("store", help="host the pool's rendezvous store until SIGTERM")
    store.add_argument("--port", type=int, required=True)
    agent = sub.add_parser("agent", help="run a node's pool agent, again when a signal killed it")
    agent.add_argument("--restarts", type=int, default=AGENT_RESTARTS, help=f"at most (default {AGENT_RESTARTS})")
    agent.add_argument("--stop", type=Path, default=None, help="no restart once this file exists (the pool's STOP)")
    agent.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the agent's command line")
    args = p.parse_args(argv)
    if args.what == "store":
        return hold_store(args.port)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("agent: give the agent's command after --")
    if args.restarts < 0:
        p.error(f"agent: --restarts must be >= 0, got {args.restarts}")
    return supervise(cmd, args.restarts, args.stop)


if __name__ == "__main__":
    sys.exit(main())
