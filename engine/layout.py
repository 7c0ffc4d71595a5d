"""Weight layout for CPU inference: store Linear weights as contiguous [in, out].

A Linear's weight is [out, in]; `F.linear(x, W)` multiplies by its transpose. With few rows in
x (decode, a verify pass of k tokens), MKL is up to 2x faster per product when that transpose is
the contiguous operand (one SmolLM2 layer's products at 8 rows: 1.42 vs 0.74 ms, in cache).
Over a whole memory-bound forward the gain was 0-8% (docs/BENCHMARKS.md). The parameter keeps
its shape and values (a transposed view of the new storage), so nothing else changes: state
dicts, tying and loading still work. With the compiled kernels (engine.kernels) the hot products
use packed copies instead and this layout is skipped. Applied once, by the engine, through
`prepare_for_inference`.
"""

from __future__ import annotations

import torch
from torch import nn


def transpose_storage(module: nn.Module) -> nn.Module:
    """Re-lays out every Linear weight of `module` (and tied embeddings) as contiguous [in, out]."""
    seen: set[int] = set()
    for m in module.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            w = m.weight
            if w.dim() == 2 and w.is_contiguous():  # packed layer weights are views already laid out
                with torch.no_grad():
                    w.data = w.data.t().contiguous().t()
    return module


def prepare_for_inference(module: nn.Module) -> nn.Module:
    """The engine's one call after loading: decoder layers and LM heads packed (engine.packed);
    on a CPU without the compiled kernels every other Linear is stored [in, out] instead (with
    them, the embedding keeps its row layout: a decode step's lookup stays one contiguous row)."""
    from engine.packed import pack_model, use_kernel

    w = next(module.parameters())
    if w.device.type == "cpu" and not use_kernel(w):
        transpose_storage(module)  # with the kernels, the hot products have packed copies instead
    return pack_model(module)  # after: the packed views see the final storage
