"""Per-host tuning of the skinny kernel's loop parameters (engine/kernels/params.py), and the guard.

`search(measure, ...)` is a staged coordinate search over `KernelParams`: first the register
tile (panel width x rows per block) at decode row counts, then the prefetch distance, then, at
prefill row counts (wide passes), the rows per register block and the row chunk together: the
panel width is shared (it fixes the packed layout), the block is not, since a compute-bound pass
of a thousand rows wants another block shape than a decode step. Each stage keeps the candidate
`choose` picks from the measured costs, so the result is a pure function of the measurements
(unit-tested on synthetic cost tables); `measure(params, rows)` -> seconds is injected (`Timer` times the real kernel).
`guard(ratios)` says whether the kernel serves at all: torch / kernel time per row count, over
the row counts it serves. The engine then uses the kernels for the whole model or not at all:
decode and verify passes of any row count must go through the same row-independent product
(a verify pass of b rows x T tokens is b*T rows, up to thousands), so a per-row-count switch
would break the bit-for-bit equality of verification and sequential decoding.

This module does not know about caching or when tuning runs (engine/kernels/tuning_cache.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from engine.kernels.params import CHUNK_ALL, KernelParams, apply

# SmolLM2-135M's products (fused qkv, o, gate-up, down): the engine's reference shapes.
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))
TILE_ROWS = (1, 4, 16, 64)  # decode and small verify passes: memory-bound to compute-bound
PREFETCH_ROWS = (1, 16)
CHUNK_ROWS = (256, 1024)  # wide passes: long verify passes, prefill and teacher-forced passes (>= skinny_wide_rows())
GUARD_ROWS = (1, 4, 16, 64, 256, 1024)
PREFETCH = (0, 16, 32, 64, 128)
CHUNKS = (CHUNK_ALL, 512, 128, 32)

Measure = Callable[[KernelParams, int], float]


def choose(costs: dict[KernelParams, dict[int, float]]) -> KernelParams:
    """The candidate with the least total log slowdown against the best candidate at each row
    count (every row count weighs the same, whatever its absolute time); ties go to the smallest
    candidate in `KernelParams` order. Candidates missing a row count others have are out."""
    rows = set().union(*(set(c) for c in costs.values()))
    full = {p: c for p, c in costs.items() if set(c) == rows}
    if not full:
        raise ValueError("choose: no candidate was measured at every row count")
    best = {m: min(c[m] for c in full.values()) for m in rows}
    score = {p: sum(math.log(c[m] / best[m]) for m in rows) for p, c in full.items()}
    return min(full, key=lambda p: (round(score[p], 9), p))


def tiles(vector_width: int, max_rows: Callable[[int], int]) -> list[KernelParams]:
    """Register tiles worth trying: panels of 1-3 vectors (4 with AVX-512) x rows per block."""
    out = []
    for nv in (1, 2, 3, 4) if vector_width == 16 else (1, 2, 3):
        top = max_rows(nv)
        for r in sorted({r for r in (2, 4, 6, 8, 12, top) if r <= top}):
            out.append(KernelParams(panel_vectors=nv, block_rows=r))
    return out


def search(measure: Measure, start: KernelParams, tile_set: list[KernelParams],
           out_of_time: Callable[[], bool] = lambda: False,
           progress: Callable[[str], None] = lambda s: None, measure_core: Measure | None = None) -> tuple[KernelParams, dict]:
    """Staged search from `start` -> (chosen, {stage: {candidate label: {rows: seconds}}}).
    `measure_core` (default `measure`) times the per-core stages (tile, prefetch): on one thread
    they do not suffer another process taking a core mid-pass, which costs a multi-threaded pass
    a whole time slice at its barrier."""
    log: dict[str, dict] = {}
    measure_core = measure_core or measure

    def stage(name: str, cands: list[KernelParams], rows: tuple[int, ...], current: KernelParams,
              measure: Measure = measure) -> KernelParams:
        cands = [current] + [c for c in dict.fromkeys(cands) if c != current]
        costs: dict[KernelParams, dict[int, float]] = {}
        for i, c in enumerate(cands):
            if i > 0 and out_of_time():
                break
            costs[c] = {m: measure(c, m) for m in rows}
            progress(f"{name} {i + 1}/{len(cands)}")
        log[name] = {c.label(): {str(m): s for m, s in v.items()} for c, v in costs.items()}
        return choose(costs)

    p = start
    tile_cands = [replace(t, prefetch=start.prefetch, chunk_rows=start.chunk_rows) for t in tile_set]
    p = stage("tile", tile_cands, TILE_ROWS, p, measure_core)
    p = stage("prefetch", [replace(p, prefetch=d) for d in PREFETCH], PREFETCH_ROWS, p, measure_core)
    p = stage("wide", wide_candidates(p, tile_set), CHUNK_ROWS, p)
    return p, log


def wide_candidates(p: KernelParams, tile_set: list[KernelParams]) -> list[KernelParams]:
    """`p` with every register block of its panel width in `tile_set` for wide passes, each with
    every row chunk of `CHUNKS` (a whole number of blocks)."""
    rows = sorted({t.block_rows for t in tile_set if t.panel_vectors == p.panel_vectors} | {p.block_rows})
    out = []
    for r in rows:
        for c in CHUNKS:
            out.append(replace(p, wide_block_rows=0 if r == p.block_rows else r,
                               chunk_rows=c if c == CHUNK_ALL else max(r, c // r * r)))
    return out


def guard(ratios: dict[int, float]) -> tuple[bool, list[int]]:
    """(serves, slower row counts) from torch / kernel time per row count: the kernel serves
    when the geometric mean of the ratios is >= 1 (one row count lost by a few per cent is
    noise or a trade; the engine cannot switch per row count, see the module docstring)."""
    if not ratios:
        raise ValueError("guard: no measurements")
    slower = sorted(m for m, r in ratios.items() if r < 1.0)
    mean = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
    return mean >= 1.0, slower


def l3_bytes() -> int:
    """The last-level cache's size (sysfs), 32 MB where it cannot be read."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"), reverse=True):
        try:
            size = (index / "size").read_text().strip()
            return int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]] if size[-1] in "KM" else int(size)
        except (OSError, ValueError):
            continue
    return 32 << 20


