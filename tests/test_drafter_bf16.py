"""engine.spec.drafter_weights=bfloat16: the drafter's kernels stream bf16 copies of its weights;
engine.spec.drafter_products=bf16: they multiply in bf16 arithmetic. Proposals may change, the
tokens emitted never do."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.kernels.library import available
from engine.sampling import SamplingParams
from engine.spec.config import SpecConfig
from engine.spec.eagle import EagleConfig, EagleModel
from engine.spec.eagle_drafter import EagleDrafter
from engine.types import Request

OK, WHY = available()
pytestmark = pytest.mark.skipif(not OK, reason=f"CPU kernels unavailable here: {WHY}")


def requests() -> list[Request]:
    g = torch.Generator().manual_seed(4)
    return [Request(prompt_id=f"p{i}", prompt=torch.randint(3, 101, (3 + 2 * i,), generator=g).tolist(), n=2) for i in range(3)]


def drafter(target, bf16: bool = False, products: bool = False) -> EagleDrafter:
    torch.manual_seed(0)
    net = EagleModel(EagleConfig.for_target(target.config, "eagle"), target)
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(3.0)
    return EagleDrafter(net, bf16_weights=bf16, bf16_products=products)


@pytest.mark.parametrize("shape", [(6, 1, 6), (3, 2, 6)], ids=["chain", "tree"])
@pytest.mark.parametrize("mode", ["weights", "products"])
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=30, temperature=1.0, seed=3, stop_token_ids=(2,)),
                                    SamplingParams(max_new_tokens=30, temperature=0.0, stop_token_ids=(2,))],
                         ids=["T1", "greedy"])
def test_a_bf16_drafter_changes_no_token_and_keeps_its_float32_weights(hf_folders, params, mode, shape):
    target = load_checkpoint(hf_folders["llama"])
    reference = RolloutEngine(target, EngineConfig(max_batch=6, max_len=96)).generate(requests(), params)
    d = drafter(target, bf16=mode == "weights", products=mode == "products")
    before = {k: v.clone() for k, v in d.net.state_dict().items()}
    assert d.rt.products == {"weights": 1, "products": 2}[mode] and d.rt.fc.skinny.panels.dtype == torch.bfloat16
    depth, topk, verify = shape
    spec = SpecConfig(enabled=True, drafter="ngram", depth=depth, topk=topk, verify_tokens=verify)  # the drafter is given
    out = RolloutEngine(target, EngineConfig(max_batch=6, max_len=96, spec=spec), d).generate(requests(), params)
    assert [r.tokens for r in out] == [r.tokens for r in reference]
    assert [r.logprobs for r in out] == [r.logprobs for r in reference]
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    for k, v in d.net.state_dict().items():  # only the kernels' copies were rounded
        assert torch.equal(v, before[k]), k


def test_bf16_products_are_the_bf16_rounded_product_and_rows_stay_independent():
    from engine.kernels.skinny import SkinnyMatrix

    g = torch.Generator().manual_seed(0)
    for K, N, M in [(384, 192, 32), (193, 50, 7), (64, 21, 1)]:  # odd K (a padded pair), N past a panel
        w, x = torch.randn(K, N, generator=g), torch.randn(M, K, generator=g)
        bias, residual = torch.randn(N, generator=g), torch.randn(M, N, generator=g)
        sm = SkinnyMatrix(w, dot=True)
        want = x.bfloat16().double() @ w.bfloat16().double()
        for b, c, extra in [(bias, None, bias.double()), (None, residual, residual.double())]:
            y = sm.matmul(x, b, c)
            torch.testing.assert_close(y.double(), want + extra, rtol=0, atol=1e-4 * K ** 0.5)
            rows = torch.cat([sm.matmul(x[i : i + 1], b, None if c is None else c[i : i + 1]) for i in range(M)])
            assert torch.equal(y, rows)  # a row's result does not depend on the others
        assert (sm.matmul(x) - x @ w).abs().max() > 1e-3  # bf16 arithmetic, not float32's


def test_drafter_products_auto_follows_the_kernels_bf16_build(monkeypatch):
    from engine.kernels import library as lib
    from engine.spec.factory import bf16_products

    assert not bf16_products(SpecConfig(drafter_products="float32"))
    assert bf16_products(SpecConfig(drafter_products="bf16"))
    native = bool(lib.library().skinny_bf16dot_native())
    assert bf16_products(SpecConfig(drafter_products="auto")) == native
    monkeypatch.setattr(lib, "available", lambda: (False, "no compiler"))
    assert not bf16_products(SpecConfig(drafter_products="auto"))
    with pytest.raises(ValueError, match="drafter_products must be float32, bf16 or auto"):
        SpecConfig(drafter_products="fp8").validate()


def test_drafter_weights_must_name_a_dtype():
    with pytest.raises(ValueError, match="drafter_weights must be float32 or bfloat16"):
        SpecConfig(drafter_weights="fp16").validate()
