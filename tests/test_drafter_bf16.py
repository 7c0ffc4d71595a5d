"""engine.spec.drafter_weights=bfloat16: the drafter's kernels stream bf16 copies of its weights;
proposals may change, the tokens emitted never do."""

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


def drafter(target, bf16: bool) -> EagleDrafter:
    torch.manual_seed(0)
    net = EagleModel(EagleConfig.for_target(target.config, "eagle"), target)
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(3.0)
    return EagleDrafter(net, bf16_weights=bf16)


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=30, temperature=1.0, seed=3, stop_token_ids=(2,)),
                                    SamplingParams(max_new_tokens=30, temperature=0.0, stop_token_ids=(2,))],
                         ids=["T1", "greedy"])
def test_a_bf16_drafter_changes_no_token_and_keeps_its_float32_weights(hf_folders, params):
    target = load_checkpoint(hf_folders["llama"])
    reference = RolloutEngine(target, EngineConfig(max_batch=6, max_len=96)).generate(requests(), params)
    d = drafter(target, bf16=True)
    before = {k: v.clone() for k, v in d.net.state_dict().items()}
    assert d.rt.bf16 and d.rt.fc.skinny.panels.dtype == torch.bfloat16
    spec = SpecConfig(enabled=True, drafter="ngram", depth=6, topk=1, verify_tokens=6)  # the drafter is given
    out = RolloutEngine(target, EngineConfig(max_batch=6, max_len=96, spec=spec), d).generate(requests(), params)
    assert [r.tokens for r in out] == [r.tokens for r in reference]
    assert [r.logprobs for r in out] == [r.logprobs for r in reference]
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    for k, v in d.net.state_dict().items():  # only the kernels' copies were rounded
        assert torch.equal(v, before[k]), k


def test_drafter_weights_must_name_a_dtype():
    with pytest.raises(ValueError, match="drafter_weights must be float32 or bfloat16"):
        SpecConfig(drafter_weights="fp16").validate()
