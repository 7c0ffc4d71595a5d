"""Fused RMSNorm, masked attention (with RoPE and the cache write) and SiLU-gating for a few rows
(engine/kernels/decode_ops.cpp via ctypes)."""

from __future__ import annotations

import torch

from engine.kernels.library import library

# New tokens per call up to which the fused norm, attention and gating serve: every decode and
# verify pass (128 rows x 17 tokens is 2176), for the same bit-for-bit reason as skinny.MAX_ROWS;
# longer prefills go to torch (SDPA's flash kernel wins on long sequences).
MAX_TOKENS = 4096


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [M, H] float32 (rows contiguous) -> (x * rsqrt(mean(x^2) + eps)) * w."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, H = x.shape
    y = torch.empty(M, H, dtype=torch.float32)
    library().rms_norm_rows(x.data_ptr(), x.stride(0), w.data_ptr() if w is not None else None, eps, y.data_ptr(), H, M, H)
    return y


def _check_cache_layer(who: str, k: torch.Tensor, v: torch.Tensor, D: int, mask: torch.Tensor) -> torch.Tensor:
    """Keys / values must be cache rows [N, Hkv, M, D] with contiguous heads; returns the mask contiguous."""
    if k.stride(3) != 1 or k.stride(2) != D or v.stride() != k.stride():
        raise ValueError(f"{who}: keys and values must be cache rows [N, Hkv, M, D] with contiguous heads")
    return mask.contiguous()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, T, Hq, D] (each head's D contiguous, heads adjacent); k, v [B, Hkv, M, D] (a cache
    layer's rows, contiguous); mask [B, T, S] bool (S <= M) -> [B, T, Hq, D]."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[1]
    if q.stride(3) != 1 or q.stride(2) != D:
        q = q.contiguous()
    mask = _check_cache_layer("attend", k, v, D, mask)
    out = torch.empty(B, T, Hq, D, dtype=torch.float32)
    library().attend_rows(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), mask.data_ptr(),
        out.data_ptr(), B, T, Hq, Hkv, mask.shape[-1], D, scale, torch.get_num_threads(),
    )
    return out


def rope_write_attend(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, slots: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, n_q: int, scale: float) -> torch.Tensor:
    """qkv [B, T, Hq + 2 Hkv, D] contiguous (q and k are rotated in place); cos / sin_signed
    [B, T, D]; slots [B, T] cache slots of the new tokens; k, v a cache layer [N, Hkv, M, D];
    mask [B, T, S] -> attention output [B, T, Hq, D]. Writes the new keys and values."""
    B, T, W, D = qkv.shape
    Hkv = k.shape[1]
    if not (qkv.is_contiguous() and cos.is_contiguous() and sin_signed.is_contiguous() and slots.is_contiguous()):
        raise ValueError("rope_write_attend: qkv, cos, sin and slots must be contiguous")
    mask = _check_cache_layer("rope_write_attend", k, v, D, mask)
    out = torch.empty(B, T, n_q, D, dtype=torch.float32)
    library().rope_write_attend(
        qkv.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), slots.data_ptr(), k.data_ptr(), v.data_ptr(),
        k.stride(0), k.stride(1), mask.data_ptr(), out.data_ptr(), B, T, n_q, Hkv, mask.shape[-1], D, scale,
        torch.get_num_threads(),
    )
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2I] (gate, then up) -> silu(gate) * up [M, I]."""
    x = x.contiguous()
    M, two_i = x.shape
    y = torch.empty(M, two_i // 2, dtype=torch.float32)
    library().silu_mul_rows(x.data_ptr(), y.data_ptr(), M, two_i // 2)
    return y