class Timer:
    """Times the products of `SHAPES` through the kernel (under given parameters) and through
    torch: at few rows over enough copies of the weights to stream from memory (twice the last
    cache level, as in a real forward), at many rows over one copy (compute-bound); best of
    `repeat` passes."""

    def __init__(self, lib, threads: int, repeat: int = 5) -> None:
        self.lib, self.threads, self.repeat = lib, threads, repeat
        per_copy = sum(k * n for k, n in SHAPES) * 4
        copies = max(1, min(16, -(-2 * l3_bytes() // per_copy)))
        g = torch.Generator().manual_seed(0)
        self.weights = [torch.randn(k, n, generator=g) * 0.02 for _ in range(copies) for k, n in SHAPES]
        self.packed: dict[int, list[torch.Tensor]] = {}
        self.x = {m: {k: torch.randn(m, k, generator=g) for k, _ in SHAPES} for m in set(GUARD_ROWS) | set(TILE_ROWS)}
        self.y = {m: {n: torch.empty(m, n) for _, n in SHAPES} for m in self.x}

    def _mats(self, m: int) -> list[torch.Tensor]:
        return self.weights if m < 64 else self.weights[: len(SHAPES)]

    def _panels(self, p: KernelParams) -> list[torch.Tensor]:
        if p.panel_vectors not in self.packed:
            apply(self.lib, p)
            tn = self.lib.skinny_tile_n()
            out = []
            for w in self.weights:
                K, N = w.shape
                panels = torch.empty(-(-N // tn) * K * tn)
                self.lib.skinny_pack(w.data_ptr(), N, panels.data_ptr(), K, N)
                out.append(panels)
            self.packed[p.panel_vectors] = out
        return self.packed[p.panel_vectors]

    def _best(self, fn, m: int) -> float:
        fn()  # warm: page faults, thread start
        best = math.inf
        for _ in range(self.repeat if m < 256 else 2):  # a pass of 256+ rows is long enough to average
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    def one_core(self, p: KernelParams, m: int) -> float:
        return self.kernel(p, m, 1)

    def kernel(self, p: KernelParams, m: int, threads: int | None = None) -> float:
        panels = self._panels(p)
        apply(self.lib, p)
        mats, x, y, gemm, th = self._mats(m), self.x[m], self.y[m], self.lib.skinny_gemm, threads or self.threads

        def run():
            for w, pw in zip(mats, panels):
                K, N = w.shape
                gemm(x[K].data_ptr(), K, pw.data_ptr(), None, None, N, y[N].data_ptr(), N, m, K, N, th)

        return self._best(run, m)

    def versus(self, p: KernelParams, m: int, rounds: int = 3) -> tuple[float, float]:
        """(kernel s, torch s) at m rows, best over interleaved rounds: a busy spell on a shared
        machine then hits both sides alike instead of one."""
        ours, theirs = math.inf, math.inf
        for _ in range(rounds):
            ours, theirs = min(ours, self.kernel(p, m)), min(theirs, self.torch(m))
        return ours, theirs

    def torch(self, m: int) -> float:
        mats, x, y = self._mats(m), self.x[m], self.y[m]

        def run():
            for w in mats:
                torch.matmul(x[w.shape[0]], w, out=y[w.shape[1]])

        return self._best(run, m)
