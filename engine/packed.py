"""Packed decoder layers for inference: fewer, larger ops per layer.

A decode step of a small model on a CPU is dominated by per-op overhead, not arithmetic: an
eager SmolLM2 layer dispatches ~65 ops around its 7 matrix products. `pack_layer` lays each
layer's weights out as the few products inference needs, each a contiguous [in, out] operand
(the fast layout for few-row products, engine.layout):

    qkv      [H, (Hq + 2 Hkv) D]   q, k and v in one product (and one bias)
    o        [Hq D, H]             fused with the residual add (addmm)
    gate_up  [H, 2 I]              gate and up in one product
    down     [I, H]                fused with the residual add

The parameters keep their names, shapes and values: each becomes a view of the packed storage,
so state dicts, saving and in-place weight updates still work. On a CPU each product (and the
LM head) also gets a copy packed for the skinny-product kernel (engine/kernels): after the
weights change those copies must be re-packed (engine.runtime does, and detects when it must).
`packed_forward` is the layer's forward with these operands (~25 ops); it computes the same function as `DecoderLayer.forward`, up to float rounding
order (tests check both against transformers). Training never uses it: autograd goes through
the modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import decode_ops, skinny
from engine.kernels.library import available
from engine.kv_cache import KVCache
from engine.model import RMSNorm
from engine.rope import signed_sin


class Product:
    """x @ w for a weight w [in, out], through the skinny kernel for few float32 rows (its copy of
    w in bf16 with `bf16`: w must then hold bf16 values already, so both paths compute alike; in
    bf16 arithmetic with `dot`: x and w rounded to bf16, engine.kernels.skinny). Rows beyond the
    kernel's bound (long prefills) go to torch, which computes the same function up to float
    summation order: with `dot` over x and w rounded to bf16 as the kernel rounds them."""

    def __init__(self, w: torch.Tensor, kernel: bool, bf16: bool = False, dot: bool = False) -> None:
        self.w = w  # [in, out]
        self.skinny = skinny.SkinnyMatrix(w, bf16, dot) if kernel else None
        self.dot = dot
        self.w_rounded: torch.Tensor | None = None  # [in, out]: the torch path's operand with `dot`, made on first use

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in] -> [M, out] (+ bias [out] or + residual [M, out])."""
        if self.skinny is not None and x.shape[0] <= skinny.MAX_ROWS and x.dtype == torch.float32:
            return self.skinny.matmul(x, bias, residual)
        w = self.w
        if self.dot:
            if self.w_rounded is None:
                self.w_rounded = self.w.bfloat16().float()
            x, w = x.bfloat16().to(x.dtype), self.w_rounded.to(x.dtype)
        if residual is not None:
            return torch.addmm(residual, x, w)
        if bias is not None:
            return torch.addmm(bias, x, w)
        return x @ w


def use_kernel(w: torch.Tensor) -> bool:
    """The skinny kernel serves float32 CPU weights where it builds (engine.kernels.skinny)."""
    return w.device.type == "cpu" and w.dtype == torch.float32 and available()[0]


@dataclass
class PackedLayer:
    qkv: Product  # [H, (Hq + 2 Hkv) D]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) D]
    o: Product  # [Hq D, H]
    gate_up: Product  # [H, 2 I]
    down: Product  # [I, H]
    in_norm: torch.Tensor | None  # [H], None when the layer has no input norm (EAGLE's layer)
    post_norm: torch.Tensor  # [H]
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None
    eps: float
    n_q: int
    n_kv: int
    d: int
    inter: int
    kernels: bool  # float32 on a CPU with engine.kernels built: fused norm and attention too


def _packed_already(ts: list[torch.Tensor], dim: int) -> torch.Tensor | None:
    """The packed tensor the `ts` are consecutive views of (along `dim` of their packed layout:
    weights [out_i, in] as columns of [in, sum out_i], biases as pieces of [sum out_i]), or None.
    Packing twice (a second runtime of the same model, a re-pack after new weights) then reuses
    the storage: the parameters keep their storage and their version counters."""
    total = sum(t.shape[0] for t in ts)
    ptr, offset = ts[0].untyped_storage().data_ptr(), ts[0].storage_offset()
    stride = (1, total) if dim == 2 else (1,)
    for t in ts:
        if t.untyped_storage().data_ptr() != ptr or t.storage_offset() != offset or t.stride() != stride:
            return None
        offset += t.shape[0]
    if dim == 2:
        return torch.as_strided(ts[0].detach(), (ts[0].shape[1], total), (total, 1))
    return torch.as_strided(ts[0].detach(), (total,), (1,))


