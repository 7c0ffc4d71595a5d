"""The skinny kernel's run-time loop parameters (engine/kernels/skinny.cpp, `skinny_set_params`).

Vocabulary: a *panel* is `panel_vectors` vector registers of columns of the packed weight; a
*register block* is `block_rows` rows whose accumulators stay in registers while one panel
streams past; `prefetch` is how many panel rows ahead the kernel asks for (0: none); rows are
split into chunks of `chunk_rows`, and the threads share out (chunk, panel) pairs, so a chunk
at least M rows long splits columns only; a *wide* pass (`skinny_wide_rows()` rows or more:
prefill, long verify passes) uses `wide_block_rows` rows per register block (0: `block_rows`),
since the block that suits a decode step need not suit a compute-bound pass. None of these
changes a result (each output element is one accumulator over k in order), so every set keeps
the bit-for-bit row independence; they only change speed, which is why engine/kernels/tune.py
may pick them per host. `panel_vectors` also fixes the packed layout: it is set once per
process, before any matrix is packed.
"""

from __future__ import annotations

import ctypes
from dataclasses import asdict, dataclass

CHUNK_ALL = 1 << 30  # chunk_rows for "one chunk": threads split the columns only


@dataclass(frozen=True, order=True)
class KernelParams:
    panel_vectors: int = 2
    block_rows: int = 6
    prefetch: int = 32
    chunk_rows: int = CHUNK_ALL
    wide_block_rows: int = 0  # 0: block_rows

    def label(self) -> str:
        chunk = "all" if self.chunk_rows >= CHUNK_ALL else str(self.chunk_rows)
        wide = f" rw={self.wide_block_rows}" if self.wide_block_rows else ""
        return f"nv={self.panel_vectors} r={self.block_rows} pf={self.prefetch} mc={chunk}{wide}"

    def as_dict(self) -> dict:
        return asdict(self)


def defaults(lib: ctypes.CDLL) -> KernelParams:
    """The hand-tuned set of the first development machines: two-vector panels, 8 register rows
    with AVX-512 (32 registers) and 6 with AVX2 (16), 32 panel rows of prefetch, one chunk."""
    return KernelParams(block_rows=8 if lib.skinny_vector_width() == 16 else 6)


def apply(lib: ctypes.CDLL, p: KernelParams) -> None:
    """Makes `p` the kernel's parameters (ValueError if the build cannot run it)."""
    if lib.skinny_set_params(p.panel_vectors, p.block_rows, p.prefetch, p.chunk_rows, p.wide_block_rows) != 0:
        raise ValueError(f"skinny kernel parameters out of range for this build: {p.label()} (block_rows and "
                         f"wide_block_rows <= {lib.skinny_max_rows(p.panel_vectors)} for panel_vectors={p.panel_vectors})")


def from_dict(d: dict) -> KernelParams:
    """The parameters of `as_dict`; a field missing from `d` (a record older than the field) takes its default."""
    fields = KernelParams.__dataclass_fields__
    unknown = set(d) - set(fields)
    if unknown:
        raise ValueError(f"unknown skinny kernel parameters {sorted(unknown)}; known: {sorted(fields)}")
    return KernelParams(**{k: int(d[k]) for k in fields if k in d})
