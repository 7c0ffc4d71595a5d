"""EAGLE-3 as vLLM serves it (`Eagle3LlamaForCausalLM`, SpecForge's layout): kind `eagle3_vllm`.

This project's own `eagle3` fuses the target's levels with the embedding in one fc and regresses
them all (engine.spec.eagle); vLLM's EAGLE-3 is another network, and a drafter that vLLM is to
serve must be that network. Per position, with the target's residual stream entering three of
its layers r_a, r_b, r_c (vLLM's `eagle_aux_hidden_state_layer_ids` a, b, c; here the outputs of
layers a-1, b-1, c-1):

    g   = fc([r_a; r_b; r_c])                          # [H] once per target position
    x   = [input_layernorm(embed(x_{t+1})); hidden_norm(g)]   # [2H]: attention reads both
    h   = g + attn(x);   out = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(out))                         # the drafter's own head, draft vocabulary

and `out` (pre-norm) is fed back as the next draft step's g. The network takes either the
target's features (F = 4H wide: the three levels, then the final hidden, which only the loss
reads) or its own predictions (H wide), told apart by width. Its LM head is a parameter of its
own (EAGLE-3 trains it; vLLM loads it with `d2t`, the draft-to-target id offsets), initialised
from the target's rows of the draft vocabulary. Training (spot.training.step) also runs one
fed-back step, EAGLE-3's training-time test one level deep (`fed_back`): each pair again with
its feature replaced by the drafter's own prediction of it, attending to the target-fed pairs
before it as a fed-back draft does; and the feature loss regresses `out` onto the next
position's g (detached; both RMS-normalised, `feature_view`), EAGLE-1's trick in fc's space.
No compiled kernel serves it: it runs through torch (engine.spec.eagle_runtime).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_cache import KVCache
from engine.model import DecoderLayer, RMSNorm, Transformer, default_slots_and_mask
from engine.rope import inverse_frequencies
from engine.spec.eagle import EagleConfig, EagleModel

LEVELS = 3  # vLLM's EAGLE-3 reads three target layers


class Eagle3VllmModel(EagleModel):
    trains_fed_back = True

    def __init__(self, cfg: EagleConfig, target: Transformer, draft_vocab: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)
        if len(cfg.aux_layers) != LEVELS:
            raise ValueError(f"an eagle3_vllm drafter reads {LEVELS} target layers, this config names {cfg.aux_layers}")
        self.config, self.mtp = cfg, False
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(LEVELS * H, H, bias=False)
        layer = DecoderLayer(cfg.layer_config(), 0)
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # attention reads [embedding; hidden]: 2H wide
            out = getattr(attn, name).out_features
            setattr(attn, name, nn.Linear(2 * H, out, bias=False))
        layer.hidden_norm = RMSNorm(H, eps)
        self.layers = nn.ModuleList([layer])
        self.final_norm = RMSNorm(H, eps)
        self.fc_out = None
        self.register_buffer("draft_vocab", draft_vocab if draft_vocab is not None else torch.empty(0, dtype=torch.long))
        self.__dict__["target"] = target
        inv_freq, self.attention_factor = inverse_frequencies(cfg.layer_config().rope_spec(), cfg.head_dim,
                                                              cfg.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.refresh_head()
        rows = self.head_t.t()  # [Vd, H] the target's rows of the draft vocabulary
        self.lm_head = nn.Linear(H, rows.shape[0], bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(rows)

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] x_{t+1}
        features: torch.Tensor,  # [B, T, F] the target's features, or [B, T, H] own predictions
        positions: torch.Tensor,  # [B, T]
        cache: KVCache | None = None,
        cache_pos: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns the pre-norm output [B, T, H]: the next step's g."""
        g = self.encode(features)
        layer = self.layers[0]
        emb = self.target.model.embed_tokens(tokens).detach()  # [B, T, H]
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(g)], -1)  # [B, T, 2H]
        cache_pos, attn_mask = default_slots_and_mask(positions, cache, cache_pos, attn_mask)
        cos, sin = self.rope(positions, g.dtype)
        h = g + layer.self_attn(x, cos, sin, attn_mask.unsqueeze(1), cache, cache_pos)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def fed_back(
        self,
        tokens: torch.Tensor,  # [B, W] x_{i+1}
        features: torch.Tensor,  # [B, W, F] the target's f_i
        pred: torch.Tensor,  # [B, W, H] the first step's outputs (pair i's is its prediction of f_{i+1})
        positions: torch.Tensor,  # [B, W]
        attn_mask: torch.Tensor,  # [B, W, W] causal within a segment
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The training-time test's second level: pair i (i >= 1) with the feature the drafter itself
        predicted for it (pred at i - 1), attending to the target-fed pairs before it and to
        itself, as a fed-back draft does at inference. -> (outputs [B, W - 1, H] for pairs 1..W-1,
        valid [B, W - 1]: pair i - 1 is in the same segment)."""
        B, W = tokens.shape
        dev = tokens.device
        g = torch.cat([self.encode(features), pred[:, :-1]], 1)  # [B, 2W - 1, H]: target-fed pairs, then fed-back
        toks = torch.cat([tokens, tokens[:, 1:]], 1)
        pos = torch.cat([positions, positions[:, 1:]], 1)
        i = torch.arange(1, W, device=dev)
        earlier = attn_mask[:, 1:, :] & (torch.arange(W, device=dev) < i.unsqueeze(1))  # [B, W-1, W]: pairs < i
        top = torch.cat([attn_mask, attn_mask.new_zeros(B, W, W - 1)], 2)
        bottom = torch.cat([earlier, torch.eye(W - 1, dtype=torch.bool, device=dev).expand(B, -1, -1)], 2)
        out = self(toks, g, pos, attn_mask=torch.cat([top, bottom], 1))  # [B, 2W - 1, H]
        valid = attn_mask[:, 1:, :].gather(2, (i - 1).view(1, -1, 1).expand(B, -1, 1)).squeeze(2)
        return out[:, W:], valid

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [.., F] -> g [.., H] (fc over the three levels); own predictions pass."""
        H = self.config.hidden_size
        if features.shape[-1] == H:
            return features
        if features.shape[-1] != self.config.feature_size:
            raise ValueError(f"eagle3_vllm takes features of width {self.config.feature_size} or {H}, got {features.shape[-1]}")
        return self.fc(features[..., : LEVELS * H])

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """[..., H] pre-norm output -> [..., Vd] draft logits (its own head)."""
        return self.lm_head(self.final_norm(predicted))

    def prediction_target(self, features: torch.Tensor) -> torch.Tensor:
        """The next position's g, detached: where a fed-back prediction should land."""
        return self.encode(features).detach()

    def feature_view(self, x: torch.Tensor) -> torch.Tensor:
        """Directions only: the residual stream's scale (large, and growing with depth) would drown the
        cross-entropy, and the layer reads g through RMSNorms anyway."""
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.config.rms_norm_eps)

    def target_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's own logits on the draft vocabulary, from its final hidden (the features' last H)."""
        return features[..., -self.config.hidden_size :] @ self.head_t
