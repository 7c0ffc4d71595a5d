"""A whole EAGLE tree draft (coupled children) in one compiled call (`eagle_tree_draft` in
engine/kernels/eagle_chain.cpp, via ctypes).

`draft` runs the catch-up, the D levels of top-k expansion (the coupled sample first, then the
best alternatives, scored with the coupled prior) and the selection of the `budget` best nodes
for b rows: the same function as EagleDrafter's `_catch_up` + `_expand` + `_select`, without a
few hundred dispatched torch ops per draft. It serves plain sampling (no top-k / top-p) and
greedy, coupled children only; the drafter uses the Python path otherwise.
"""

from __future__ import annotations

import ctypes

import torch

from engine.kernels import eagle_chain
from engine.kernels.library import library

_P, _I, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_ARGS = [_I] * 12 + [_P, _P, _I, _P, _P, _P, _P, _F32, _F32, _P, _P] + [_P] * 8 + [_F32, _P, _P, _I, _I, _P, _P, _P, _INT]


def _kernel():
    fn = library().eagle_tree_draft
    if fn.argtypes is None:
        fn.argtypes, fn.restype = _ARGS, None
    return fn


def pool_size(depth: int, topk: int) -> int:
    """Nodes a tree of `depth` levels creates per row: K at the first level, K * K below."""
    return topk + (depth - 1) * topk * topk


def supported(rt, topk: int) -> bool:
    """Whether `rt` (an EagleRuntime) can draft trees of top-k `topk` through the kernel."""
    return topk > 1 and eagle_chain.supported(rt) and topk <= rt.head.skinny.N


def draft(rt, pend_tok: torch.Tensor, pend_feat: torch.Tensor, n_pend: torch.Tensor, depth: int, topk: int,
          budget: int, log_prior: float, noise: torch.Tensor | None, temperature: float, cos: torch.Tensor,
          sin_signed: torch.Tensor, cache, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Catch-up and tree in one call. Inputs as `eagle_chain.draft` (cos / sin_signed [b, T + D, hd]:
    the catch-up positions, then level d's position lengths + n_pend + d at T + d - 1; noise
    [b, D, Vd] the coupled noise of level d at d - 1, or None: greedy); the caller advances the
    cache's lengths by n_pend -> (tokens [b, n], parents [b, n]) with n = min(budget, pool_size),
    each row's kept nodes in creation order (a parent first), parent -1 = the root."""
    net, p, c = rt.net, rt.layer, rt.net.config
    b, T = pend_tok.shape
    F = pend_feat.shape[-1]
    ids = net.vocab_ids
    vd = rt.head.skinny.N
    if pend_feat.stride(-1) != 1 or pend_feat.stride(1) != F:
        raise ValueError("draft: pending features must have contiguous pairs")
    pend_tok, n_pend, lengths = pend_tok.contiguous(), n_pend.contiguous(), lengths.contiguous()
    cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
    noise = noise.contiguous() if noise is not None else None
    n = min(budget, pool_size(depth, topk))
    tokens = torch.empty(b, n, dtype=torch.long)
    parents = torch.empty(b, n, dtype=torch.long)
    ck, cv = cache.k[0], cache.v[0]
    fc_out = rt.fc_out.skinny.panels.data_ptr() if net.fc_out is not None else None
    _kernel()(
        b, T, depth, topk, budget, c.hidden_size, F, p.n_q, p.n_kv, p.d, p.inter, vd,
        pend_tok.data_ptr(), pend_feat.data_ptr(), pend_feat.stride(0), n_pend.data_ptr(),
        net.target.model.embed_tokens.weight.data_ptr(), ids.data_ptr() if ids is not None else None,
        noise.data_ptr() if noise is not None else None, float(temperature), float(log_prior),
        cos.data_ptr(), sin_signed.data_ptr(),
        rt.fc.skinny.panels.data_ptr(), p.qkv.skinny.panels.data_ptr(), p.o.skinny.panels.data_ptr(),
        p.gate_up.skinny.panels.data_ptr(), p.down.skinny.panels.data_ptr(), rt.head.skinny.panels.data_ptr(), fc_out,
        p.post_norm.data_ptr(), float(p.eps), ck.data_ptr(), cv.data_ptr(), ck.stride(0), ck.stride(1),
        lengths.data_ptr(), tokens.data_ptr(), parents.data_ptr(), torch.get_num_threads(),
    )
    return tokens, parents
