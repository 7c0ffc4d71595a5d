"""The decoder: one implementation for the Llama, Qwen2 and Qwen3 families.

Parameter names are Hugging Face's (`model.layers.{i}.self_attn.q_proj.weight`, ...), so HF
checkpoints load as they are. `forward` takes token ids, RoPE positions, an optional KV cache
with the cache slots to write, and an optional attention mask (a tree mask during verification);
it returns the final hidden states, logits, and, on request, hidden states of chosen layers.
There is no sampling or decoding policy here, and no inference runtime: the engine runs this
model through `engine.runtime.TargetRuntime` (packed layers, compiled kernels).

Shapes: B batch rows, T new tokens per row, S visible cache slots, H hidden size,
Hq / Hkv query / key-value heads, D head dim, G = Hq // Hkv query heads per key-value head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_cache import KVCache
from engine.model_config import ModelConfig
from engine.rope import RopeSource, apply_rope, inverse_frequencies


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # [B, T, H] after the final norm
    logits: torch.Tensor | None  # [B, T, V], None when not requested
    layer_hidden: dict[int, torch.Tensor]  # layer index -> [B, T, H] output of that decoder layer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as HF does, in one fused op (fewer dispatches per layer).
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_q, self.n_kv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_q * self.d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.d, bias=bias)
        self.o_proj = nn.Linear(self.n_q * self.d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [B, T, D]
        sin: torch.Tensor,
        mask: torch.Tensor,  # [B, 1, T, S] bool, True = attend
        cache: KVCache | None,
        cache_pos: torch.Tensor | None,  # [B, T] slots to write
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_q, self.d)
        k = self.k_proj(x).view(B, T, self.n_kv, self.d)
        v = self.v_proj(x).view(B, T, self.n_kv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(self.layer, k, v, cache_pos, mask.shape[-1])  # [B, Hkv, S, D]
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, D]
        # Fold the G query heads that share a KV head into the query length: no copy of K / V.
        G = self.n_q // self.n_kv
        q = q.view(B, T, self.n_kv, G, self.d).permute(0, 2, 3, 1, 4).reshape(B, self.n_kv, G * T, self.d)
        if G > 1:
            mask = mask.unsqueeze(2).expand(B, 1, G, T, mask.shape[-1]).reshape(B, 1, G * T, mask.shape[-1])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, Hkv, G*T, D]
        out = out.view(B, self.n_kv, G, T, self.d).permute(0, 3, 1, 2, 4).reshape(B, T, self.n_q * self.d)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, cache_pos) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, cache_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(RopeSource, nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.init_rope()

    def init_rope(self) -> None:
        cfg = self.config
        inv_freq, self.attention_factor = inverse_frequencies(cfg.rope_spec(), cfg.head_dim, cfg.max_position_embeddings)
        self.inv_freq = inv_freq.to(self.lm_head.weight.device)

    @property
    def rope_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T] RoPE positions
        cache: KVCache | None = None,
        cache_pos: torch.Tensor | None = None,  # [B, T] cache slots to write; default: positions
        attn_mask: torch.Tensor | None = None,  # [B, T, S] bool, True = attend
        logits: bool = True,
        hidden_layers: tuple[int, ...] = (),
    ) -> ModelOutput:
        cache_pos, attn_mask = default_slots_and_mask(positions, cache, cache_pos, attn_mask)
        cos, sin = self.rope(positions, self.dtype)
        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        mask = attn_mask.unsqueeze(1)  # [B, 1, T, S]
        layer_hidden = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, cache, cache_pos)
            if i in hidden_layers:
                layer_hidden[i] = x
        hidden = self.model.norm(x)
        return ModelOutput(hidden=hidden, logits=self.lm_head(hidden) if logits else None, layer_hidden=layer_hidden)


def default_slots_and_mask(positions, cache, cache_pos, attn_mask):
    """A forward's defaults: with a cache, tokens go to the slots of their positions; the mask is causal."""
    if cache is not None and cache_pos is None:
        cache_pos = positions
    if attn_mask is None:
        attn_mask = causal_mask(cache_pos if cache is not None else positions)
    return cache_pos, attn_mask


def causal_mask(slots: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """slots [B, T] (the slot each new token occupies) -> [B, T, S] bool: attend to slots <= own.

    With right-padded prompts and per-row cache lengths this is the whole masking rule for
    prefill and decode; a row never sees another row's slots because caches are per row.
    """
    S = int(slots.max()) + 1 if length is None else length
    return torch.arange(S, device=slots.device) <= slots.unsqueeze(-1)
