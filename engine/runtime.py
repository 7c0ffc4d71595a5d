"""The engine's inference runtime for a decoder: packed layers, compiled kernels, versioned weights.

`engine.model.Transformer` is a plain decoder of modules; it knows nothing about how it is run.
`TargetRuntime(model)` is how the engine runs it: each decoder layer packed into a few products
(engine.packed), on a CPU through the compiled kernels (engine.kernels), with the final norm and
the LM head compiled too. It computes the same function as `model.forward` (up to float
summation order; with the kernels every row is computed on its own, so a verify pass reproduces
sequential decoding bit for bit).

Weights and staleness. The packed products are views of the parameters, but the kernels read
packed *copies*. The runtime therefore records a `version` and a fingerprint of the weights
(each parameter's autograd version counter and a strided sample of its values) when it packs.
`repack(version)` is called after the weights change (the engine's `load_weights`); `stale()`
names a parameter changed since, so an in-place update that bypassed `load_weights` (an
optimiser step, `load_state_dict`, `param.mul_`, even a `param.data.copy_`, which autograd does
not count, wherever the sample sees it) is refused instead of served from stale copies.

bf16 and anything needing gradients run the modules as they are (`model.forward`).

bf16 weights (`TargetRuntime(model, bf16_weights=True)`, `engine.weights: bfloat16`): a float32
model whose matrices (every linear layer's weight, the embedding and the LM head) are rounded to
bf16 in place at every (re)pack, and whose kernels stream them as bf16: half the bytes of a
memory-bound decode pass. The arithmetic stays float32 (each weight is widened exactly), so this
serves exactly the float32 function of the rounded model, every pass through the same
row-independent kernels: speculation still changes no token. What differs is the model: its
logits are those of the bf16-rounded policy (docs/BENCHMARKS.md measures how far from float32's).

bf16 products (`TargetRuntime(model, bf16_products=True)`, `engine.products: bf16`): every
decoder layer's products in bf16 arithmetic (engine.kernels.skinny, `dot`): the kernels round
each input row and each weight to bf16 and sum pairs of products in float32, with AVX512_BF16
twice the arithmetic of float32 products and half the bytes: decode and verify passes both run
faster, so the step is faster and speculation's ratio is not (docs/BENCHMARKS.md, "bf16 in the
engine"). The model's
weights are not touched, the final norm and the LM head stay float32, and every pass, decode or
verify, goes through the same row-independent kernels: speculation still changes no token. The
served function is the model's with bf16 products (its log-probs differ from float32's as a bf16
server's do; docs/BENCHMARKS.md measures how far).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.decode_ops import MAX_TOKENS, rms_norm
from engine.kernels.library import available, library
from engine.kv_cache import KVCache
from engine.layout import transpose_storage
from engine.model import ModelOutput, Transformer, default_slots_and_mask
from engine.packed import PackedLayer, Product, pack_layer, packed_forward, step_inputs, use_kernel

_SAMPLE = 64  # values per parameter in the weights' fingerprint


class WeightsFingerprint:
    """Version counters, storage addresses and a strided sample of every parameter, taken at one time.

    `changed()` runs before every generate() call. On a CPU with the compiled kernels the sample
    is checked in one call (engine/kernels/fingerprint.cpp) at byte addresses computed here, with
    the parameters' storages held so that the addresses stay valid; elsewhere it is one gather
    per parameter and one comparison. The parameter at fault is looked for only once something
    differs."""

    def __init__(self, module: nn.Module) -> None:
        self.params = list(module.named_parameters())
        self.versions = [p._version for _, p in self.params]
        self.ptrs = [p.data_ptr() for _, p in self.params]
        self.where = [_sample_index(p) for _, p in self.params]
        parts = self._parts()
        self.sample = torch.cat(parts) if parts else torch.zeros(0)  # [sum of sample sizes]
        self._compiled = None
        if self.params and all(p.device.type == "cpu" for _, p in self.params) and available()[0]:
            held = [p.detach() for _, p in self.params]  # keeps every sampled storage alive (and its addresses)
            addrs = torch.cat([_byte_addresses(p, i) for p, i in zip(held, self.where)])
            expect = torch.cat([x.view(torch.uint8) for x in parts])  # the same bytes, in address order
            owner = torch.repeat_interleave(torch.arange(len(held)), torch.tensor([x.numel() * x.element_size() for x in parts]))
            self._compiled = (held, addrs, expect, owner)

    def _parts(self) -> list[torch.Tensor]:
        # take() indexes any tensor as if flattened in row-major order: the packed parameters are
        # strided views, which reshape(-1) would copy whole at every check.
        return [torch.take(p.detach(), i) for (_, p), i in zip(self.params, self.where)]

    def changed(self) -> str | None:
        """The name of a parameter changed since this fingerprint, or None."""
        for (name, p), v, ptr in zip(self.params, self.versions, self.ptrs):
            if p._version != v or p.data_ptr() != ptr:
                return name
        if self._compiled is not None:
            _, addrs, expect, owner = self._compiled
            at = library().sample_bytes_differ(addrs.data_ptr(), addrs.numel(), expect.data_ptr())
            return None if at < 0 else self.params[int(owner[at])][0]
        now = torch.cat(self._parts())
        if torch.equal(now, self.sample):
            return None
        sizes = [i.numel() for i in self.where]
        for (name, _), a, b in zip(self.params, now.split(sizes), self.sample.split(sizes)):
            if not torch.equal(a, b):
                return name
        return None


def _sample_index(p: torch.Tensor) -> torch.Tensor:
    """Flat (row-major) indices of every (numel / _SAMPLE)-th element, for torch.take."""
    return torch.arange(0, p.numel(), max(1, p.numel() // _SAMPLE), device=p.device)


def _byte_addresses(p: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """[len(flat) * element size] the address of every byte of p's row-major elements `flat` (p strided)."""
    offset = torch.zeros_like(flat)
    rest = flat.clone()
    for size, stride in reversed(list(zip(p.shape, p.stride()))):
        offset += (rest % size) * stride
        rest //= size
    es = p.element_size()
    return (p.data_ptr() + offset.unsqueeze(1) * es + torch.arange(es)).view(-1)


