"""`torchrun --nnodes=MIN:MAX --nproc-per-node=1 --rdzv-backend=c10d ... -m launch.spot_pool`: the elastic spot pool.

One worker per member (a node with an idle GPU, or a local agent on CPU); spot.pool.elastic says what a
member does. Exit codes tell torchelastic what happened: 0 the pool finished (`--micro-steps`
reached or `<out>/STOP` written), 3 it stopped for a membership change after checkpointing (a
SIGTERM on any member), 1 a member vanished (state checkpointed by a survivor) or bad input.
Run alone (`python -m launch.spot_pool ...`) it is a pool of one. docs/SPOT_POOL.md has the commands.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import MISSING, fields

from common.config import from_dict
from pipeline.dist import init_ranks, shutdown
from spot.pool.elastic import MemberLost, PoolConfig, run_pool

PREEMPTED_EXIT = 3


class PreemptFlag:
    """Set by SIGTERM (torchelastic stopping the workers, or a spot instance's notice); read between micro-steps."""

    def __init__(self) -> None:
        self.set = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.set = True

    def __call__(self) -> bool:
        return self.set


def parse(argv: list[str] | None) -> tuple[PoolConfig, float]:
    p = argparse.ArgumentParser(prog="python -m launch.spot_pool", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="target model folder")
    p.add_argument("--drafter", required=True, help="warm-start drafter folder (EagleModel.save layout)")
    p.add_argument("--buffer", required=True, help="the job's DataBuffer name (the run's spot.buffer_name); this node's segment is <name>-<node>")
    p.add_argument("--out", required=True, help="checkpoints/, published/ and STOP go here (shared by all members)")
    for f in fields(PoolConfig):  # every key with a default is a flag: PoolConfig is the one declaration
        if f.default is MISSING:
            continue  # the four required above
        value = f.default
        kind = float if isinstance(value, float) else str if isinstance(value, str) else int
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=value, help=f"default {value}")
    p.add_argument("--pg-timeout", type=float, default=300.0,
                   help="seconds a collective may wait for a member before the pool restarts without it")
    args = vars(p.parse_args(argv))
    pg_timeout = args.pop("pg_timeout")
    return from_dict(PoolConfig, args), pg_timeout


def warn_shared_store() -> None:
    """torch's shared rendezvous TCPStore breaks re-rendezvous: a member joining later waits forever
    for MASTER_ADDR (pytorch/pytorch#135712). The agents must run with it off."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        print("warning: torchrun shares its rendezvous store with the workers: a member that joins later will hang "
              "in the rendezvous; launch the agents with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/SPOT_POOL.md)",
              file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    warn_shared_store()
    preempted = PreemptFlag()
    try:
        cfg, pg_timeout = parse(argv)
        r = init_ranks(cfg.device, timeout_s=pg_timeout)
        if cfg.device.startswith("cuda"):
            cfg.device = f"cuda:{r.local_rank}"
        try:
            result = run_pool(cfg, r, preempted)
        except MemberLost as e:
            print(f"[spot-pool {r.rank}/{r.world}] {e}", file=sys.stderr, flush=True)
            os._exit(1)  # the process group is broken: tearing it down could wait on the vanished member
        shutdown()
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0 if result.outcome == "finished" else PREEMPTED_EXIT


if __name__ == "__main__":
    sys.exit(main())
