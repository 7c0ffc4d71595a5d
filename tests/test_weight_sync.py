"""Weight sync: bucketing (pure) and a 2-process gloo broadcast that delivers bit-identical tensors."""

from __future__ import annotations

import json
import socket

import pytest
import torch.multiprocessing as mp

from common.buckets import buckets_of
from tests.mp.sync_worker import tensors, worker


def test_buckets_hold_one_dtype_and_at_most_the_byte_budget_unless_one_tensor_is_larger():
    named = tensors()
    buckets = list(buckets_of(named, bucket_bytes=2048))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]  # order kept, nothing lost
    for b in buckets:
        assert len({t.dtype for _, t in b}) == 1
        assert len(b) == 1 or sum(t.numel() * t.element_size() for _, t in b) <= 2048
    assert any(len(b) == 1 and b[0][1].numel() * 4 > 2048 for b in buckets)  # embed.weight: 3200 bytes
    assert len(list(buckets_of(named, bucket_bytes=1 << 30))) == 4  # runs: float32, bfloat16, int64, float32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_receiver_gets_bit_identical_tensors_in_fewer_broadcasts_than_tensors(tmp_path):
    bucket = 4096
    mp.start_processes(worker, args=(2, free_port(), str(tmp_path), bucket), nprocs=2, join=True, start_method="spawn")
    src, dst = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    n = len(tensors())
    for r in (src, dst):
        assert r["identical"] and r["names"] == [name for name, _ in tensors()]
        assert r["metrics"]["sync/tensors"] == n and r["metrics"]["timing/sync"] > 0
    buckets = len(list(buckets_of(tensors(), bucket)))
    assert dst["metrics"]["sync/buckets"] == buckets < n
    for r in (src, dst):  # one flat broadcast per bucket, one header per bucket and an end marker
        assert r["calls"] == {"broadcast": buckets, "broadcast_object_list": buckets + 1}
        assert sum(r["calls"].values()) < n
    assert dst["metrics"]["sync/bytes"] == sum(t.numel() * t.element_size() for _, t in tensors())
    assert "unread" in dst["early_stop_error"] and "unread" in src["early_stop_error"]