def packable(w: torch.Tensor) -> bool:
    """The packed path serves float32 / float64 (in bf16 the modules keep HF's float32 norm)."""
    return w.dtype in (torch.float32, torch.float64)


def round_matrices_to_bf16_(model: nn.Module) -> None:
    """Rounds every parameter of 2+ dimensions (linear weights, embeddings, LM head) to bf16
    values in place (to nearest even, as `Tensor.bfloat16()`); norms and biases stay float32."""
    for p in model.parameters():
        if p.dim() >= 2:
            p.copy_(p.bfloat16())


class TargetRuntime:
    def __init__(self, model: Transformer, bf16_weights: bool = False, bf16_products: bool = False) -> None:
        self.model = model.eval()
        self.bf16_weights = bf16_weights
        self.bf16_products = bf16_products
        w = model.lm_head.weight
        if bf16_weights and not use_kernel(w):
            raise ValueError(f"bf16 weights (engine.weights=bfloat16) stream through the CPU kernels, which do not "
                             f"serve this model here ({w.dtype} on {w.device}; kernels: {available()[1]}); "
                             "use engine.weights=float32, or engine.dtype=bfloat16 for torch's own bf16")
        if bf16_products and not (use_kernel(w) and packable(w)):
            raise ValueError(f"bf16 products (engine.products=bf16) run in the CPU kernels, which do not serve this "
                             f"model here ({w.dtype} on {w.device}; kernels: {available()[1]}); use "
                             "engine.products=float32 or auto")
        self.version = 0
        self.layers: list[PackedLayer] | None = None
        self.head: Product | None = None
        self.repack(0)

    @torch.no_grad()
    def repack(self, version: int) -> None:
        """(Re-)packs the model's weights for inference and records them as `version`."""
        m = self.model
        w = m.lm_head.weight
        kernels = use_kernel(w)
        if w.device.type == "cpu" and not kernels:
            transpose_storage(m)  # with the kernels, the hot products have packed copies instead
        if self.bf16_weights:
            round_matrices_to_bf16_(m)
        self.layers = ([pack_layer(layer, self.bf16_weights, self.bf16_products) for layer in m.model.layers]
                       if packable(w) else None)
        self.head = Product(w.t(), True, self.bf16_weights) if kernels else None  # without the kernels lm_head serves
        self.version = version
        self.fingerprint = WeightsFingerprint(m)

    def stale(self) -> str | None:
        """A parameter changed since the last (re)pack, or None."""
        return self.fingerprint.changed()

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def kernels(self) -> bool:
        return self.layers is not None and self.layers[0].kernels

    def __call__(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T] RoPE positions
        cache: KVCache | None = None,
        cache_pos: torch.Tensor | None = None,  # [B, T] cache slots to write; default: positions
        attn_mask: torch.Tensor | None = None,  # [B, T, S] bool, True = attend
        logits: bool = True,
        hidden_layers: tuple[int, ...] = (),
    ) -> ModelOutput:
        m = self.model
        if self.layers is None or torch.is_grad_enabled():
            return m(input_ids, positions, cache, cache_pos, attn_mask, logits, hidden_layers)
        B, T = input_ids.shape
        cache_pos, attn_mask = default_slots_and_mask(positions, cache, cache_pos, attn_mask)
        cos, sin = m.rope(positions, m.dtype)
        x = m.model.embed_tokens(input_ids)  # [B, T, H]
        s = step_inputs(cos, sin, attn_mask, cache_pos, m.config.num_attention_heads // m.config.num_key_value_heads)
        layer_hidden = {}
        for i, p in enumerate(self.layers):
            x = packed_forward(p, x, s, cache, i)
            if i in hidden_layers:
                layer_hidden[i] = x
        # With the kernels the final norm and the LM head are compiled too (rows stay independent).
        kernels = self.kernels and self.head is not None and B * T <= MAX_TOKENS
        norm = m.model.norm
        hidden = rms_norm(x.reshape(B * T, -1), norm.weight, norm.eps).view(B, T, -1) if kernels else norm(x)
        if not logits:
            return ModelOutput(hidden=hidden, logits=None, layer_hidden=layer_hidden)
        out = self.head(hidden.reshape(B * T, -1)).view(B, T, -1) if kernels else m.lm_head(hidden)
        return ModelOutput(hidden=hidden, logits=out, layer_hidden=layer_hidden)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, H] final hidden states -> [M, V] logits."""
        if self.head is not None and hidden.shape[0] <= MAX_TOKENS and hidden.dtype == torch.float32:
            return self.head(hidden.contiguous())
        return self.model.lm_head(hidden)
