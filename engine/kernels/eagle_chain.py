"""A whole EAGLE chain draft in one compiled call (engine/kernels/eagle_chain.cpp via ctypes).

`draft` runs the catch-up and D draft levels for b rows of an `EagleModel` as its runtime
(engine.spec.eagle_runtime) packed it for the kernels: the same function as EagleDrafter's Python catch-up and chain, without
~40 dispatched ops per network call. It serves plain sampling (no top-k / top-p) and greedy;
the drafter uses the Python path otherwise.
"""

from __future__ import annotations

import torch

from engine.kernels.library import library


def supported(rt) -> bool:
    """Whether `rt` (an EagleRuntime) is packed with the kernels and shaped for the chain kernel."""
    net, p = rt.net, rt.layer
    emb = net.target.model.embed_tokens.weight
    return (
        p is not None and p.kernels and p.qkv_bias is None and p.q_norm is None and p.in_norm is None
        and rt.head is not None and rt.fc is not None
        and (net.fc_out is None or rt.fc_out is not None)
        and emb.is_contiguous() and emb.dtype == torch.float32 and p.d <= 1024
    )


def prepare(pend_tok, pend_feat, n_pend, noise, cos, sin_signed, lengths):
    """The draft kernels' tensor inputs, contiguous (pending features: contiguous pairs, or ValueError)."""
    if pend_feat.stride(-1) != 1 or pend_feat.stride(1) != pend_feat.shape[-1]:
        raise ValueError("draft: pending features must have contiguous pairs")
    noise = noise.contiguous() if noise is not None else None
    return pend_tok.contiguous(), n_pend.contiguous(), noise, cos.contiguous(), sin_signed.contiguous(), lengths.contiguous()


def sizes(rt, F: int) -> list[int]:
    """hidden, feature, q heads, kv heads, head dim, MLP width, draft vocabulary: the network's shape arguments."""
    p = rt.layer
    return [rt.net.config.hidden_size, F, p.n_q, p.n_kv, p.d, p.inter, rt.head.skinny.N]


def pending(rt, pend_tok, pend_feat, n_pend, noise) -> list:
    """Pointers to the pending pairs, the embedding, the draft vocabulary and the noise."""
    ids = rt.net.vocab_ids
    return [pend_tok.data_ptr(), pend_feat.data_ptr(), pend_feat.stride(0), n_pend.data_ptr(),
            rt.net.target.model.embed_tokens.weight.data_ptr(), ids.data_ptr() if ids is not None else None,
            noise.data_ptr() if noise is not None else None]


def weights(rt, cache, lengths) -> list:
    """Pointers to the packed weights, the final norm, the drafter's KV cache (layer 0) and its lengths."""
    p, ck, cv = rt.layer, cache.k[0], cache.v[0]
    fc_out = rt.fc_out.skinny.panels.data_ptr() if rt.net.fc_out is not None else None
    return [rt.fc.skinny.panels.data_ptr(), p.qkv.skinny.panels.data_ptr(), p.o.skinny.panels.data_ptr(),
            p.gate_up.skinny.panels.data_ptr(), p.down.skinny.panels.data_ptr(), rt.head.skinny.panels.data_ptr(), fc_out,
            p.post_norm.data_ptr(), float(p.eps), ck.data_ptr(), cv.data_ptr(), ck.stride(0), ck.stride(1),
            lengths.data_ptr()]


def draft(rt, pend_tok: torch.Tensor, pend_feat: torch.Tensor, n_pend: torch.Tensor, depth: int,
          noise: torch.Tensor | None, temperature: float, cos: torch.Tensor, sin_signed: torch.Tensor, cache,
          lengths: torch.Tensor, min_confidence: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Catch-up and chain in one call. pend_tok [b, T] pending tokens (each row's root at
    n_pend - 1); pend_feat [b, >= T, F] their features; n_pend [b]; noise [b, D, Vd] or None
    (greedy); cos / sin_signed [P, hd] RoPE tables by position, P > lengths + n_pend + D (the
    kernel reads the catch-up's rows lengths + 1 + j, then the chain's lengths + n_pend + 1 + d); cache: the drafter's KVCache (layer 0), whose
    `lengths` the caller advances by n_pend; min_confidence: the confidence stop (the .cpp's
    header; 0: full depth) -> (tokens [b, D], real tokens per row [b])."""
    pend_tok, n_pend, noise, cos, sin_signed, lengths = prepare(pend_tok, pend_feat, n_pend, noise, cos, sin_signed, lengths)
    b, T = pend_tok.shape
    tokens = torch.empty(b, depth, dtype=torch.long)
    real = torch.empty(b, dtype=torch.long)
    library().eagle_draft(
        b, T, depth, *sizes(rt, pend_feat.shape[-1]), *pending(rt, pend_tok, pend_feat, n_pend, noise), float(temperature),
        cos.data_ptr(), sin_signed.data_ptr(), *weights(rt, cache, lengths), float(min_confidence), tokens.data_ptr(),
        real.data_ptr(), rt.products, torch.get_num_threads(),
    )
    return tokens, real
