"""The accelerator's memory per rank: `memory/cuda_max_allocated_gb` (the largest rank's) and
`memory/cuda_max_allocated_gb/rank{r}`, from torch.cuda.max_memory_allocated (the peak of tensors
torch's caching allocator handed out since the process started; what a ZeRO stage, a micro-batch
size or the engine's KV slots change). The host's memory per rank is the trainer's
`memory/peak_rss_gb/rank{r}`. On a machine without CUDA there is nothing to log.

Collective: every rank of `ranks` calls it at the same point (they all have CUDA or none does).
"""

from __future__ import annotations

import torch

from pipeline.dist import Ranks, gather_floats

KEY = "memory/cuda_max_allocated_gb"


def cuda_memory_metrics(ranks: Ranks) -> dict[str, float]:
    if not torch.cuda.is_available():
        return {}
    peaks = [row[0] for row in gather_floats(ranks, [torch.cuda.max_memory_allocated() / 1e9])]
    return {KEY: max(peaks), **{f"{KEY}/rank{rank}": gb for rank, gb in enumerate(peaks)}}
