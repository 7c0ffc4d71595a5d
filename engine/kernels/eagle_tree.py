"""A whole EAGLE tree draft (coupled children) in one compiled call (`eagle_tree_draft` in
engine/kernels/eagle_chain.cpp, via ctypes).

`draft` runs the catch-up, the D levels of top-k expansion (the coupled sample first, then the
best alternatives, scored with the coupled prior) and the selection of the `budget` best nodes
for b rows: the same function as EagleDrafter's `_catch_up` + `_expand` + `_select`, without a
few hundred dispatched torch ops per draft. It serves plain sampling (no top-k / top-p) and
greedy, coupled children only; the drafter uses the Python path otherwise.
"""

from __future__ import annotations

import torch

from engine.kernels import eagle_chain
from engine.kernels.library import library


def pool_size(depth: int, topk: int) -> int:
    """Nodes a tree of `depth` levels creates per row: K at the first level, K * K below."""
    return topk + (depth - 1) * topk * topk


def supported(rt, topk: int) -> bool:
    """Whether `rt` (an EagleRuntime) can draft trees of top-k `topk` through the kernel."""
    return topk > 1 and eagle_chain.supported(rt) and topk <= rt.head.skinny.N


def draft(rt, pend_tok: torch.Tensor, pend_feat: torch.Tensor, n_pend: torch.Tensor, depth: int, topk: int,
          budget: int, log_prior: float, noise: torch.Tensor | None, temperature: float, cos: torch.Tensor,
          sin_signed: torch.Tensor, cache, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Catch-up and tree in one call. Inputs as `eagle_chain.draft` (cos / sin_signed [P, hd]: RoPE
    tables by position, level d's nodes at position lengths + n_pend + d; noise
    [b, D, Vd] the coupled noise of level d at d - 1, or None: greedy); the caller advances the
    cache's lengths by n_pend -> (tokens [b, n], parents [b, n]) with n = min(budget, pool_size),
    each row's kept nodes in creation order (a parent first), parent -1 = the root."""
    pend_tok, n_pend, noise, cos, sin_signed, lengths = eagle_chain.prepare(pend_tok, pend_feat, n_pend, noise, cos,
                                                                           sin_signed, lengths)
    b, T = pend_tok.shape
    n = min(budget, pool_size(depth, topk))
    tokens = torch.empty(b, n, dtype=torch.long)
    parents = torch.empty(b, n, dtype=torch.long)
    library().eagle_tree_draft(
        b, T, depth, topk, budget, *eagle_chain.sizes(rt, pend_feat.shape[-1]),
        *eagle_chain.pending(rt, pend_tok, pend_feat, n_pend, noise), float(temperature), float(log_prior),
        cos.data_ptr(), sin_signed.data_ptr(), *eagle_chain.weights(rt, cache, lengths), tokens.data_ptr(),
        parents.data_ptr(), rt.products, torch.get_num_threads(),
    )
    return tokens, parents
