"""Under torchrun: each rank gathers lists of a different length (rank r: r + 1 values), as the
trainer gathers the step's lengths of token shares, and writes what it got to DIR/rank{r}.json (argv[1])."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from pipeline.dist import Ranks, gather_objects

if __name__ == "__main__":
    dist.init_process_group("gloo")
    r = Ranks(rank=dist.get_rank(), world=dist.get_world_size())
    got = gather_objects(r, [float(r.rank) + 0.5] * (r.rank + 1))
    (Path(sys.argv[1]) / f"rank{r.rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()
