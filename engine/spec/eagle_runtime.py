"""How the drafter runs an `EagleModel` for inference: its layer packed, on a CPU compiled.

The counterpart of engine.runtime.TargetRuntime for the one-layer drafter: `fc`, the layer
(engine.packed), `fc_out` (eagle3) and the draft head (the target's LM-head rows of the draft
vocabulary) as packed products, through the skinny kernel where it builds. Computes the same
function as `EagleModel.forward` / `.logits` (up to float summation order). `repack()` after the
drafter's or the target's weights change (the engine calls it from load_weights and
load_drafter_weights); `stale()` tells whether they changed since.

`bf16_weights` (engine.spec.drafter_weights=bfloat16): the packed copies are rounded to bf16 and
the kernels stream half the bytes (a chain level reads every weight once: measured in
docs/BENCHMARKS.md). The module keeps its float32 weights (spot training updates those; every
repack rounds them again). Only the kernels' path is rounded: the drafter's numerics change its
proposals, never the tokens emitted, which verification decides.

`bf16_products` (engine.spec.drafter_products): the kernels' products in bf16 arithmetic (x and
the weights rounded to bf16, AVX512_BF16's dot products; docs/BENCHMARKS.md, "bf16 in the engine",
measures the gain), with the same caveat: the proposals may change, the tokens do not. Attention stays float32.
"""

from __future__ import annotations

import torch

from engine.kv_cache import KVCache
from engine.layout import transpose_storage
from engine.model import default_slots_and_mask
from engine.packed import PackedLayer, Product, pack_layer, packed_forward, step_inputs, use_kernel
from engine.runtime import WeightsFingerprint, packable
from engine.spec.eagle import EagleModel


class EagleRuntime:
    def __init__(self, net: EagleModel, bf16_weights: bool = False, bf16_products: bool = False) -> None:
        self.net = net.eval()
        self.bf16_weights = bf16_weights
        self.bf16_products = bf16_products
        self.repack()

    @torch.no_grad()
    def repack(self) -> None:
        net = self.net
        net.refresh_head()
        w = net.fc.weight
        own = net.config.kind == "eagle3_vllm"  # vLLM's EAGLE-3 network: torch's ops only (engine.spec.eagle3_vllm)
        kernel = use_kernel(w) and not own
        if w.device.type == "cpu" and not kernel:
            transpose_storage(net)
        bf16, dot = self.bf16_weights and kernel, self.bf16_products and kernel
        # The compiled drafts' kind of panels (eagle_chain.cpp's Net::products).
        self.products = 2 if dot else 1 if bf16 else 0
        self.layer: PackedLayer | None = pack_layer(net.layers[0], bf16, dot) if packable(w) and not own else None
        # Packed copies for the compiled kernels (None: torch's ops serve).
        self.head = Product(net.head_t, True, bf16, dot) if kernel else None
        # A biased fc (imported EAGLE-1) runs through torch: the packed product and the compiled
        # drafts have no bias, so those drafts go the Python way (eagle_chain.supported).
        self.fc = Product(w.detach().t(), True, bf16, dot) if kernel and net.fc.bias is None else None
        self.fc_out = Product(net.fc_out.weight.detach().t(), True, bf16, dot) if kernel and net.fc_out is not None else None
        self.fingerprint = WeightsFingerprint(net)

    def stale(self) -> str | None:
        return self.fingerprint.changed()

    def __call__(
        self,
        tokens: torch.Tensor,  # [B, T] x_{t+1}
        features: torch.Tensor,  # [B, T, F] f_t
        positions: torch.Tensor,  # [B, T]
        cache: KVCache | None = None,
        cache_pos: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The predicted features f_{t+1}: [B, T, F]."""
        net = self.net
        if self.layer is None or torch.is_grad_enabled():
            return net(tokens, features, positions, cache, cache_pos, attn_mask)
        pair = net.fc_input(tokens, features, positions)  # [B, T, H + F]
        x = self.fc(pair.reshape(-1, pair.shape[-1])).view(*pair.shape[:-1], -1) if self.fc is not None else net.fc(pair)
        cache_pos, attn_mask = default_slots_and_mask(positions, cache, cache_pos, attn_mask)
        cos, sin = net.rope(positions, x.dtype)
        c = net.config
        s = step_inputs(cos, sin, attn_mask, cache_pos, c.num_attention_heads // c.num_key_value_heads)
        h = packed_forward(self.layer, x, s, cache, 0)  # [B, T, H]
        if net.fc_out is None or self.fc_out is None:
            return net.finish(h)
        aux = self.fc_out(h.reshape(-1, h.shape[-1])).view(*h.shape[:-1], -1)
        return torch.cat([aux, h], -1)

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """[..., F] predicted features -> [..., Vd] draft logits."""
        if self.head is None or torch.is_grad_enabled():
            return self.net.logits(predicted)
        h = predicted[..., -self.net.config.hidden_size :]
        return self.head(h.reshape(-1, h.shape[-1])).view(*h.shape[:-1], -1)
