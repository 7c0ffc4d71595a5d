"""The actor's causal CPU attention (engine/kernels/causal_attention.cpp, pipeline/actors/attention.py):
its forward and gradients are float64 SDPA's within float32 rounding, its results do not depend on
padding or thread count, and the HF integration refuses what it does not serve."""

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

# The kernels' two arithmetics: float32, and bf16 (tests/test_causal_attention_bf16.py tests its values).
ARITHMETIC = [pytest.param(False, id="float32"),
              pytest.param(True, id="bf16", marks=pytest.mark.skipif(
                  not bf16_native(), reason="the kernels were built without AVX512_BF16 (this CPU lacks it)"))]
from pipeline.actors.base import ActorConfig


def reference(q, k, v, scale):
    """float64 SDPA, kv heads repeated: [B, Hq, T, D] -> [B, T, Hq, D]."""
    g = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True,
                                         scale=scale)
    return out.transpose(1, 2)


def inputs(B, Hq, Hkv, T, D, seed=0, dtype=torch.float32):
    """HF's layout: heads as a transposed view of [B, T, H, D] (each head's D contiguous, not the heads)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, h, D, generator=g, dtype=dtype).transpose(1, 2) for h in (Hq, Hkv, Hkv)]


@pytest.mark.parametrize("B,Hq,Hkv,T,D", [(1, 6, 2, 37, 32), (3, 6, 2, 130, 32), (2, 9, 3, 70, 64), (1, 4, 4, 17, 24),
                                         (2, 6, 2, 1, 32)])
def test_forward_and_gradients_match_float64_sdpa(B, Hq, Hkv, T, D):
    q, k, v = [x.double().requires_grad_() for x in inputs(B, Hq, Hkv, T, D)]
    grad = torch.randn(B, T, Hq, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = reference(q, k, v, D**-0.5)
    ref.backward(grad)
    ours_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    out = causal_attention(*ours_in, D**-0.5)
    out.backward(grad.float())
    assert out.shape == (B, T, Hq, D)
    assert (out.double() - ref).abs().max() < 2e-6
    for mine, theirs in zip(ours_in, (q, k, v)):
        assert (mine.grad.double() - theirs.grad).abs().max() <= 2e-6 * max(1.0, theirs.grad.abs().max().item())


@pytest.mark.parametrize("bf16", ARITHMETIC)
def test_a_rows_results_do_not_depend_on_the_padding_after_it(bf16):
    """A micro-batch pads its rows to its longest: a row's real tokens get the same bits either way."""
    q, k, v = inputs(2, 6, 2, 150, 32)
    long = causal_attention(q, k, v, 0.2, bf16=bf16)
    short = causal_attention(q[:1, :, :90], k[:1, :, :90], v[:1, :, :90], 0.2, bf16=bf16)
    assert torch.equal(long[:1, :90], short)


@pytest.mark.parametrize("bf16", ARITHMETIC)
def test_thread_count_changes_no_bit(bf16):
    q, k, v = [x.requires_grad_() for x in inputs(4, 6, 2, 100, 32, seed=3)]
    grad = torch.randn(4, 100, 6, 32)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for x in (q, k, v):
                x.grad = None
            out = causal_attention(q, k, v, 0.18, bf16=bf16)
            out.backward(grad)
            results.append([out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_bad_inputs_are_refused_by_name():
    q, k, v = inputs(1, 6, 2, 8, 32)
    with pytest.raises(ValueError, match="float32 CPU"):
        causal_attention(q.double(), k, v, 0.1)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        causal_attention(q[:, :5], k, v, 0.1)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("attn-model")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_the_actor_model_trains_the_same_with_either_attention(tiny_model_dir):
    from pipeline.actors.forward import load_policy, policy_forward

    ids = torch.randint(0, 32, (3, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, 30:] = 0
    mask[2, 11:] = 0
    grads, logprobs = [], []
    for impl in ("sdpa", "tailspec"):
        model = load_policy(tiny_model_dir, ActorConfig(attention=impl))
        assert model.config._attn_implementation == ("sdpa" if impl == "sdpa" else "tailspec_cpu")
        lp = policy_forward(model, ids, mask).logprobs
        lp.sum().backward()
        logprobs.append(lp.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert (logprobs[0] - logprobs[1]).abs().max() < 1e-5
    assert (grads[0] - grads[1]).norm() < 1e-4 * grads[0].norm()


def test_auto_picks_the_kernels_on_cpu_float32_only():  # (bf16-mixed: tests/test_causal_attention_bf16.py)
    from pipeline.actors.attention import NAME, implementation

    assert implementation(ActorConfig()) == NAME
    assert implementation(ActorConfig(dtype="bfloat16")) == "sdpa"
    assert implementation(ActorConfig(attention="sdpa")) == "sdpa"
    with pytest.raises(ValueError, match="actor.attention=tailspec runs on CPU in float32"):
        ActorConfig(attention="tailspec", dtype="bfloat16").validate()


def test_a_padding_mask_or_a_cache_is_refused_with_the_fix(tiny_model_dir):
    from pipeline.actors.forward import load_policy

    model = load_policy(tiny_model_dir, ActorConfig(attention="tailspec"))
    ids = torch.randint(0, 32, (2, 12))
    left_padded = torch.ones(2, 12, dtype=torch.long)
    left_padded[0, :3] = 0
    with pytest.raises(ValueError, match="without a padding mask"):
        model(input_ids=ids, attention_mask=left_padded)
    with pytest.raises(ValueError, match="KV cache"):
        model.generate(ids[:1], max_new_tokens=2, do_sample=False)
