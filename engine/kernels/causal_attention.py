"""Causal self-attention with its backward for the actor's update on CPU, as a torch autograd function:
in float32 (engine/kernels/causal_attention.cpp via ctypes), or with `bf16` in bf16 arithmetic
(engine/kernels/causal_attention_bf16.cpp: every product's operands rounded to bf16, pairs of
products summed into float32 by AVX512_BF16's dot product; the softmax and every sum in float32),
which bf16-mixed precision uses where the CPU has AVX512_BF16 (`bf16_native`).

`causal_attention(q, k, v, scale)` takes HF's layout (q [B, Hq, T, D], k / v [B, Hkv, T, D], any
strides with each head's D contiguous; Hq a multiple of Hkv) and returns [B, T, Hq, D], what HF's
attention functions return. Every query at position t sees keys 0..t (no padding mask: rows are
right-padded, so no real token sees a pad). The results are float32 sums in a fixed order: the same
whatever the thread count, and within float rounding of torch's SDPA (in bf16 arithmetic, within
bf16's: tests/test_causal_attention.py).
"""

from __future__ import annotations

import functools

import torch

from engine.kernels.library import library


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"causal_attention: q [B, Hq, T, D], k and v [B, Hkv, T, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, T, D = q.shape
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != D or Hq % k.shape[1]:
        raise ValueError(f"causal_attention: q {tuple(q.shape)} and k {tuple(k.shape)} do not match "
                         "(the same rows, positions and head dim; query heads a multiple of kv heads)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"causal_attention: {name} must be a float32 CPU tensor, got {t.dtype} on {t.device} "
                             "(set actor.attention=sdpa for other dtypes and devices)")


@functools.cache
def bf16_native() -> bool:
    """Whether the kernels were built with AVX512_BF16 (and AVX512VL), so `causal_attention(..., bf16=True)` runs."""
    return bool(library().causal_attention_bf16_native())


def _heads_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(3) == 1 else t.contiguous()


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, bf16: bool):
        q, k, v = _heads_contiguous(q), _heads_contiguous(k), _heads_contiguous(v)
        if k.stride() != v.stride():
            k, v = k.contiguous(), v.contiguous()
        B, Hq, T, D = q.shape
        Hkv = k.shape[1]
        out = torch.empty(B, T, Hq, D, dtype=torch.float32)
        lse = torch.empty(B, T, Hq, dtype=torch.float32)
        fn = library().causal_attention_forward_bf16 if bf16 else library().causal_attention_forward
        fn(
            q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1),
            k.stride(2), out.data_ptr(), lse.data_ptr(), B, T, Hq, Hkv, D, scale, torch.get_num_threads(),
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.bf16 = scale, bf16
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        B, Hq, T, D = q.shape
        Hkv = k.shape[1]
        dout = dout.contiguous()
        dq = torch.empty(B, T, Hq, D, dtype=torch.float32)
        dk = torch.empty(B, Hkv, T, D, dtype=torch.float32)
        dv = torch.empty(B, Hkv, T, D, dtype=torch.float32)
        fn = library().causal_attention_backward_bf16 if ctx.bf16 else library().causal_attention_backward
        fn(
            q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1),
            k.stride(2), out.data_ptr(), lse.data_ptr(), dout.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
            B, T, Hq, Hkv, D, ctx.scale, torch.get_num_threads(),
        )
        return dq.transpose(1, 2), dk, dv, None, None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bf16: bool = False) -> torch.Tensor:
    """q [B, Hq, T, D], k / v [B, Hkv, T, D] float32 on CPU -> [B, T, Hq, D]: softmax over keys 0..t of
    (q_t . k_j) * scale, times v_j, per query head (its kv head hq // (Hq / Hkv)); differentiable.
    `bf16`: in bf16 arithmetic (the module's docstring; needs `bf16_native()` and D a multiple of 8)."""
    _check(q, k, v)
    if bf16:
        if not bf16_native():
            raise RuntimeError("causal_attention(bf16=True) needs kernels built with AVX512_BF16 (this CPU or compiler "
                               "lacks it): use bf16=False (actor.precision=bf16-mixed picks this by itself)")
        if q.shape[-1] % 8:
            raise ValueError(f"causal_attention(bf16=True) takes head dims that are multiples of 8, got {q.shape[-1]}")
    return _CausalAttention.apply(q, k, v, float(scale), bool(bf16))
