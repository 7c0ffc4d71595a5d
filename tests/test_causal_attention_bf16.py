"""The actor's causal CPU attention in bf16 arithmetic (engine/kernels/causal_attention_bf16.cpp), which
bf16-mixed precision uses where the kernels have AVX512_BF16: its forward is what its docstring says
(bf16-rounded operands and probabilities, float32 softmax and sums) to float32 rounding, its forward
and gradients stay within bf16's rounding of float64 SDPA's, and the actor picks it under bf16-mixed
only (tests/test_causal_attention.py checks both arithmetics against padding and thread count)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.library import KernelUnavailable, library

try:
    library()
except (KernelUnavailable, OSError) as e:  # pragma: no cover - every CI host has g++
    pytest.skip(f"CPU kernels do not build here: {e}", allow_module_level=True)

from engine.kernels.causal_attention import bf16_native, causal_attention
from pipeline.actors.base import ActorConfig

native = pytest.mark.skipif(not bf16_native(), reason="the kernels were built without AVX512_BF16 (this CPU lacks it): "
                                                      "bf16-mixed keeps the float32 attention here")


def inputs(B, Hq, Hkv, T, D, seed=0, dtype=torch.float32):
    """HF's layout: heads as a transposed view of [B, T, H, D]."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, h, D, generator=g, dtype=dtype).transpose(1, 2) for h in (Hq, Hkv, Hkv)]


def rounded(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().double()


def emulated_forward(q, k, v, scale):
    """float64 of what the kernel computes: scores of bf16-rounded q, k; the softmax's numerators
    rounded to bf16 where they weigh bf16-rounded values; the total of the unrounded ones."""
    g = q.shape[1] // k.shape[1]
    kk, vv = rounded(k).repeat_interleave(g, 1), rounded(v).repeat_interleave(g, 1)
    s = rounded(q) @ kk.transpose(-1, -2) * scale  # [B, Hq, T, T]
    T = q.shape[2]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    e = (s - s.amax(-1, keepdim=True)).float().exp().double()  # the kernel's exp is float32's
    out = (rounded(e) @ vv) / e.sum(-1, keepdim=True)
    return out.transpose(1, 2)


@native
@pytest.mark.parametrize("B,Hq,Hkv,T,D", [(1, 6, 2, 37, 32), (2, 9, 3, 70, 64), (1, 4, 4, 17, 24), (2, 6, 2, 1, 32)])
def test_the_forward_is_bf16_operands_with_float32_sums(B, Hq, Hkv, T, D):
    q, k, v = inputs(B, Hq, Hkv, T, D)
    out = causal_attention(q, k, v, D**-0.5, bf16=True)
    ref = emulated_forward(q.double(), k.double(), v.double(), D**-0.5)
    assert (out.double() - ref).abs().max() < 2e-5  # float32 sums in another order
    # and it is not the float32 kernels' result (the products really run in bf16)
    assert (out - causal_attention(q, k, v, D**-0.5)).abs().max() > 1e-4


@native
@pytest.mark.parametrize("B,Hq,Hkv,T,D", [(1, 6, 2, 37, 32), (3, 6, 2, 130, 32), (2, 9, 3, 70, 64), (1, 4, 4, 17, 24),
                                         (2, 6, 2, 1, 32)])
def test_forward_and_gradients_are_within_bf16_rounding_of_float64_sdpa(B, Hq, Hkv, T, D):
    q, k, v = [x.double().requires_grad_() for x in inputs(B, Hq, Hkv, T, D)]
    grad = torch.randn(B, T, Hq, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    g = Hq // Hkv
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True,
                                         scale=D**-0.5).transpose(1, 2)
    ref.backward(grad)
    ours = [x.detach().float().requires_grad_() for x in (q, k, v)]
    out = causal_attention(*ours, D**-0.5, bf16=True)
    out.backward(grad.float())
    assert (out.double() - ref).abs().max() < 2e-2  # bf16 keeps 8 bits: ~4e-3 relative per operand
    for mine, theirs in zip(ours, (q, k, v)):
        assert (mine.grad.double() - theirs.grad).abs().max() <= 2e-2 * max(1.0, theirs.grad.abs().max().item())
        # and close in the mean, not only at the worst element
        assert (mine.grad.double() - theirs.grad).norm() <= 1e-2 * max(1.0, theirs.grad.norm().item())


@native
def test_a_head_dim_off_the_vector_width_is_refused_by_name():
    q, k, v = inputs(1, 2, 2, 8, 12)
    with pytest.raises(ValueError, match="multiples of 8, got 12"):
        causal_attention(q, k, v, 0.1, bf16=True)


def test_the_actor_attends_in_bf16_under_bf16_mixed_only_where_the_kernels_have_it():
    from pipeline.actors.attention import NAME, NAME_BF16, implementation

    assert implementation(ActorConfig(precision="float32")) == NAME
    assert implementation(ActorConfig(precision="bf16-mixed")) == (NAME_BF16 if bf16_native() else NAME)
    assert implementation(ActorConfig(precision="bf16-mixed", attention="sdpa")) == "sdpa"


@native
def test_a_bf16_mixed_model_trains_close_to_float32(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.actors.forward import forward_in, load_policy

    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    ids = torch.randint(0, 32, (3, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, 30:] = 0
    lps, grads = [], []
    for precision in ("float32", "bf16-mixed"):
        actor_cfg = ActorConfig(precision=precision)
        model = load_policy(tmp_path, actor_cfg)
        assert model.config._attn_implementation == ("tailspec_cpu_bf16" if precision == "bf16-mixed" else "tailspec_cpu")
        lp = forward_in(model, actor_cfg)(ids, mask).logprobs
        lp.sum().backward()
        lps.append(lp.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert 0 < (lps[0] - lps[1]).abs().max() < 5e-2
    assert (grads[0] - grads[1]).norm() < 5e-2 * grads[0].norm()


@native
def test_outside_autocast_a_bf16_mixed_model_attends_in_float32_as_its_products_do(tmp_path):
    """The bf16 attention follows autocast like the model's matrix products: a bf16-mixed model called
    without it (a weight check, an HF forward) computes what the float32 model does, bit for bit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.actors.forward import load_policy

    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    ids = torch.randint(0, 32, (2, 30), generator=torch.Generator().manual_seed(0))
    mixed = load_policy(tmp_path, ActorConfig(precision="bf16-mixed"))
    plain = load_policy(tmp_path, ActorConfig(precision="float32"))
    assert mixed.config._attn_implementation == "tailspec_cpu_bf16"
    with torch.no_grad():
        assert torch.equal(mixed(input_ids=ids).logits, plain(input_ids=ids).logits)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under = mixed(input_ids=ids).logits
    assert not torch.equal(under, plain(input_ids=ids).logits)
