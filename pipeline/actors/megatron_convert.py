"""Hugging Face Llama / Qwen2 / Qwen3 weights <-> megatron-core GPTModel's state dict, and its TP shards.

Pure tensor code: it imports nothing of megatron, so the layout is unit-tested on any machine. The
layout is megatron-core 0.16's (checked against its source):

- `decoder.layers.N.self_attention.linear_qkv.weight` [ng * (hpg + 2) * d, H] fuses q, k and v per
  *query group* (ng groups = HF's num_key_value_heads, hpg = heads per group, d = head_dim): group
  g's hpg query heads, then its key head, then its value head, "q1 q2 k1 v1 | q3 q4 k2 v2"
  (transformer/attention.py, SelfAttention.get_query_key_value_tensors views the projection as
  [.., ng, (hpg + 2) * d] and splits it [hpg * d, d, d]). Qwen2's q/k/v biases fuse the same way.
- `mlp.linear_fc1.weight` [2 * F, H] = [gate; up]: megatron's gated MLP chunks fc1's output in two
  and computes act(first) * second.
- The norms before attention and MLP are `input_layernorm` / `pre_mlp_layernorm` in the local layer
  spec (get_gpt_layer_local_spec); the Transformer Engine spec fuses them into the next linear as
  `self_attention.linear_qkv.layer_norm_weight` / `mlp.linear_fc1.layer_norm_weight`
  (GPTLayout.fused_norms). Qwen3's per-head q/k norms are `q_layernorm` / `k_layernorm`.
- A tied model (Llama / Qwen3 here) has no `output_layer.weight`: the output reuses the embedding.
- Megatron's vocab-parallel embedding needs its rows divisible by the TP size, so the vocabulary is
  padded with zero rows to `padded_vocab`; converting back drops them (and the actor drops their logits).

Tensor parallelism (tensor_parallel/layers.py): column-parallel linears split their output rows in
TP contiguous blocks; for linear_qkv those are blocks of whole query groups when ng % TP == 0 (and
megatron's own split of a group when TP > ng). linear_fc1 is column-parallel per half: rank r holds
[gate_r; up_r]. Row-parallel linears (linear_proj, linear_fc2) split their input columns (dim 1).
The embedding and output layer are vocab-parallel (rows, dim 0). Norms are replicated.
Every split here is exact and `merge_tensor` inverts `split_tensor` bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

SUPPORTED = ("llama", "qwen2", "qwen3")
_LAYER = re.compile(r"^(model\.layers|decoder\.layers)\.(\d+)\.(.+)$")


@dataclass(frozen=True, kw_only=True)
class GPTLayout:
    """What the conversion needs to know of the model (GPTLayout.from_hf_config reads it off config.json)."""

    num_layers: int
    num_heads: int
    num_query_groups: int  # HF num_key_value_heads
    head_dim: int
    vocab: int  # HF vocab_size
    padded_vocab: int  # megatron's embedding rows: vocab rounded up to a multiple of the TP size
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3
    tied: bool  # tie_word_embeddings: no output_layer.weight
    fused_norms: bool = False  # Transformer Engine layer spec: input norms live in linear_qkv / linear_fc1

    def __post_init__(self) -> None:
        if self.num_heads % self.num_query_groups:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                             f"({self.num_query_groups})")
        if self.padded_vocab < self.vocab:
            raise ValueError(f"padded_vocab ({self.padded_vocab}) is smaller than vocab_size ({self.vocab})")

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups

    @classmethod
    def from_hf_config(cls, config, *, tensor_parallel: int = 1, fused_norms: bool = False) -> GPTLayout:
        """The layout of a transformers Llama / Qwen2 / Qwen3 config; other architectures raise ValueError."""
        family = getattr(config, "model_type", None)
        if family not in SUPPORTED:
            raise ValueError(f"config.json model_type {family!r}: the megatron actor converts {', '.join(SUPPORTED)}")
        for key in ("attention_bias", "mlp_bias"):
            if family != "qwen2" and getattr(config, key, False):
                raise ValueError(f"config.json {key}=true: megatron's add_bias_linear would bias every linear; "
                                 "only Qwen2's q/k/v bias (add_qkv_bias) is supported")
        if getattr(config, "use_sliding_window", False):
            raise ValueError("config.json use_sliding_window=true is not supported by the megatron actor")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act {config.hidden_act!r}: the megatron actor builds SwiGLU (silu)")
        heads = config.num_attention_heads
        vocab = config.vocab_size
        return cls(
            num_layers=config.num_hidden_layers, num_heads=heads,
            num_query_groups=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab=vocab, padded_vocab=-(-vocab // tensor_parallel) * tensor_parallel,
            qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
            tied=bool(getattr(config, "tie_word_embeddings", False)), fused_norms=fused_norms,
        )


def rope_settings(config) -> dict:
    """GPTModel's rotary arguments for an HF config: the base, and Llama 3's frequency scaling, of which
    megatron implements only the factor (low / high frequency factors 1 / 4 and 8192 original positions)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rotary_base": base}
    llama31 = tuple(params.get(k) for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))
    if kind == "llama3" and llama31 == (1, 4, 8192):
        return {"rotary_base": base, "rope_scaling": True, "rope_scaling_factor": params["factor"]}
    raise ValueError(f"config.json rope scaling {params}: the megatron actor supports none, or llama3 with "
                     "low_freq_factor 1, high_freq_factor 4 and original_max_position_embeddings 8192")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: GPTLayout) -> torch.Tensor:
    """q [heads * d, ...], k and v [ng * d, ...] (weights or biases) -> megatron's [ng * (hpg + 2) * d, ...]."""
    ng, hpg, d = layout.num_query_groups, layout.heads_per_group, layout.head_dim
    rest = q.shape[1:]
    groups = torch.cat([q.reshape(ng, hpg * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], dim=1)
    return groups.reshape(ng * (hpg + 2) * d, *rest)  # [ng, (hpg + 2) * d, ...] flattened


def split_qkv(qkv: torch.Tensor, layout: GPTLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv: megatron's [ng * (hpg + 2) * d, ...] -> (q, k, v) in HF's row order."""
    ng, hpg, d = layout.num_query_groups, layout.heads_per_group, layout.head_dim
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(ng, (hpg + 2) * d, *rest).split([hpg * d, d, d], dim=1)
    return (q.reshape(ng * hpg * d, *rest).contiguous(), k.reshape(ng * d, *rest).contiguous(),
            v.reshape(ng * d, *rest).contiguous())


def _renames(layout: GPTLayout) -> dict[str, str]:
    """Per-layer HF suffix -> megatron suffix for the tensors that are renamed, not fused."""
    names = {"self_attn.o_proj.weight": "self_attention.linear_proj.weight",
             "mlp.down_proj.weight": "mlp.linear_fc2.weight"}
    if layout.fused_norms:
        names["input_layernorm.weight"] = "self_attention.linear_qkv.layer_norm_weight"
        names["post_attention_layernorm.weight"] = "mlp.linear_fc1.layer_norm_weight"
    else:
        names["input_layernorm.weight"] = "input_layernorm.weight"
        names["post_attention_layernorm.weight"] = "pre_mlp_layernorm.weight"
    if layout.qk_norm:
        names["self_attn.q_norm.weight"] = "self_attention.q_layernorm.weight"
        names["self_attn.k_norm.weight"] = "self_attention.k_layernorm.weight"
    return names


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def hf_to_megatron(hf: Mapping[str, torch.Tensor], layout: GPTLayout) -> dict[str, torch.Tensor]:
    """A whole HF state dict -> megatron's (parameters only, no `_extra_state`); unknown or missing names raise."""
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    if layout.tied:
        hf.pop("lm_head.weight", None)  # transformers lists the tied head too; it is the embedding

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ValueError(f"Hugging Face weights have no {name} (layout: {layout})")
        return hf.pop(name)

    out = {"embedding.word_embeddings.weight": _pad_rows(take("model.embed_tokens.weight"), layout.padded_vocab),
           "decoder.final_layernorm.weight": take("model.norm.weight")}
    if not layout.tied:
        out["output_layer.weight"] = _pad_rows(take("lm_head.weight"), layout.padded_vocab)
    renames = _renames(layout)
    for i in range(layout.num_layers):
        hf_layer, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias") if layout.qkv_bias else ("weight",):
            q, k, v = (take(f"{hf_layer}self_attn.{p}_proj.{kind}") for p in "qkv")
            out[mc + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, layout)
        gate, up = take(hf_layer + "mlp.gate_proj.weight"), take(hf_layer + "mlp.up_proj.weight")
        out[mc + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        for hf_suffix, mc_suffix in renames.items():
            out[mc + mc_suffix] = take(hf_layer + hf_suffix)
    if hf:
        raise ValueError(f"Hugging Face weights the megatron layout has no place for: {', '.join(sorted(hf))}")
    return out


def megatron_to_hf(mc: Mapping[str, torch.Tensor], layout: GPTLayout) -> dict[str, torch.Tensor]:
    """Megatron tensors (all of them, or any subset such as one layer's) -> HF names; `_extra_state` is skipped.

    Exact inverse of hf_to_megatron: the padded vocabulary rows are dropped again.
    """
    top = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
           "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}
    back = {v: k for k, v in _renames(layout).items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in mc.items():
        if name.endswith("_extra_state"):
            continue
        if name in top:
            out[top[name]] = t[: layout.vocab] if name != "decoder.final_layernorm.weight" else t
            continue
        m = _LAYER.match(name)
        if m is None or m.group(1) != "decoder.layers":
            raise ValueError(f"unknown megatron weight {name!r}")
        hf, suffix = f"model.layers.{m.group(2)}.", m.group(3)
        if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = suffix.rsplit(".", 1)[1]
            for p, part in zip("qkv", split_qkv(t, layout)):
                out[hf + f"self_attn.{p}_proj.{kind}"] = part
        elif suffix == "mlp.linear_fc1.weight":
            gate, up = t.chunk(2)
            out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
        elif suffix in back:
            out[hf + back[suffix]] = t
        else:
            raise ValueError(f"unknown megatron weight {name!r} for this layout (fused_norms={layout.fused_norms}, "
                             f"qk_norm={layout.qk_norm})")
    return out


def split_kind(name: str) -> str:
    """How megatron shards this tensor over TP ranks: 'rows', 'gated_rows', 'columns' or 'replicated'."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
        return "rows"
    if name.endswith("linear_fc1.weight"):
        return "gated_rows"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "columns"
    return "replicated"


def split_tensor(name: str, full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """The full megatron tensor `name` -> its tp shards, in TP-rank order."""
    kind = split_kind(name)
    if kind == "replicated":
        return [full] * tp
    dim = 1 if kind == "columns" else 0
    if full.shape[dim] % (2 * tp if kind == "gated_rows" else tp):
        raise ValueError(f"megatron weight {name} {tuple(full.shape)}: dim {dim} does not split over "
                         f"actor.tensor_parallel={tp} ranks")
    if kind == "gated_rows":
        gate, up = full.chunk(2)
        return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]  # rank r: [gate_r; up_r]
    return [s.contiguous() for s in full.chunk(tp, dim=dim)]


def merge_tensor(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of split_tensor: the TP-rank-ordered shards of `name` -> the full tensor."""
    kind = split_kind(name)
    if kind == "replicated":
        return shards[0]
    if kind == "gated_rows":
        halves = [s.chunk(2) for s in shards]
        return torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])])
    return torch.cat(shards, dim=1 if kind == "columns" else 0)


def tp_split(mc: Mapping[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """A full megatron state dict -> one dict per TP rank."""
    shards = {name: split_tensor(name, t, tp) for name, t in mc.items()}
    return [{name: s[r] for name, s in shards.items()} for r in range(tp)]


def tp_merge(ranks: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of tp_split: the TP ranks' state dicts -> the full one."""
    return {name: merge_tensor(name, [r[name] for r in ranks]) for name in ranks[0]}
