"""The EAGLE drafter network: one decoder layer over `fc([embed(x_{t+1}); f_t])`.

`f_t` is the target's feature at position t: its final hidden state (after the final norm) for
`eagle`, as TLT and EAGLE-1; for `eagle3`, the outputs of a low and a middle layer concatenated
with the final hidden state (EAGLE-3's three-level fusion). The layer predicts the feature at
t+1; the target's frozen LM head on its last H dimensions gives the draft distribution of
x_{t+2}. Because the prediction lives in the same space as the input feature, drafting a tree
feeds predictions back in with no train / inference mismatch. (EAGLE-3 proper drops the feature
loss and trains through its own outputs; here `eagle3` keeps EAGLE-1's regression on all three
levels: simpler, and the same shape of network.)

The embedding and LM head are the target's, shared and frozen: they are not parameters of this
module and are not saved with it. An optional draft vocabulary (`draft_vocab`, EAGLE-3's d2t)
restricts the drafter's head to the target's most frequent tokens, which cuts the LM-head cost
per draft step on large vocabularies. Saved as a folder: config.json + model.safetensors with
names `fc.weight`, `layers.0.*` (and `fc_out.weight` for eagle3, `draft_vocab`).

`mtp` is the multi-token-prediction head of MiMo-style models (vLLM's `mtp` method; NeMo-RL's
native path), computed as vLLM's MiMoMultiTokenPredictorLayer computes it: `input_proj` over
[hidden_norm(h_t); token_norm(embed(x_{t+1}))] (stored here as `fc` with its two halves in this
module's order, [emb; f]), a full decoder layer (input norm included), then `final_norm`, whose
output goes to the target's LM head as it is and is fed back as the next step's hidden state. Two
differences of space, each undone exactly: MiMo's head reads the target's *pre-norm* state h_t
where this engine hands drafters the post-norm feature f_t = g * h_t / rms(h_t) (g: the target's
final-norm weight), and RMSNorm is scale-invariant, so hidden_norm(f_t / g) = hidden_norm(h_t) (up
to eps); and the head's output o is returned as o * g, so that feeding it back divides g out again
and its logits are o @ W^T (`head_t` is stored divided by g). `prediction_target` maps the
target's f_{t+1} into that space for the feature loss. Saved like the others, plus
`token_norm.weight`, `hidden_norm.weight`, `final_norm.weight` and layer 0's input norm.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from common.atomic import atomic_write
from engine.kv_cache import KVCache
from engine.model import DecoderLayer, RMSNorm, Transformer, default_slots_and_mask
from engine.model_config import ModelConfig
from engine.rope import RopeSource, inverse_frequencies
from engine.spec.drafter_spec import LEARNED

ARCH = "TailSpecEagleDrafter"
KINDS = LEARNED  # the network kinds: the learned drafters of engine.spec.drafter_spec


@dataclass(kw_only=True)
class EagleConfig:
    kind: str = "eagle"  # eagle | eagle3 | mtp | eagle3_vllm (KINDS; eagle3_vllm: engine.spec.eagle3_vllm)
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    vocab_size: int  # the target's
    aux_layers: list[int] = field(default_factory=list)  # eagle3: target layers fused with the final hidden
    draft_vocab_size: int | None = None  # None: the full vocabulary
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    # A bias on fc, as the EAGLE authors' EAGLE-1 checkpoints carry (spot.import_drafter); warm
    # starts train without one.
    fc_bias: bool = False

    def __post_init__(self) -> None:
        if self.fc_bias and self.kind not in ("eagle", "eagle3"):
            raise ValueError(f"fc_bias is an eagle / eagle3 option; a {self.kind} drafter's fc has no bias")

    @property
    def feature_size(self) -> int:
        return self.hidden_size * (len(self.aux_layers) + 1)

    def layer_config(self) -> ModelConfig:
        return ModelConfig(
            family="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=1, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
        )

    @classmethod
    def for_target(cls, target: ModelConfig, kind: str = "eagle", draft_vocab_size: int | None = None) -> EagleConfig:
        L = target.num_hidden_layers
        aux = sorted({1, max(L // 2 - 1, 0)}) if kind == "eagle3" else []
        if kind == "eagle3_vllm":  # vLLM's layer ids k: the residual stream entering layer k (our k - 1's output)
            if L < 3:
                raise ValueError(f"an eagle3_vllm drafter reads three distinct target layers; this target has {L}")
            # Below the last layer where there are enough (an HF actor's forward does not return its raw output).
            aux = [k - 1 for k in ((1, L // 2, L - 1) if L >= 4 else (1, 2, 3))]
        return cls(
            kind=kind, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps, vocab_size=target.vocab_size, aux_layers=aux,
            draft_vocab_size=draft_vocab_size, max_position_embeddings=target.max_position_embeddings,
            rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
        )


def write_drafter(path: Path, cfg: EagleConfig, state: dict[str, torch.Tensor], extra: dict | None = None) -> None:
    """A drafter folder (config.json + model.safetensors) from a config and a state dict under
    EagleModel's names: what `EagleModel.save` writes and `EagleModel.load` reads; the importer of
    published checkpoints (spot.import_drafter) writes one without building the target."""
    meta = {"architectures": [ARCH], **asdict(cfg), **(extra or {})}
    atomic_write(path / "model.safetensors", lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    atomic_write(path / "config.json", lambda p: p.write_text(json.dumps(meta, indent=2)))


@torch.no_grad()
def copy_named_weights(module: nn.Module, named) -> None:
    """Copies (name, tensor) pairs into every parameter of `module` in place; an unknown name, a
    wrong shape or a missing parameter is a ValueError naming it."""
    params = dict(module.named_parameters())
    seen = set()
    for name, t in named:
        if name not in params:
            raise ValueError(f"drafter weight {name!r} does not exist; expected names like {sorted(params)[:3]}")
        if params[name].shape != t.shape:
            raise ValueError(f"drafter weight {name!r} has shape {tuple(t.shape)}, expected {tuple(params[name].shape)}")
        params[name].copy_(t)
        seen.add(name)
    if seen != set(params):
        raise ValueError(f"drafter weights missing: {sorted(set(params) - seen)[:5]}")


class EagleModel(RopeSource, nn.Module):
    # Whether training also takes a fed-back step (`fed_back`, EAGLE-3's training-time test one
    # level deep): the eagle3_vllm network's (engine.spec.eagle3_vllm).
    trains_fed_back = False

    def __new__(cls, cfg: EagleConfig, *args, **kwargs):
        if cls is EagleModel and cfg.kind == "eagle3_vllm":  # a network of its own (engine.spec.eagle3_vllm)
            from engine.spec.eagle3_vllm import Eagle3VllmModel

            cls = Eagle3VllmModel
        return super().__new__(cls)

    def __init__(self, cfg: EagleConfig, target: Transformer, draft_vocab: torch.Tensor | None = None) -> None:
        super().__init__()
        if cfg.kind not in KINDS:
            raise ValueError(f"drafter kind must be one of {KINDS}, got {cfg.kind!r}")
        self.config = cfg
        H, F = cfg.hidden_size, cfg.feature_size
        self.fc = nn.Linear(H + F, H, bias=cfg.fc_bias)
        self.mtp = cfg.kind == "mtp"
        layer = DecoderLayer(cfg.layer_config(), 0)
        if self.mtp:  # MiMo's norms around its block (see the module docstring)
            self.token_norm, self.hidden_norm, self.final_norm = (RMSNorm(H, cfg.rms_norm_eps) for _ in range(3))
        else:
            layer.input_layernorm = nn.Identity()  # fc's output is the layer's input as it is (TLT)
        self.layers = nn.ModuleList([layer])
        # eagle3 also predicts the auxiliary layers' features, to feed them back in when drafting.
        self.fc_out = nn.Linear(H, F - H, bias=False) if F > H else None
        self.register_buffer("draft_vocab", draft_vocab if draft_vocab is not None else torch.empty(0, dtype=torch.long))
        # Shared and frozen: held outside the module's parameters (not trained, not saved).
        self.__dict__["target"] = target
        inv_freq, self.attention_factor = inverse_frequencies(
            cfg.layer_config().rope_spec(), cfg.head_dim, cfg.max_position_embeddings
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.refresh_head()

    @property
    def rope_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def refresh_head(self) -> None:
        """Re-reads the target's LM head rows of the draft vocabulary (after the target's weights change)."""
        w = self.target.lm_head.weight.detach()  # [V, H]
        # Stored [H, Vd] contiguous: few-row products are fastest with that operand (engine.layout).
        head_t = (w[self.draft_vocab] if self.draft_vocab.numel() else w).t()
        if self.mtp:
            g = self.target.model.norm.weight.detach()  # [H] the target's final-norm weight
            if bool((g.abs() < 1e-6).any()):
                raise ValueError("an mtp drafter needs a target whose final-norm weights are all nonzero (it divides "
                                 "them out of the post-norm features); use an eagle drafter for this target")
            self.__dict__["out_scale"] = g
            head_t = head_t / g[:, None]  # logits of a prediction o * g are o @ W^T
        self.__dict__["head_t"] = head_t.contiguous()

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """[Vd] target ids of the draft head's rows, or None for the full vocabulary."""
        return self.draft_vocab if self.draft_vocab.numel() else None

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] x_{t+1}
        features: torch.Tensor,  # [B, T, F] f_t
        positions: torch.Tensor,  # [B, T]
        cache: KVCache | None = None,
        cache_pos: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns the predicted features f_{t+1}: [B, T, F]."""
        x = self.fc(self.fc_input(tokens, features, positions))  # [B, T, H]
        cache_pos, attn_mask = default_slots_and_mask(positions, cache, cache_pos, attn_mask)
        cos, sin = self.rope(positions, x.dtype)
        return self.finish(self.layers[0](x, cos, sin, attn_mask.unsqueeze(1), cache, cache_pos))

    def fc_input(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[B, T] x_{t+1}, [B, T, F] f_t, [B, T] positions -> [B, T, H + F] the input of `fc`."""
        emb = self.target.model.embed_tokens(tokens).detach()  # [B, T, H]
        if not self.mtp:
            return torch.cat([emb, features], -1)
        emb = emb.masked_fill((positions == 0).unsqueeze(-1), 0)  # MiMo masks the token at position 0
        return torch.cat([self.token_norm(emb), self.hidden_norm(features / self.out_scale)], -1)

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        """[B, T, H] the layer's output -> [B, T, F] the prediction."""
        if self.mtp:
            return self.final_norm(h) * self.out_scale
        if self.fc_out is None:
            return h
        return torch.cat([self.fc_out(h), h], -1)  # aux levels first, final hidden last (as features)

    def prediction_target(self, features: torch.Tensor) -> torch.Tensor:
        """[..., F] the target's f_{t+1} -> what the prediction should be (its logits are the target's)."""
        return features * self.out_scale if self.mtp else features

    def target_logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., F] the target's features -> [..., Vd] the target's own logits on the draft vocabulary."""
        return self.logits(self.prediction_target(features))

    def feature_view(self, x: torch.Tensor) -> torch.Tensor:
        """What the feature loss compares of a prediction and its target (here: all of it)."""
        return x

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """[..., F] predicted features -> [..., Vd] draft logits (frozen target head, draft vocab rows)."""
        return predicted[..., -self.config.hidden_size :] @ self.head_t

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(1, max_batch, c.num_key_value_heads, max_len, c.head_dim, self.fc.weight.dtype, self.fc.weight.device)

    # -- persistence -----------------------------------------------------------------------
    def save(self, path: str | Path, extra: dict | None = None) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}  # from any device
        if not self.draft_vocab.numel():
            state.pop("draft_vocab")
        write_drafter(path, self.config, state, extra)

    @classmethod
    def load(cls, path: str | Path, target: Transformer) -> EagleModel:
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"drafter folder {path} does not exist (train one with `python -m spot.warmstart` or `make drafters`)")
        for name in ("config.json", "model.safetensors"):
            if not (path / name).is_file():
                raise FileNotFoundError(f"drafter folder {path} has no {name}")
        meta = json.loads((path / "config.json").read_text())
        if meta.get("architectures") != [ARCH]:
            raise ValueError(f"{path} is not a TailSpec EAGLE drafter (architectures={meta.get('architectures')})")
        fields = {k: v for k, v in meta.items() if k in EagleConfig.__dataclass_fields__}
        cfg = EagleConfig(**fields)
        t = target.config
        if cfg.hidden_size != t.hidden_size or cfg.vocab_size != t.vocab_size:
            raise ValueError(
                f"drafter {path} was trained for hidden size {cfg.hidden_size} / vocab {cfg.vocab_size}, but the target "
                f"has hidden size {t.hidden_size} / vocab {t.vocab_size}: train a drafter for this target"
            )
        if any(i >= t.num_hidden_layers for i in cfg.aux_layers):
            raise ValueError(f"drafter {path} reads target layers {cfg.aux_layers}, the target has {t.num_hidden_layers}")
        state = load_file(str(path / "model.safetensors"))
        vocab = state.pop("draft_vocab", None)
        model = cls(cfg, target, vocab)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if k != "draft_vocab"]
        if missing or unexpected:
            raise ValueError(f"drafter {path}: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
        return model.to(device=target.device, dtype=target.dtype).eval()  # beside the target (cuda on GPUs)
