"""`python -m launch.train --config configs/tiny.yaml [section.key=value ...]`: an RL run.

Alone or under `torchrun --nproc-per-node=R -m launch.train ...` (gloo on CPU, NCCL on GPU): each
rank holds its own rollout backend (engine.backend: native or vllm) and a data-parallel replica of
the actor, rolls out its shard of every step's prompts, then trains. The run is built by
launch.run.build_run, which also says what the run folder holds and how to resume.
"""

from __future__ import annotations

import argparse
import sys

from launch.config import load_config, override_args, require_keys
from launch.run import run
from launch.run_config import TrainConfig
from pipeline.dist import init_ranks, shutdown


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
        finally:
            shutdown()
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
