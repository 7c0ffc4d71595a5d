"""Spawned worker for tests/test_placement.py: three gloo ranks in a separated placement with one
actor rank (rank 0) and two rollout ranks (1, 2).

Each rank builds the placement; the rollout ranks send rank 0 a dummy shipment each (the real
transport); rank 0 pushes `tensors()` as version 1 in small buckets, then version 1 again while
rank 2 expects version 2 (a stale push for it). Every rank writes <out>/rank{r}.pt with what it saw.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist

from tests.mp.sync_tensors import tensors

BUCKET = 4096


def worker(rank: int, world: int, port: int, out: str) -> None:
    from pipeline.config import PipelineSection
    from pipeline.dist import Ranks, all_sum
    from pipeline.separated.placement import build_placement
    from pipeline.separated.shipment import RolloutShipment, receive_shipments, send_shipments
    from pipeline.separated.weight_sync import push_weights, receive_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        p = build_placement(PipelineSection(placement="separated", actor_ranks=1), Ranks(rank=rank, world=world), 60)
        seen = {"role": p.role, "actors": p.actor_ranks, "rollouts": p.rollout_ranks,
                "group_rank": (p.actors or p.rollouts).rank, "group_world": (p.actors or p.rollouts).world}
        # a sum over this rank's role group only: 1 on the actor side, 1 + 2 on the rollout side
        seen["role_sum"] = all_sum(p.actors or p.rollouts, float(rank))
        if p.role == "rollout":
            ship = RolloutShipment.make_dummy(step=3, source=rank, groups=(2 * rank, 2 * rank + 1))
            send_shipments([ship], p.actor_ranks)
        else:
            seen["shipments"] = receive_shipments(p.rollout_ranks)

        calls = {"broadcast": 0}
        real = dist.broadcast

        def counting(*args, **kw):
            calls["broadcast"] += 1
            return real(*args, **kw)

        dist.broadcast = counting
        got: dict[str, torch.Tensor] = {}

        def load(stream, version):
            got.update((name, t.clone()) for name, t in stream)
            seen["loaded_version"] = version

        if p.role == "actor":
            seen["push"] = push_weights(tensors(), 1, src=p.push_source, group=p.push_group, bucket_bytes=BUCKET)
            seen["stale_push"] = push_weights(tensors(), 1, src=p.push_source, group=p.push_group, bucket_bytes=BUCKET)
        else:
            seen["push"] = receive_weights(load, 1, src=p.push_source, group=p.push_group, bucket_bytes=BUCKET)
            seen["got"] = got
            try:
                receive_weights(load, 1 if rank == 1 else 2, src=p.push_source, group=p.push_group, bucket_bytes=BUCKET)
                seen["stale_error"] = ""
            except ValueError as e:
                seen["stale_error"] = str(e)
        seen["broadcasts"] = calls["broadcast"]
        dist.barrier()
        torch.save(seen, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
