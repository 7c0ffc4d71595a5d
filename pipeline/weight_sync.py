"""Weight sync: the actor's tensors broadcast to rollout ranks in flat buckets, as a stream.

The source rank packs consecutive tensors of one dtype into a flat bucket of up to
`bucket_bytes` (a tensor larger than that is a bucket of its own) and broadcasts it over a
torch.distributed group (gloo on CPU, NCCL on GPU), after a small header naming the bucket's
tensors and shapes; an empty header ends the stream. So a model of N tensors costs about
2 * bytes / bucket_bytes collectives instead of N, and no rank needs the list of names in
advance. Every rank, the source included, iterates the same `(name, tensor)` stream, so an
engine's `load_weights` consumes it as buckets arrive and, under ZeRO-3, the source never holds
more than a layer and a bucket at once. Received tensors are views into their bucket.

Every rank of the group must consume the stream to the end: a collective left unmatched would
hang the others. `sync_weights` does that around a loader and times it (`timing/sync`). This
module knows nothing about models or engines: names and tensors in, names and tensors out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from common.buckets import buckets_of

# Measured 2026-12-01, gloo on 2 CPU ranks, 538 MB (SmolLM2 shapes): 0.35 GB/s one tensor per call,
# 0.48 / 0.66 / 0.38 GB/s in 4 / 16 / 64 MiB buckets. NCCL wants larger buckets: pass bucket_bytes.
BUCKET_BYTES = 16 << 20


def _device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class BucketedBroadcast:
    """`for name, tensor in BucketedBroadcast(named or None, src=0, group=g)`: the same stream on every rank.

    `named` is the source's (name, tensor) iterable and None elsewhere. Counts what it sent in
    `tensors`, `buckets` and `bytes` (the flat buckets' collectives, headers apart).
    """

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]] | None, *, src: int, group=None,
                 bucket_bytes: int = BUCKET_BYTES):
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
            self._header([(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket])
            flat = torch.cat([t.detach().reshape(-1).to(device) for _, t in bucket])  # [sum numel]
            dist.broadcast(flat, src=self.src, group=self.group)
            self._count(flat, len(bucket))
            yield from bucket
        self._header(None)

    def _receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        device = _device(self.group)
        while (header := self._header(None)) is not None:
            sizes = [torch.Size(shape).numel() for _, shape, _ in header]
            flat = torch.empty(sum(sizes), dtype=getattr(torch, header[0][2]), device=device)
            dist.broadcast(flat, src=self.src, group=self.group)
            self._count(flat, len(header))
            for (name, shape, _), part in zip(header, flat.split(sizes)):
                yield name, part.view(shape)


def sync_weights(named: Iterable[tuple[str, torch.Tensor]] | None, load: Callable[[Iterator], None], *, src: int,
                 group=None, bucket_bytes: int = BUCKET_BYTES) -> dict[str, float]:
    """load(stream) on every rank (e.g. an engine's load_weights); returns timing/sync and sync/* metrics.

    Raises ValueError if load leaves tensors of the stream unread (after draining it, so that the
    other ranks are not left waiting).
    """
    t0 = time.perf_counter()
    stream = BucketedBroadcast(named, src=src, group=group, bucket_bytes=bucket_bytes)
    it = iter(stream)
    load(it)
    unread = sum(1 for _ in it)
    if unread:
        raise ValueError(f"weight sync: load() returned with {unread} of {stream.tensors} tensors unread")
    return {"timing/sync": time.perf_counter() - t0, "sync/tensors": stream.tensors, "sync/buckets": stream.buckets,
            "sync/bytes": stream.bytes}
