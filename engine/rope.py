"""Rotary position embeddings: inverse frequencies for the RoPE variants of Llama / Qwen configs.

Knows the `rope_type`s `default`, `linear`, `llama3` and `yarn` (as Hugging Face defines them) and
turns positions into `(cos, sin)`. Does not know about attention or caches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True)
class RopeSpec:
    theta: float = 10000.0
    rope_type: str = "default"
    params: dict = field(default_factory=dict)  # the scaling fields of the HF config

    SUPPORTED = ("default", "linear", "llama3", "yarn")


def inverse_frequencies(spec: RopeSpec, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim/2] float32, attention_factor)."""
    dim = head_dim
    inv_freq = 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    p = spec.params
    if spec.rope_type == "default":
        return inv_freq.float(), 1.0
    if spec.rope_type == "linear":
        return (inv_freq / p["factor"]).float(), 1.0
    if spec.rope_type == "llama3":
        return _llama3(inv_freq, p).float(), 1.0
    if spec.rope_type == "yarn":
        return _yarn(spec.theta, dim, p, max_position_embeddings)
    raise ValueError(
        f"rope_type {spec.rope_type!r} is not supported; supported: {', '.join(RopeSpec.SUPPORTED)}"
    )


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, p: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    original = p.get("original_max_position_embeddings") or max_pos
    factor = p.get("factor") or max_pos / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, head_dim] in `dtype`."""
    freqs = positions.unsqueeze(-1).float() * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """[..., D] sin -> sin with its first half negated: then rotate_half(x) * sin is
    x.roll(D / 2, -1) * signed_sin(sin), one op instead of a slice-negate-cat."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D]; cos, sin [B, T, D] (the half-rotation layout of HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


class RopeTable:
    """cos / sin of positions 0..length-1, computed once by `rope_cos_sin` (so the same values):
    a forward then gathers rows instead of recomputing (~6 small ops per forward on a CPU).
    Built by the engine for the positions it can reach; `lookup` past the table is an error."""

    def __init__(self, length: int, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype) -> None:
        pos = torch.arange(length, device=inv_freq.device).unsqueeze(0)  # [1, P]
        cos, sin = rope_cos_sin(pos, inv_freq, attention_factor, dtype)
        self.cos, self.sin = cos[0], sin[0]  # [P, D]
        self.sin_signed = signed_sin(self.sin)  # [P, D] for the kernels' RoPE
        self.length = length

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, D]."""
        return self.cos[positions], self.sin[positions]


class RopeSource:
    """Mixin for a module with `inv_freq` and `attention_factor`: RoPE for positions, from a
    table the engine builds once (`build_rope_table`) or computed when there is none."""

    rope_table: RopeTable | None = None

    def build_rope_table(self, length: int) -> None:
        """Precompute RoPE for positions < length (the engine's reach): forwards gather rows."""
        if self.rope_table is not None and self.rope_table.length >= length:
            return  # engines sharing a model: the longest reach serves all
        self.rope_table = RopeTable(length, self.inv_freq, self.attention_factor, self.rope_dtype)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, D] in `dtype`."""
        if self.rope_table is not None and dtype == self.rope_table.cos.dtype:
            return self.rope_table.lookup(positions)
        return rope_cos_sin(positions, self.inv_freq, self.attention_factor, dtype)

    def rope_signed(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, signed_sin(sin) [B, T, D]: the kernels' form, gathered whole from the table."""
        t = self.rope_table
        if t is not None and dtype == t.cos.dtype:
            return t.cos[positions], t.sin_signed[positions]
        cos, sin = self.rope(positions, dtype)
        return cos, signed_sin(sin)
