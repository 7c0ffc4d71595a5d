"""The compiled CPU kernels (engine/kernels) and the packed inference path that uses them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from engine.checkpoint import load_checkpoint
from engine.kernels import decode_ops
from engine.kernels import eagle_chain as chain_kernel
from engine.kernels.library import available
from engine.kernels.skinny import SkinnyMatrix
from engine.kv_cache import KVCache
from engine.runtime import TargetRuntime
from engine.sampling import SamplingParams, row_keys
from engine.spec.drafter import DraftContext, DraftShape
from engine.spec.eagle import EagleConfig, EagleModel
from engine.spec.eagle_drafter import EagleDrafter
from tests.conftest import FAMILIES

OK, WHY = available()
pytestmark = pytest.mark.skipif(not OK, reason=f"CPU kernels unavailable here: {WHY}")


@pytest.mark.parametrize("K,N", [(64, 96), (37, 50), (576, 192)])
def test_skinny_product_equals_torch_with_bias_and_residual(K, N):
    torch.manual_seed(0)
    w, bias = torch.randn(K, N), torch.randn(N)
    sm = SkinnyMatrix(w)
    for M in (1, 3, 8, 9, 17, 40):
        x, res = torch.randn(M, K), torch.randn(M, N)
        torch.testing.assert_close(sm.matmul(x), x @ w, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(sm.matmul(x, bias=bias), x @ w + bias, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(sm.matmul(x, residual=res), res + x @ w, rtol=1e-5, atol=1e-4)


def test_skinny_row_does_not_depend_on_how_many_rows_share_the_call():
    torch.manual_seed(1)
    w, x = torch.randn(200, 130), torch.randn(21, 200)
    sm = SkinnyMatrix(w)
    full = sm.matmul(x)
    for i in (0, 5, 8, 20):
        assert torch.equal(sm.matmul(x[i : i + 1]), full[i : i + 1])  # bit for bit


def test_rms_norm_equals_torch():
    torch.manual_seed(2)
    x, w = torch.randn(7, 96), torch.randn(96)
    torch.testing.assert_close(decode_ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (96,), w, 1e-6), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(decode_ops.rms_norm(x, None, 1e-6), F.rms_norm(x, (96,), None, 1e-6), rtol=1e-5, atol=1e-6)


def test_masked_attention_equals_sdpa_and_rows_are_independent():
    torch.manual_seed(3)
    B, T, Hq, Hkv, M, D, S = 2, 5, 4, 2, 40, 16, 23
    q = torch.randn(B, T, Hq, D)
    k, v = torch.randn(B, Hkv, M, D), torch.randn(B, Hkv, M, D)
    mask = torch.rand(B, T, S) < 0.6
    mask[..., 0] = True  # every query sees something
    got = decode_ops.attend(q, k, v, mask, D**-0.5)
    kk = k[:, :, :S].repeat_interleave(Hq // Hkv, 1)
    vv = v[:, :, :S].repeat_interleave(Hq // Hkv, 1)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask.unsqueeze(1)).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    alone = decode_ops.attend(q[1:, 2:3].contiguous(), k[1:], v[1:], mask[1:, 2:3].contiguous(), D**-0.5)
    assert torch.equal(alone, got[1:, 2:3])


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_forward_with_kernels_equals_the_module_forward(hf_folders, family):
    plain = load_checkpoint(hf_folders[family])
    packed = TargetRuntime(copy.deepcopy(plain))
    assert packed.kernels
    ids = torch.tensor([[3, 17, 42, 8, 9, 11], [5, 6, 7, 1, 2, 4]])
    pos = torch.arange(6).expand(2, 6)
    cache_a = KVCache.for_model(plain.config, 2, 16, torch.float32)
    cache_b = KVCache.for_model(plain.config, 2, 16, torch.float32)
    with torch.inference_mode():
        a = plain(ids[:, :5], pos[:, :5], cache=cache_a)
        b = packed(ids[:, :5], pos[:, :5], cache=cache_b)
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-4)
        a = plain(ids[:, 5:], pos[:, 5:], cache=cache_a)  # one decode step through the cache
        b = packed(ids[:, 5:], pos[:, 5:], cache=cache_b)
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-4)
    # Parameters are still the same values under the same names.
    for (name, p), (_, q) in zip(plain.state_dict().items(), packed.model.state_dict().items()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("min_confidence", [0.0, 0.99], ids=["full-depth", "confidence-stop"])
@pytest.mark.parametrize("products", [0, 1, 2], ids=["fp32", "bf16-weights", "bf16-products"])
def test_compiled_chain_draft_proposes_what_the_python_chain_proposes(hf_folders, kind, temperature, min_confidence, products):
    runtime = TargetRuntime(load_checkpoint(hf_folders["llama"]))
    target = runtime.model
    torch.manual_seed(4)
    net = EagleModel(EagleConfig.for_target(target.config, kind, draft_vocab_size=40), target, torch.arange(0, 80, 2))
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(3.0)  # sharper drafts: more distinct tokens to compare
    params = SamplingParams(temperature=temperature)
    prompt = torch.tensor([[5, 9, 14, 20, 7], [4, 4, 8, 1, 3]])
    with torch.no_grad():
        out = runtime(prompt, torch.arange(5).expand(2, 5), hidden_layers=tuple(net.config.aux_layers))
    feats = torch.cat([out.layer_hidden[i] for i in net.config.aux_layers] + [out.hidden], -1)

    def draft(reference: bool) -> list[list[int]]:
        from engine.spec.drafter import Admission

        drafter = EagleDrafter(net, bf16_weights=products == 1, bf16_products=products == 2, reference=reference)
        shape = DraftShape(depth=6, topk=1, verify_tokens=6, min_confidence=min_confidence)
        drafter.reset(2, 64, params, shape)
        drafter.admit(Admission(slots=torch.tensor([0, 1]), owner=torch.tensor([0, 1]), tokens=prompt,
                                lengths=torch.tensor([5, 5]), features=feats, first_tokens=torch.tensor([11, 12])))
        ctx = DraftContext(
            roots=torch.tensor([11, 12]), positions=torch.tensor([0, 0]),
            keys=row_keys(0, 0, torch.tensor([3, 4]), torch.tensor([0, 0])), responses=torch.tensor([[11], [12]]),
            generated=torch.tensor([1, 1]), prompts=list(prompt), prompt_ids=["a", "b"], samples=torch.tensor([0, 0]),
            drafts=[None, None], params=params, shape=shape,
        )
        tree = drafter.propose(ctx).padded(6)
        return tree.tokens.tolist(), tree.valid.sum(1).tolist()

    assert chain_kernel.supported(EagleDrafter(net).rt)
    assert EagleDrafter(net, bf16_weights=products == 1, bf16_products=products == 2).rt.products == products
    compiled = draft(reference=False)
    if min_confidence > 0:  # the stop acts: a chain ends early (else comparing lengths says nothing)
        assert min(compiled[1]) < 6
    assert draft(reference=True) == compiled


def test_rope_write_attend_equals_rope_then_cache_write_then_attention():
    from engine.packed import _rope, step_inputs
    from engine.rope import rope_cos_sin

    torch.manual_seed(5)
    B, T, Hq, Hkv, D, M = 2, 3, 4, 2, 16, 20
    qkv = torch.randn(B, T, Hq + 2 * Hkv, D)
    lengths = torch.tensor([5, 9])
    slots = lengths.unsqueeze(1) + torch.arange(T)  # [B, T]
    cos, sin = rope_cos_sin(slots, 1.0 / (10000 ** (torch.arange(0, D, 2) / D)), 1.0, torch.float32)
    mask = torch.arange(12) <= slots.unsqueeze(-1)  # [B, T, S] causal
    s = step_inputs(cos, sin, mask, slots, Hq // Hkv)
    k_cache, v_cache = torch.randn(B, Hkv, M, D), torch.randn(B, Hkv, M, D)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    qk = _rope(qkv[:, :, : Hq + Hkv], s)
    rows = torch.arange(B).unsqueeze(1)
    k_ref[rows, :, slots] = qk[:, :, Hq:]
    v_ref[rows, :, slots] = qkv[:, :, Hq + Hkv :]
    want = decode_ops.attend(qk[:, :, :Hq], k_ref, v_ref, mask, D**-0.5)
    got = decode_ops.rope_write_attend(qkv.clone(), s.cos, s.sin_signed, slots, k_cache, v_cache, mask, Hq, D**-0.5)
    torch.testing.assert_close(k_cache, k_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v_cache, v_ref)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_silu_mul_equals_torch():
    x = torch.randn(5, 2 * 24)
    torch.testing.assert_close(decode_ops.silu_mul(x), F.silu(x[:, :24]) * x[:, 24:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_verify_pass_reproduces_sequential_decoding_bit_for_bit(hf_folders, family):
    """With the kernels every row is computed on its own in a fixed order, so the logits of k
    tokens verified in one pass (in a batch with other rows) equal, bit for bit, those of
    decoding them one at a time alone: what makes speculative rollouts the same tokens."""
    model = TargetRuntime(load_checkpoint(hf_folders[family]))
    cfg = model.model.config
    prompt, cont = [3, 17, 42, 8], [9, 11, 5, 7, 2, 30]
    P, K = len(prompt), len(cont)
    with torch.inference_mode():
        cache = KVCache.for_model(cfg, 1, 32, torch.float32)
        model(torch.tensor([prompt]), torch.arange(P)[None], cache=cache)
        sequential = torch.stack([
            model(torch.tensor([[t]]), torch.tensor([[P + i]]), cache=cache).logits[0, 0] for i, t in enumerate(cont)
        ])
        others = [[5, 6, 7, 1], [2, 2, 9, 4]]
        batch = KVCache.for_model(cfg, 3, 32, torch.float32)
        ids = torch.tensor([others[0], prompt, others[1]])
        model(ids, torch.arange(P).expand(3, P), cache=batch)
        verify = torch.tensor([[1, 2, 3, 4, 5, 6], cont, [7, 8, 9, 10, 11, 12]])
        one_pass = model(verify, (P + torch.arange(K)).expand(3, K), cache=batch).logits[1]
    assert torch.equal(one_pass, sequential)


def test_compiled_uniforms_equal_the_tensor_definition_bit_for_bit():
    from engine.sampling import row_keys, uniform, uniform_reference

    keys = row_keys(7, 3, torch.tensor([1, 99, 123456789, 5]), torch.tensor([0, 1, 2, 3]))
    positions = torch.tensor([0, 17, 4095, 2**40])
    for vocab in (50, 49152, torch.tensor([3, 0, 77, 49151, 12])):
        assert torch.equal(uniform(keys, positions, vocab), uniform_reference(keys, positions, vocab))
