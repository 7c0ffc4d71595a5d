"""bf16 products (engine.products): the target's decoder products in bf16 arithmetic through the
row-independent CPU kernels. The served function differs from float32's (the rounding is real),
every pass computes it alike, so speculation still changes no token, and the model's weights and
LM head stay float32."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.kernels import skinny
from engine.kernels.library import available
from engine.packed import Product
from engine.runtime import TargetRuntime
from pipeline.update.learner import uses_engine_logprobs
from tests.conftest import engine_error_without_kernels
from tests.spec_drafters import eagle_against_autoregressive

OK, WHY = available()
pytestmark = pytest.mark.skipif(not OK, reason=f"CPU kernels unavailable here: {WHY}")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(hf_folders, request):
    return load_checkpoint(hf_folders[request.param])


def test_bf16_products_serve_a_rounded_function_near_float32_and_keep_the_weights(target):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    bf16, fp32 = TargetRuntime(copy.deepcopy(target), bf16_products=True), TargetRuntime(copy.deepcopy(target))
    ids = torch.tensor([[3, 17, 42, 8, 9, 11], [5, 6, 7, 1, 2, 30]])
    pos = torch.arange(6).expand(2, 6)
    with torch.inference_mode():
        a, b = bf16(ids, pos).logits, fp32(ids, pos).logits
    assert not torch.equal(a, b)  # the products really ran in bf16
    torch.testing.assert_close(a, b, rtol=0, atol=0.1)
    for k, v in bf16.model.state_dict().items():
        assert torch.equal(v, before[k]), k  # nothing rounded in place: the policy's weights stay float32
    assert bf16.head is not None and bf16.head.skinny is not None and not bf16.head.dot  # the LM head in float32


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "T1"])
@pytest.mark.parametrize("topk", [1, 3], ids=["chain", "tree"])
def test_speculation_with_bf16_products_changes_no_token(target, temperature, topk):
    reference, spec = eagle_against_autoregressive(target, temperature, topk, products="bf16")
    for a, b in zip(reference, spec):
        assert (a.prompt_id, a.sample, a.tokens) == (b.prompt_id, b.sample, b.tokens)
        assert b.logprobs == a.logprobs
    fp32, _ = eagle_against_autoregressive(target, temperature, topk, products="float32")
    assert any(a.logprobs != b.logprobs for a, b in zip(reference, fp32))  # another function than float32's


def test_rows_past_the_kernel_bound_compute_the_same_rounded_product(monkeypatch):
    torch.manual_seed(2)
    w, bias, x = torch.randn(96, 40), torch.randn(40), torch.randn(9, 96)
    p = Product(w, kernel=True, dot=True)
    kernel = p(x, bias=bias)
    monkeypatch.setattr(skinny, "MAX_ROWS", 4)  # a long prefill: torch's path
    torch_path = p(x, bias=bias)
    torch.testing.assert_close(torch_path, kernel, rtol=1e-5, atol=1e-5)  # the same function, up to summation order
    assert (torch_path - (x @ w + bias)).abs().max() > 1e-3  # and not float32's


def test_bf16_products_config_names_the_conflicting_keys_and_auto_follows_the_kernels(monkeypatch):
    with pytest.raises(ValueError, match="engine.products must be"):
        EngineConfig(products="fp8").validate()
    with pytest.raises(ValueError, match="engine.weights=float32"):
        EngineConfig(products="bf16", weights="bfloat16").validate()
    with pytest.raises(ValueError, match="engine.dtype=float32"):
        EngineConfig(products="bf16", dtype="bfloat16").validate()
    for native in (True, False):
        monkeypatch.setattr(skinny, "bf16_dot", lambda choice, native=native: choice == "bf16" or (choice == "auto" and native))
        assert EngineConfig(products="auto").bf16_products() is native
        assert EngineConfig(products="auto", weights="bfloat16").bf16_products() is False  # auto never conflicts
        assert EngineConfig(products="float32").bf16_products() is False


def test_bf16_products_log_probs_are_not_the_float32_policys_so_auto_recomputes_them(target):
    from pipeline.config import TrainerSection

    eng = RolloutEngine(copy.deepcopy(target), EngineConfig(max_batch=2, max_len=32, products="bf16"))
    assert not eng.caps.exact_logprobs
    assert RolloutEngine(copy.deepcopy(target), EngineConfig(max_batch=2, max_len=32)).caps.exact_logprobs
    assert not uses_engine_logprobs(TrainerSection(old_logprobs="auto"), True, eng.caps.exact_logprobs)
    assert uses_engine_logprobs(TrainerSection(old_logprobs="engine"), True, eng.caps.exact_logprobs)


def test_bf16_products_without_the_kernels_is_an_error_saying_what_to_use(hf_folders):
    err = engine_error_without_kernels(hf_folders["llama"], "products='bf16'")
    assert "engine.products=bf16" in err and "engine.products=float32 or auto" in err, err[-1500:]
