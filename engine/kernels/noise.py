"""The sampler's uniforms in one compiled pass (engine/kernels/noise.cpp via ctypes)."""

from __future__ import annotations

import torch

from engine.kernels.library import library


def uniform_rows(keys: torch.Tensor, positions: torch.Tensor, vocab: int | torch.Tensor) -> torch.Tensor:
    """keys [N], positions [N] -> [N, V] float32: engine.sampling.uniform, bit for bit (CPU)."""
    keys, positions = keys.contiguous(), positions.expand_as(keys).contiguous()
    ids = None if isinstance(vocab, int) else vocab.contiguous()
    V = vocab if ids is None else ids.numel()
    out = torch.empty(keys.numel(), V, dtype=torch.float32)
    library().uniform_rows(keys.data_ptr(), positions.data_ptr(), ids.data_ptr() if ids is not None else None,
                           keys.numel(), V, out.data_ptr(), torch.get_num_threads())
    return out
