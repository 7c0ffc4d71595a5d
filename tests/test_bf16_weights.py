"""bf16 weights (engine.weights=bfloat16): the kernels stream bf16 matrices, the arithmetic stays
float32, so the engine serves exactly the float32 function of the bf16-rounded model, and
speculation still changes no token."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.kernels.library import available
from engine.kernels.skinny import SkinnyMatrix
from engine.runtime import TargetRuntime, round_matrices_to_bf16_
from tests.conftest import engine_error_without_kernels
from tests.spec_drafters import eagle_against_autoregressive

OK, WHY = available()
pytestmark = pytest.mark.skipif(not OK, reason=f"CPU kernels unavailable here: {WHY}")


@pytest.mark.parametrize("K,N", [(64, 96), (37, 50), (576, 192)])
def test_bf16_product_is_the_float32_product_over_the_rounded_matrix_bit_for_bit(K, N):
    torch.manual_seed(0)
    w, bias = torch.randn(K, N), torch.randn(N)
    half, rounded = SkinnyMatrix(w, bf16=True), SkinnyMatrix(w.bfloat16().float())
    assert half.panels.element_size() == 2
    for M in (1, 3, 9, 17, 40):
        x, res = torch.randn(M, K), torch.randn(M, N)
        assert torch.equal(half.matmul(x), rounded.matmul(x))
        assert torch.equal(half.matmul(x, bias=bias), rounded.matmul(x, bias=bias))
        assert torch.equal(half.matmul(x, residual=res), rounded.matmul(x, residual=res))
        torch.testing.assert_close(half.matmul(x), x @ w.bfloat16().float(), rtol=1e-5, atol=1e-4)


def test_bf16_product_row_does_not_depend_on_how_many_rows_share_the_call():
    torch.manual_seed(1)
    w, x = torch.randn(200, 130), torch.randn(21, 200)
    sm = SkinnyMatrix(w, bf16=True)
    full = sm.matmul(x)
    for i in (0, 5, 8, 20):
        assert torch.equal(sm.matmul(x[i : i + 1]), full[i : i + 1])


@pytest.fixture(scope="module")
def target(hf_folders):
    return load_checkpoint(hf_folders["llama"])


def test_bf16_runtime_serves_the_rounded_model_exactly(target):
    bf16 = TargetRuntime(copy.deepcopy(target), bf16_weights=True)
    rounded = copy.deepcopy(target)
    with torch.no_grad():
        round_matrices_to_bf16_(rounded)
    ref, fp32 = TargetRuntime(rounded), TargetRuntime(copy.deepcopy(target))
    ids = torch.tensor([[3, 17, 42, 8, 9, 11], [5, 6, 7, 1, 2, 30]])
    pos = torch.arange(6).expand(2, 6)
    with torch.inference_mode():
        assert torch.equal(bf16(ids, pos).logits, ref(ids, pos).logits)
        full = fp32(ids, pos).logits
        assert not torch.equal(bf16(ids, pos).logits, full)  # the rounding is real
        torch.testing.assert_close(bf16(ids, pos).logits, full, rtol=0, atol=0.05)
    norms = [p for p in bf16.model.parameters() if p.dim() == 1]
    assert norms and all(torch.equal(a, b) for a, b in zip(norms, [p for p in target.parameters() if p.dim() == 1]))


def test_load_weights_serves_the_new_weights_rounded(target):
    eng = RolloutEngine(copy.deepcopy(target), EngineConfig(max_batch=2, max_len=32, weights="bfloat16"))
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in target.state_dict().items()}
    eng.load_weights(new, version=1)
    for name, p in eng.model.named_parameters():
        expect = new[name].bfloat16().float() if p.dim() >= 2 else new[name]
        assert torch.equal(p.detach(), expect), name
    assert eng.runtime.stale() is None


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "T1"])
@pytest.mark.parametrize("topk", [1, 3], ids=["chain", "tree"])
def test_speculation_with_bf16_weights_changes_no_token(target, temperature, topk):
    reference, spec = eagle_against_autoregressive(target, temperature, topk, weights="bfloat16")
    for a, b in zip(reference, spec):
        assert (a.prompt_id, a.sample, a.tokens) == (b.prompt_id, b.sample, b.tokens)
        assert b.logprobs == a.logprobs


def test_bf16_weights_config_names_the_conflicting_keys():
    with pytest.raises(ValueError, match="engine.dtype=float32"):
        EngineConfig(weights="bfloat16", dtype="bfloat16").validate()
    with pytest.raises(ValueError, match="engine.weights must be"):
        EngineConfig(weights="int8").validate()


def test_bf16_weights_without_the_kernels_is_an_error_saying_what_to_use(hf_folders):
    err = engine_error_without_kernels(hf_folders["llama"], "weights='bfloat16'")
    assert "engine.weights=bfloat16" in err and "TAILSPEC_CPU_KERNELS=0" in err, err[-1500:]