def _pack_linears(linears: list[nn.Linear]) -> torch.Tensor:
    """Concatenates Linear weights [out_i, in] into one contiguous [in, sum out_i] and makes each
    weight a view of it."""
    packed = _packed_already([m.weight for m in linears], 2)
    if packed is not None:
        return packed
    packed = torch.cat([m.weight.detach().t() for m in linears], 1).contiguous()  # [in, out]
    start = 0
    for m in linears:
        out = m.weight.shape[0]
        m.weight.data = packed[:, start : start + out].t()  # [out, in] view
        start += out
    return packed


def _pack_biases(linears: list[nn.Linear]) -> torch.Tensor:
    packed = _packed_already([m.bias for m in linears], 1)
    if packed is not None:
        return packed
    packed = torch.cat([m.bias.detach() for m in linears]).contiguous()
    start = 0
    for m in linears:
        n = m.bias.shape[0]
        m.bias.data = packed[start : start + n]
        start += n
    return packed


@torch.no_grad()
def pack_layer(layer: nn.Module, bf16: bool = False, dot: bool = False) -> PackedLayer:
    """Packs a decoder layer (engine.model.DecoderLayer, or EAGLE's layer with an identity input norm);
    `bf16`: the kernels' copies of its products in bf16 (engine.runtime's bf16-weights mode); `dot`:
    its products in bf16 arithmetic (engine.runtime's bf16-products mode, a drafter's in
    engine.spec.eagle_runtime)."""
    a, mlp = layer.self_attn, layer.mlp
    kernel = use_kernel(a.q_proj.weight) and a.d <= 1024  # the kernels' RoPE scratch holds 1024 floats
    qkv = Product(_pack_linears([a.q_proj, a.k_proj, a.v_proj]), kernel, bf16, dot)
    bias = _pack_biases([a.q_proj, a.k_proj, a.v_proj]) if a.q_proj.bias is not None else None
    in_norm = layer.input_layernorm.weight if isinstance(layer.input_layernorm, RMSNorm) else None  # EAGLE: identity
    return PackedLayer(
        qkv=qkv, qkv_bias=bias, o=Product(_pack_linears([a.o_proj]), kernel, bf16, dot),
        gate_up=Product(_pack_linears([mlp.gate_proj, mlp.up_proj]), kernel, bf16, dot),
        down=Product(_pack_linears([mlp.down_proj]), kernel, bf16, dot),
        in_norm=in_norm.detach() if in_norm is not None else None,
        post_norm=layer.post_attention_layernorm.weight.detach(),
        q_norm=a.q_norm.weight.detach() if a.q_norm is not None else None,
        k_norm=a.k_norm.weight.detach() if a.k_norm is not None else None,
        eps=layer.post_attention_layernorm.eps, n_q=a.n_q, n_kv=a.n_kv, d=a.d, inter=mlp.gate_proj.weight.shape[0],
        kernels=kernel,
    )


@dataclass
class StepInputs:
    """What every layer of one forward shares, computed once per forward."""

    cos: torch.Tensor  # [B, T, D] contiguous, one row per new token
    sin_signed: torch.Tensor  # [B, T, D]: sin with the first half negated (rotate-half folded in)
    mask: torch.Tensor  # [B, 1, G*T, S] bool, the GQA groups folded into the query length (SDPA)
    mask_rows: torch.Tensor  # [B, T, S] bool, as given (the fused attention)
    rows: torch.Tensor  # [B, 1] row index, for cache writes
    cache_pos: torch.Tensor | None  # [B, T]


def step_inputs(cos, sin, mask, cache_pos, n_groups: int) -> StepInputs:
    """cos, sin [B, T or 1, D]; mask [B, T, S] bool."""
    B, T, D = cos.shape[0], mask.shape[-2], cos.shape[-1]
    sin_signed = signed_sin(sin)
    if n_groups > 1:
        folded = mask.unsqueeze(1).expand(B, n_groups, T, mask.shape[-1]).reshape(B, 1, n_groups * T, mask.shape[-1])
    else:
        folded = mask.unsqueeze(1)
    rows = torch.arange(B, device=cos.device).unsqueeze(1)
    if cache_pos is not None:
        cache_pos = cache_pos.contiguous()
    return StepInputs(cos.expand(B, T, D).contiguous(), sin_signed.expand(B, T, D).contiguous(), folded, mask, rows, cache_pos)


