"""The weight push of a separated placement: the actor's tensors broadcast to the rollout ranks in
flat buckets, as a stream, under a version number.

Vocabulary: the *source* is actor rank 0; the *push group* is the source and the rollout ranks
(pipeline.placement); a *push* is one version of the policy: a header carrying the version,
then the bucket stream, then an end marker.

The source packs consecutive tensors of one dtype into a flat bucket of up to `bucket_bytes` (a
tensor larger than that is a bucket of its own) and broadcasts it over the push group (gloo on
CPU; with `cpu:gloo,cuda:nccl`, CUDA tensors over NCCL), after a small header naming the
bucket's tensors and shapes; an empty header ends the stream. A model of N tensors costs about
2 * bytes / bucket_bytes collectives instead of N, and no rank needs the list of names in
advance. Receivers iterate the stream as buckets arrive (an engine's `load_weights` consumes it
directly), so under ZeRO-3 the source never holds more than a layer and a bucket at once.
Received tensors are views into their bucket.

Versions: a rollout rank states the version it expects (the RL step whose policy its next
rollouts must use) and refuses a push of any other, so it can never serve a stale policy.
Every rank of the push group consumes a stream to its end before raising, so a refused or
short-read push leaves no collective unmatched. This module knows nothing about models or
engines: names and tensors in, names and tensors out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from common.buckets import buckets_of

# Large enough that the headers cost little next to the buckets over gloo; NCCL wants larger ones.
BUCKET_BYTES = 16 << 20

Named = Iterable[tuple[str, torch.Tensor]]


def _device(group) -> torch.device:
    """Where the flat buckets live: CUDA when the group's backend carries CUDA tensors over NCCL."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class BucketedBroadcast:
    """`for name, tensor in BucketedBroadcast(named or None, src=0, group=g)`: the same stream on every rank.

    `named` is the source's (name, tensor) iterable and None elsewhere; `src` is the source's
    global rank. Counts what it sent in `tensors`, `buckets` and `bytes` (the flat buckets'
    collectives, headers apart).
    """

    def __init__(self, named: Named | None, *, src: int, group=None, bucket_bytes: int = BUCKET_BYTES):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        is_src = dist.get_rank() == src
        if is_src != (named is not None):
            raise ValueError(f"rank {dist.get_rank()}: pass the tensors on the source rank {src} and None elsewhere")
        self.named, self.src, self.group, self.bucket_bytes = named, src, group, bucket_bytes
        self.tensors = self.buckets = self.bytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._send() if self.named is not None else self._receive()

    def _header(self, header: list | None) -> list | None:
        box = [header]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def _count(self, flat: torch.Tensor, n: int) -> None:
        self.tensors += n
        self.buckets += 1
        self.bytes += flat.numel() * flat.element_size()

    def _send(self) -> Iterator[tuple[str, torch.Tensor]]:
        device = _device(self.group)
        for bucket in buckets_of(self.named, self.bucket_bytes):
            self._header([(name, tuple(t.shape), t.dtype) for name, t in bucket])
            flat = torch.cat([t.detach().reshape(-1).to(device) for _, t in bucket])  # [sum numel]
            dist.broadcast(flat, src=self.src, group=self.group)
            self._count(flat, len(bucket))
            yield from bucket
        self._header(None)

    def _receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        device = _device(self.group)
        while (header := self._header(None)) is not None:
            sizes = [torch.Size(shape).numel() for _, shape, _ in header]
            flat = torch.empty(sum(sizes), dtype=header[0][2], device=device)  # [sum numel]
            dist.broadcast(flat, src=self.src, group=self.group)
            self._count(flat, len(header))
            for (name, shape, _), part in zip(header, flat.split(sizes)):
                yield name, part.view(shape)


def _metrics(stream: BucketedBroadcast, seconds: float) -> dict[str, float]:
    return {"timing/sync": seconds, "sync/tensors": float(stream.tensors), "sync/buckets": float(stream.buckets),
            "sync/bytes": float(stream.bytes)}


def push_weights(named: Named, version: int, *, src: int, group, bucket_bytes: int = BUCKET_BYTES) -> dict[str, float]:
    """On the source: broadcasts `version`, then every tensor of `named`; returns timing/sync and sync/*."""
    t0 = time.perf_counter()
    dist.broadcast_object_list([version], src=src, group=group)
    stream = BucketedBroadcast(named, src=src, group=group, bucket_bytes=bucket_bytes)
    for _ in stream:
        pass
    return _metrics(stream, time.perf_counter() - t0)


def receive_weights(load: Callable[[Iterator[tuple[str, torch.Tensor]], int], None], expected_version: int, *, src: int,
                    group, bucket_bytes: int = BUCKET_BYTES) -> dict[str, float]:
    """On a receiver: waits for a push, refuses one whose version is not `expected_version`, else
    `load(stream, version)` (e.g. an engine's load_weights). Returns `sync/wait_s` (until the
    push began: the source's work before it), timing/sync (the push itself) and sync/*.

    Raises ValueError on a version other than expected (a stale or future policy) and when load
    leaves tensors unread, each after draining the stream so the other ranks are not left waiting.
    """
    t0 = time.perf_counter()
    box = [None]
    dist.broadcast_object_list(box, src=src, group=group)
    version = int(box[0])
    t1 = time.perf_counter()
    stream = BucketedBroadcast(None, src=src, group=group, bucket_bytes=bucket_bytes)
    it = iter(stream)
    if version != expected_version:
        sum(1 for _ in it)
        raise ValueError(f"weight push: rank {dist.get_rank()} expects policy version {expected_version} for its next "
                         f"rollouts but was sent version {version}; it refuses to serve another policy (the actor and "
                         "rollout ranks disagree on the step: are trainer.async_steps and trainer.resume the same on all?)")
    load(it, version)
    unread = sum(1 for _ in it)
    if unread:
        raise ValueError(f"weight push: load() returned with {unread} of {stream.tensors} tensors unread")
    return {"sync/wait_s": t1 - t0} | _metrics(stream, time.perf_counter() - t1)
