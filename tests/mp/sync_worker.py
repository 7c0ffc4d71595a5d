"""Spawned worker for tests/test_weight_sync.py: rank 0 broadcasts `tensors()`, every rank records what it got."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def tensors() -> list[tuple[str, torch.Tensor]]:
    """A small decoder's worth: mixed dtypes, a 0-dim and a non-contiguous tensor, one over the test's bucket."""
    g = torch.Generator().manual_seed(0)
    out = [("embed.weight", torch.randn(50, 16, generator=g))]
    for i in range(4):
        out += [(f"layers.{i}.norm.weight", torch.randn(16, generator=g)),
                (f"layers.{i}.q.weight", torch.randn(16, 16, generator=g)),
                (f"layers.{i}.up.weight", torch.randn(16, 24, generator=g).t()),
                (f"layers.{i}.down.weight", torch.randn(16, 24, generator=g)),
                (f"layers.{i}.scale", torch.tensor(0.5 + i))]
    out += [("adapter.weight", torch.randn(24, 16, generator=g).to(torch.bfloat16)),
            ("adapter.bias", torch.randn(24, generator=g).to(torch.bfloat16)),
            ("step", torch.tensor([7, 8, 9], dtype=torch.int64)),
            ("lm_head.weight", torch.randn(50, 16, generator=g))]
    return out


def worker(rank: int, world: int, port: int, out: str, bucket_bytes: int) -> None:
    from pipeline.weight_sync import sync_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    calls = {"broadcast": 0, "broadcast_object_list": 0}

    def counting(name):
        real = getattr(dist, name)

        def call(*args, **kw):
            calls[name] += 1
            return real(*args, **kw)

        return call

    for name in calls:
        setattr(dist, name, counting(name))
    got: dict[str, torch.Tensor] = {}
    metrics = sync_weights(tensors() if rank == 0 else None, lambda stream: got.update(stream), src=0,
                           bucket_bytes=bucket_bytes)
    expected = dict(tensors())
    report = {
        "names": list(got),
        "identical": all(got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v)
                         for k, v in expected.items()),
        "calls": dict(calls),
        "metrics": metrics,
    }
    try:
        sync_weights(tensors() if rank == 0 else None, lambda stream: next(iter(stream)), src=0, bucket_bytes=bucket_bytes)
        report["early_stop_error"] = ""
    except ValueError as e:
        report["early_stop_error"] = str(e)
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()
