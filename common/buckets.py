"""Weight streams cut into buckets: the vLLM backend's pushes (engine.backends.vllm_engine's
safetensors files, one file per bucket) and the separated placement's weight push
(pipeline.separated.weight_sync, one broadcast per bucket), instead of one call per tensor."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def buckets_of(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors grouped into lists of one dtype and at most bucket_bytes (or one tensor)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and (t.dtype != bucket[0][1].dtype or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
