"""ModelConfig: the decoder hyper-parameters, read from and written to Hugging Face `config.json`.

Three families share one decoder: Llama (plain), Qwen2 (q/k/v projections with bias) and Qwen3
(RMSNorm on q and k per head, explicit head_dim). Knows nothing about weights or tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.rope import RopeSpec

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(kw_only=True)
class ModelConfig:
    family: str = "llama"  # llama | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict = field(default_factory=dict)  # other HF fields, written back unchanged

    def __post_init__(self) -> None:
        if self.family not in ARCHITECTURES.values():
            raise ValueError(f"unknown model family {self.family!r}; expected one of {sorted(ARCHITECTURES.values())}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        self.rope_spec()  # validates the rope type early

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2" or self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @property
    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    def rope_spec(self) -> RopeSpec:
        scaling = dict(self.rope_scaling or {})
        rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
        spec = RopeSpec(theta=float(scaling.pop("rope_theta", self.rope_theta)), rope_type=rope_type, params=scaling)
        if rope_type not in RopeSpec.SUPPORTED:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(RopeSpec.SUPPORTED)}")
        return spec

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        archs = hf.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            family = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(hf.get("model_type", ""))
        if family is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        known = {
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id",
        }
        kwargs = {k: hf[k] for k in known if k in hf}
        # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x in rope_theta + rope_scaling.
        rope = hf.get("rope_parameters") or hf.get("rope_scaling")
        if rope is not None and not isinstance(rope, dict):
            raise ValueError(f"rope_parameters must be a mapping, got {rope!r}")
        theta = (rope or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        extra = {k: v for k, v in hf.items() if k not in known and k not in ("rope_parameters", "rope_scaling", "rope_theta")}
        return cls(family=family, rope_theta=float(theta), rope_scaling=rope, extra=extra, **kwargs)

    def to_hf(self) -> dict:
        arch = next(a for a, f in ARCHITECTURES.items() if f == self.family)
        out = {k: v for k, v in self.extra.items() if k not in ("quantization_config", "_name_or_path")}
        rope = dict(self.rope_scaling or {"rope_type": "default"})
        rope["rope_theta"] = self.rope_theta
        out.update(
            architectures=[arch],
            model_type=self.family,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act="silu",
            rope_theta=self.rope_theta,
            rope_parameters=rope,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        if self.family == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
        return out
