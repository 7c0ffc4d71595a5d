"""Weight layout for CPU inference: store Linear weights as contiguous [in, out].

A Linear's weight is [out, in]; `F.linear(x, W)` multiplies by its transpose. With few rows in
x (decode, a verify pass of k tokens), MKL's products are faster when that transpose is the
contiguous operand; over a whole memory-bound forward the gain is small. The parameter keeps
its shape and values (a transposed view of the new storage), so nothing else changes: state
dicts, tying and loading still work. With the compiled kernels (engine.kernels) the hot products
use packed copies instead and this layout is skipped. Applied by the runtimes
(engine.runtime, engine.spec.eagle_runtime) when they pack.
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
