"""`python -m launch.train --config configs/tiny.yaml [section.key=value ...]`: an RL run.

Alone or under `torchrun --nproc-per-node=R -m launch.train ...` (gloo on CPU, NCCL on GPU): each
rank holds its own rollout backend (engine.backend: native or vllm) and a data-parallel replica of
the actor, rolls out its shard of every step's prompts, then trains. The run is built by
launch.run.build.build_run, which also says what the run folder holds and how to resume.
"""

from __future__ import annotations

import argparse
import sys

import torch.distributed as dist

from common.config import load_config, override_args, require_keys
from launch.run.build import run
from launch.run.config import TrainConfig
from pipeline.dist import PeerLost, init_ranks, shutdown


def main(argv: list[str] | None = None) -> int:
    overrides, rest = override_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__.splitlines()[0],
                                     epilog="Any section.key=value argument overrides the config file.")
    parser.add_argument("--config", default="configs/tiny.yaml")
    args = parser.parse_args(rest)
    try:
        cfg = load_config(TrainConfig, args.config, overrides)
        require_keys(cfg, args.config)
        r = init_ranks(cfg.actor.device, cfg.pipeline.timeout_s)
        try:
            run(cfg, r)
        except (PeerLost, dist.DistError) as e:  # a peer died or stopped answering: say so on this rank, then stop
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"error: rank {r.rank} of {r.world}: lost contact with another rank of the job ({detail}); the job "
                  f"stops. To continue from the last checkpoint, run it again with run.dir=<its run folder> "
                  f"trainer.resume=auto", file=sys.stderr)
            return 1
        finally:
            shutdown()
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