def _rope(x: torch.Tensor, s: StepInputs) -> torch.Tensor:
    """x [B, T, heads, D] -> rotated (HF's half-rotation: x cos + rotate_half(x) sin)."""
    return x * s.cos.unsqueeze(2) + x.roll(x.shape[-1] // 2, -1) * s.sin_signed.unsqueeze(2)


def _norm(p: PackedLayer, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return decode_ops.rms_norm(x, w, p.eps) if p.kernels and x.shape[0] <= decode_ops.MAX_TOKENS else F.rms_norm(x, (x.shape[-1],), w, p.eps)


def packed_forward(p: PackedLayer, x: torch.Tensor, s: StepInputs, cache: KVCache | None, layer: int) -> torch.Tensor:
    """x [B, T, H] -> [B, T, H]; writes this layer's keys and values at s.cache_pos."""
    B, T, H = x.shape
    x2 = x.reshape(B * T, H)
    h = _norm(p, x2, p.in_norm) if p.in_norm is not None else x2
    qkv = p.qkv(h, bias=p.qkv_bias).view(B, T, p.n_q + 2 * p.n_kv, p.d)
    x2 = p.o(_attention(p, qkv, s, cache, layer), residual=x2)  # residual + attention
    return _mlp(p, x2).view(B, T, H)


def _attention(p: PackedLayer, qkv: torch.Tensor, s: StepInputs, cache: KVCache | None, layer: int) -> torch.Tensor:
    """qkv [B, T, Hq + 2 Hkv, D] -> attention output [B*T, Hq D]; writes the new keys and values."""
    B, T = qkv.shape[:2]
    nq, nkv, d = p.n_q, p.n_kv, p.d
    fused = p.kernels and cache is not None and B * T <= decode_ops.MAX_TOKENS
    if fused and p.q_norm is None:  # RoPE, the cache write and attention in one compiled call
        out = decode_ops.rope_write_attend(qkv, s.cos, s.sin_signed, s.cache_pos, cache.k[layer], cache.v[layer],
                                           s.mask_rows, nq, d**-0.5)
        return out.view(B * T, nq * d)
    if p.q_norm is None:
        qk = _rope(qkv[:, :, : nq + nkv], s)
        q, k = qk[:, :, :nq], qk[:, :, nq:]
    else:
        q = _rope(F.rms_norm(qkv[:, :, :nq], (d,), p.q_norm, p.eps), s)
        k = _rope(F.rms_norm(qkv[:, :, nq : nq + nkv], (d,), p.k_norm, p.eps), s)
    v = qkv[:, :, nq + nkv :]
    S = s.mask.shape[-1]
    if cache is not None:
        ck, cv = cache.k[layer], cache.v[layer]  # [N, Hkv, M, D]
        ck[s.rows, :, s.cache_pos] = k  # indexed view is [B, T, Hkv, D]
        cv[s.rows, :, s.cache_pos] = v
        if fused:  # Qwen3's q / k norms: rotated above, attention compiled
            return decode_ops.attend(q, ck, cv, s.mask_rows, d**-0.5).view(B * T, nq * d)
        k, v = ck[:B, :, :S], cv[:B, :, :S]  # [B, Hkv, S, D]
    else:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    G = nq // nkv
    if T == 1:  # decode: folding the groups into the query length is a view
        q = q.reshape(B, nkv, G, d)
    else:
        q = q.reshape(B, T, nkv, G, d).permute(0, 2, 3, 1, 4).reshape(B, nkv, G * T, d)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=s.mask)  # [B, Hkv, G*T, D]
    if T == 1:
        return out.reshape(B, nq * d)
    return out.view(B, nkv, G, T, d).permute(0, 3, 1, 2, 4).reshape(B * T, nq * d)


def _mlp(p: PackedLayer, x2: torch.Tensor) -> torch.Tensor:
    """x2 [M, H] -> x2 + MLP(norm(x2))."""
    gu = p.gate_up(_norm(p, x2, p.post_norm))  # [M, 2I]
    if p.kernels and gu.shape[0] <= decode_ops.MAX_TOKENS:
        act = decode_ops.silu_mul(gu)
    else:
        act = F.silu(gu[:, : p.inter]) * gu[:, p.inter :]
    return p.down(act, residual=x2)
