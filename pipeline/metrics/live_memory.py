"""Live resident memory per rank, and whether it grows over a run.

`live_rss_bytes()` is what the process holds now (/proc/self/statm's resident pages), not the
high-water mark: a peak (getrusage's ru_maxrss, `memory/peak_rss_gb`) only ever rises, so it
cannot tell a leak from one large step. The loop logs each rank's value every step as
`mem/rss_gb/rank{r}` and their maximum as `mem/rss_gb` (`rss_metrics`), and the dashboard draws them.

`growth_per_step` fits a least-squares line to a rank's values after a warm-up (allocator
arenas, caches, the first checkpoint and eval fill in over the first steps) and returns its
slope: the soak (`make soak`, bench.soak) and its shorter test fail when it passes a threshold.

`heap_free_bytes()` is what glibc's malloc holds free (common.heap): resident memory can exceed
what tensors hold by up to this much. The loop logs it beside the live value as
`mem/heap_free_gb/rank{r}`.

It knows nothing of ranks or collectives: the caller gathers every rank's value.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from common import heap

STATM = Path("/proc/self/statm")
PAGE = os.sysconf("SC_PAGE_SIZE")
RSS_KEY = "mem/rss_gb"
HEAP_FREE_KEY = "mem/heap_free_gb"
MIN_FIT_STEPS = 3  # steps after the warm-up a slope is fitted to


def live_rss_bytes(statm: Path = STATM) -> int:
    """This process's resident memory now, in bytes (statm's second field counts pages)."""
    try:
        return int(statm.read_text().split()[1]) * PAGE
    except FileNotFoundError:
        raise FileNotFoundError(f"{statm} does not exist: live RSS is read from Linux's /proc") from None


def heap_free_bytes() -> float:
    """Bytes glibc's heap holds free (common.heap.free_bytes; part of them resident), nan off glibc."""
    return heap.free_bytes()


def rss_metrics(by_rank: Sequence[float], heap_free: Sequence[float] = ()) -> dict[str, float]:
    """`mem/rss_gb` (the largest rank's: the one nearest to running out) and `mem/rss_gb/rank{r}`,
    from every rank's live RSS in GB, indexed by rank; `mem/heap_free_gb/rank{r}` from `heap_free`
    (GB, by rank) where given."""
    return {RSS_KEY: max(by_rank), **{f"{RSS_KEY}/rank{r}": gb for r, gb in enumerate(by_rank)},
            **{f"{HEAP_FREE_KEY}/rank{r}": gb for r, gb in enumerate(heap_free)}}


def growth_per_step(steps: Sequence[int], values: Sequence[float], warmup: int) -> float:
    """The least-squares slope of values over steps (units of value a step), steps <= warmup left out;
    ValueError when fewer than MIN_FIT_STEPS remain to fit."""
    pairs = [(s, v) for s, v in zip(steps, values, strict=True) if s > warmup]
    if len(pairs) < MIN_FIT_STEPS:
        raise ValueError(f"growth_per_step: {len(pairs)} steps after the warm-up of {warmup}; a slope needs at least "
                         f"{MIN_FIT_STEPS} (run more steps or shorten the warm-up)")
    n = len(pairs)
    mean_s = sum(s for s, _ in pairs) / n
    mean_v = sum(v for _, v in pairs) / n
    var = sum((s - mean_s) ** 2 for s, _ in pairs)
    return sum((s - mean_s) * (v - mean_v) for s, v in pairs) / var
