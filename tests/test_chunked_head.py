"""The LM head computed a chunk of tokens at a time (pipeline/actors/chunked_head.py, head.py):
the same log-probs, entropies and gradients as log-softmax over the whole logits, on hand-built
inputs and on small models (float32 and bf16-mixed, tied and untied heads), and no tensor of a
micro-batch's tokens x vocabulary in the forward or the backward."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.actors.base import ActorConfig
from pipeline.actors.chunked_head import chunked_token_logprobs
from pipeline.actors.forward import forward_in, load_policy, token_entropy, token_logprobs
from pipeline.actors.head import LogprobHead, install_head
from tests.conftest import make_hf_model
from tests.mp.actor_worker import make_batch


def full_logprobs(hidden, weight, targets):
    """The whole [N, V] log-softmax: what the chunked function must equal."""
    logp = torch.log_softmax((hidden @ weight.T).float(), -1)  # [N, V]
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def test_a_hand_built_head_gives_the_log_probs_entropy_and_gradients_worked_out_by_hand():
    # logits z = [ln 2, 0, 0]: p = [1/2, 1/4, 1/4], E[z] = ln2 / 2, entropy 1.5 ln 2.
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    hidden = torch.tensor([[math.log(2.0), 0.0]], dtype=torch.float64, requires_grad=True)
    lp, ent = chunked_token_logprobs(hidden, weight, torch.tensor([0]), chunk_tokens=1, entropy=True)
    assert lp.item() == pytest.approx(math.log(0.5)) and ent.item() == pytest.approx(1.5 * math.log(2.0))
    lp.sum().backward()
    # d log p_0 / dz = [1/2, -1/4, -1/4]; through z = W h: dh = dz @ W, dW = dz^T h.
    torch.testing.assert_close(hidden.grad, torch.tensor([[0.5, -0.25]], dtype=torch.float64))
    torch.testing.assert_close(weight.grad[:, 0], torch.tensor([0.5, -0.25, -0.25], dtype=torch.float64) * math.log(2))
    hidden.grad, weight.grad = None, None
    _, ent = chunked_token_logprobs(hidden, weight, torch.tensor([0]), chunk_tokens=1, entropy=True)
    ent.sum().backward()
    # dH / dz_j = -p_j (z_j - E[z]) = ln2 * [-1/4, 1/8, 1/8]
    torch.testing.assert_close(hidden.grad, math.log(2) * torch.tensor([[-0.25, 0.125]], dtype=torch.float64))


@pytest.mark.parametrize("chunk", [1, 4, 37, 100])
def test_chunked_log_probs_entropies_and_gradients_equal_the_whole_log_softmax(chunk):
    g = torch.Generator().manual_seed(0)
    N, H, V = 37, 16, 50
    hidden = (3 * torch.randn(N, H, generator=g)).requires_grad_()
    weight = torch.randn(V, H, generator=g).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)  # any loss's gradient per token
    lp, ent = chunked_token_logprobs(hidden, weight, targets, chunk_tokens=chunk, entropy=True)
    (lp * g_lp + ent * g_ent).sum().backward()
    chunked = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None
    ref_lp, ref_ent = full_logprobs(hidden, weight, targets)
    (ref_lp * g_lp + ref_ent * g_ent).sum().backward()
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    # float32 sums in another order: gradients of size ~10 agree to a few float32 steps of theirs
    torch.testing.assert_close(chunked[0], hidden.grad, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(chunked[1], weight.grad, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("entropy", [False, True])
def test_the_chunked_backward_passes_gradcheck_in_float64(entropy):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 7, (9,), generator=g)

    def f(h, w):
        lp, ent = chunked_token_logprobs(h, w, targets, chunk_tokens=4, entropy=entropy)
        return (lp, ent) if entropy else lp

    assert torch.autograd.gradcheck(f, (hidden, weight))


def test_the_head_product_runs_in_float32_when_asked_and_in_the_weights_dtype_otherwise():
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(12, 16, generator=g).bfloat16(), torch.randn(40, 16, generator=g).bfloat16()
    targets = torch.randint(0, 40, (12,), generator=g)
    wide, _ = chunked_token_logprobs(hidden, weight, targets, chunk_tokens=5, float32=True)
    torch.testing.assert_close(wide, full_logprobs(hidden.float(), weight.float(), targets)[0])
    narrow, _ = chunked_token_logprobs(hidden, weight, targets, chunk_tokens=5, float32=False)
    torch.testing.assert_close(narrow, full_logprobs(hidden, weight, targets)[0])  # a bf16 product, then float32
    assert narrow.dtype == wide.dtype == torch.float32 and not torch.equal(narrow, wide)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the caller's autocast does not decide the product's dtype
        inside, _ = chunked_token_logprobs(hidden.float(), weight.float(), targets, chunk_tokens=5)
    torch.testing.assert_close(inside, wide, atol=0, rtol=0)


def test_bad_shapes_and_chunk_sizes_are_refused_by_name():
    h, w, t = torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="hidden \\[N, H\\] and weight \\[V, H\\]"):
        chunked_token_logprobs(h, torch.randn(5, 2), t, chunk_tokens=2)
    with pytest.raises(ValueError, match="one target per hidden row"):
        chunked_token_logprobs(h, w, t[:3], chunk_tokens=2)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        chunked_token_logprobs(h, w, t, chunk_tokens=0)
    with pytest.raises(ValueError, match="actor.head_chunk_tokens"):
        ActorConfig(head_chunk_tokens=0).validate()


def reference_forward(model, ids, mask, entropy: bool):
    """Today's computation: the model's whole [b, T, V] logits (the head called plainly), then
    log-softmax over them (forward.py's token_logprobs / token_entropy)."""
    logits = model(input_ids=ids, attention_mask=None, use_cache=False).logits  # [b, T, V]
    real = mask.bool()
    return token_logprobs(logits, ids).masked_fill(~real, 0.0), token_entropy(logits).masked_fill(~real, 0.0)


def chunked_and_full(folder, precision: str, chunk: int):
    """Log-probs, entropies and every parameter's gradient of one loss, by the chunked head and by the
    whole logits, each on a fresh copy of the model in folder."""
    ids, mask = make_batch(rows=5, width=14).input_ids, make_batch(rows=5, width=14).attention_mask
    g = torch.Generator().manual_seed(4)
    g_lp, g_ent = torch.randn(ids.shape, generator=g), torch.randn(ids.shape, generator=g)
    results = []
    for way in ("chunked", "full"):
        cfg = ActorConfig(precision=precision, head_chunk_tokens=chunk, attention="sdpa")
        model = load_policy(folder, cfg)
        if way == "chunked":
            out = forward_in(model, cfg)(ids, mask, entropy=True)
            lp, ent = out.logprobs, out.entropy
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                lp, ent = reference_forward(model, ids, mask, entropy=True)
        (lp * g_lp + ent * g_ent).sum().backward()
        results.append((lp.detach(), ent.detach(), {n: p.grad for n, p in model.named_parameters()}, model))
    return results


@pytest.mark.parametrize("precision", ["float32", "bf16-mixed"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_models_chunked_head_gives_the_whole_logits_log_probs_entropies_and_gradients(hf_folders, family, precision):
    (lp, ent, grads, model), (ref_lp, ref_ent, ref_grads, _) = chunked_and_full(hf_folders[family], precision, chunk=7)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (family != "qwen2")  # conftest ties llama and qwen3, not qwen2
    # The body is the same computation both ways; only the head's sums are ordered differently.
    torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=2e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    if precision == "float32":
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    else:
        # The body's backward runs in bf16: a float32-sized difference in the head's gradient flips the
        # bf16 rounding of some elements, and the flips compound layer by layer. The bound is
        # tests/test_precision.py's (bf16-mixed against float32) on the whole gradient; measured here
        # 1.4e-3 (llama), 4e-8 (qwen2), 3.3e-3 (qwen3).
        flat, ref = (torch.cat([g.flatten() for g in gs.values()]) for gs in (grads, ref_grads))
        assert (flat - ref).norm() < 5e-3 * ref.norm()
    # the head's own gradient is a large part of the embedding's when tied: it did reach it
    head_grad = grads["lm_head.weight" if not tied else "model.embed_tokens.weight"]
    assert head_grad.abs().sum() > 0


def test_only_the_scored_tokens_go_through_the_head_and_the_others_read_zero(hf_folders, monkeypatch):
    import pipeline.actors.head as head

    batch = make_batch(rows=5, width=14)
    model = load_policy(hf_folders["llama"], ActorConfig(head_chunk_tokens=4))
    rows_in = []

    def counted(hidden, *args, **kw):
        rows_in.append(hidden.shape[0])
        return chunked_token_logprobs(hidden, *args, **kw)

    monkeypatch.setattr(head, "chunked_token_logprobs", counted)
    forward = forward_in(model, ActorConfig())
    every = forward(batch.input_ids, batch.attention_mask, entropy=True)
    some = forward(batch.input_ids, batch.attention_mask, entropy=True, scored=batch.response_mask)
    real, response = batch.attention_mask.bool(), batch.response_mask.bool()
    # column 0 has no distribution; each scored token costs one row of the head, no pad or prompt token does
    assert rows_in == [int(real[:, 1:].sum()), int(response[:, 1:].sum())]
    for out in (some.logprobs, some.entropy):
        assert (out[~response] == 0).all()
    # the same values (chunks cut elsewhere can change a product's last bit)
    torch.testing.assert_close(some.logprobs[response], every.logprobs[response])
    torch.testing.assert_close(some.entropy[response], every.entropy[response])
    assert (every.logprobs[:, 1:][real[:, 1:]] != 0).all() and (every.logprobs[~real] == 0).all()


def test_a_model_whose_logits_are_post_processed_or_whose_head_has_a_bias_is_refused():
    model = make_hf_model("llama")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        install_head(model, 8)
    model = make_hf_model("llama")
    model.lm_head = torch.nn.Linear(64, 101, bias=True)
    with pytest.raises(ValueError, match="with a bias"):
        install_head(model, 8)


def largest_allocation(fn) -> int:
    """The most CPU memory any one operator (with what it calls) allocated and held at its end while
    fn ran, in bytes (torch.profiler's memory profile): at least the largest tensor created."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.cpu_memory_usage for e in prof.events())


def test_no_tensor_of_a_micro_batchs_tokens_times_vocabulary_is_allocated_in_forward_or_backward():
    """2,000 scored tokens and a 4,096-token vocabulary: whole float32 logits are 33 MB. The chunked
    head's largest allocation must be far under that; the whole-logits computation's is at least it
    (which shows the measure sees such a tensor)."""
    V, rows, width, chunk = 4096, 4, 501, 32
    model = make_hf_model("llama", vocab=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1)
    install_head(model, chunk)
    model.train()
    ids = torch.randint(3, V, (rows, width), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    whole = rows * (width - 1) * V * 4  # bytes of [tokens, V] float32

    def chunked():
        out = forward_in(model, ActorConfig(head_chunk_tokens=chunk))(ids, mask, entropy=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()

    def full():
        lp, ent = reference_forward(model, ids, mask, entropy=True)
        (lp.sum() + ent.sum()).backward()

    chunked_peak, full_peak = largest_allocation(chunked), largest_allocation(full)
    assert full_peak >= whole
    # the largest tensors left: one chunk's logits [32, V] and the head weight's gradient [V, 32] (512 kB
    # each), an operator holding at most two such
    assert chunked_peak <= 2 * max(chunk * V, V * 32) * 4 < whole / 16, (chunked_peak, whole)
