"""A small decoder's worth of named tensors for the weight push tests."""

from __future__ import annotations

import torch


def tensors() -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes, a 0-dim and a non-contiguous tensor, one over the tests' 4 KiB bucket."""
    g = torch.Generator().manual_seed(0)
    out = [("embed.weight", torch.randn(50, 16, generator=g))]
    for i in range(4):
        out += [(f"layers.{i}.norm.weight", torch.randn(16, generator=g)),
                (f"layers.{i}.q.weight", torch.randn(16, 16, generator=g)),
                (f"layers.{i}.up.weight", torch.randn(16, 24, generator=g).t()),
                (f"layers.{i}.down.weight", torch.randn(16, 24, generator=g)),
                (f"layers.{i}.scale", torch.tensor(0.5 + i))]
    out += [("adapter.weight", torch.randn(24, 16, generator=g).to(torch.bfloat16)),
            ("adapter.bias", torch.randn(24, generator=g).to(torch.bfloat16)),
            ("step", torch.tensor([7, 8, 9], dtype=torch.int64)),
            ("lm_head.weight", torch.randn(50, 16, generator=g))]
    return out
