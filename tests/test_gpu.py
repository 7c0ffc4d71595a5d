"""The engine on CUDA: same tokens as on CPU, and speculation still changes nothing."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.sampling import SamplingParams
from engine.spec.config import SpecConfig
from engine.spec.eagle import EagleConfig, EagleModel
from engine.spec.eagle_drafter import EagleDrafter
from engine.types import Request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has no GPU"),
]

PARAMS = SamplingParams(max_new_tokens=32, temperature=1.0, top_p=0.9, seed=3)


def requests() -> list[Request]:
    return [Request(prompt_id=f"g{i}", prompt=[5 + i, 9, 17, 4], n=2) for i in range(3)]


def test_cuda_rollouts_equal_cpu_rollouts(hf_folders):
    cpu = RolloutEngine(load_checkpoint(hf_folders["llama"], dtype=torch.float64), EngineConfig(max_batch=8, max_len=64))
    gpu = RolloutEngine(load_checkpoint(hf_folders["llama"], dtype=torch.float64, device="cuda"),
                        EngineConfig(max_batch=8, max_len=64, device="cuda"))
    assert [r.tokens for r in gpu.generate(requests(), PARAMS)] == [r.tokens for r in cpu.generate(requests(), PARAMS)]


def test_cuda_speculative_rollouts_equal_autoregressive(hf_folders):
    target = load_checkpoint(hf_folders["llama"], dtype=torch.float64, device="cuda")
    cfg = EngineConfig(max_batch=8, max_len=64, device="cuda", spec=SpecConfig(depth=4, topk=2, verify_tokens=6))
    torch.manual_seed(0)
    drafter = EagleDrafter(EagleModel(EagleConfig.for_target(target.config), target).double().cuda())
    ar = RolloutEngine(target, EngineConfig(max_batch=8, max_len=64, device="cuda")).generate(requests(), PARAMS)
    sp = RolloutEngine(target, cfg, drafter).generate(requests(), PARAMS)
    assert [r.tokens for r in sp] == [r.tokens for r in ar]


def test_cuda_actor_forward_without_a_padding_mask_equals_the_masked_forward_at_real_tokens(hf_folders):
    # pipeline.actors.forward.policy_forward gives the model no padding mask (right-padded rows,
    # causal attention); on CUDA the unmasked SDPA path must agree with the masked one too.
    from transformers import AutoModelForCausalLM

    from pipeline.actors.forward import policy_forward
    from tests.mp.actor_worker import make_batch

    model = AutoModelForCausalLM.from_pretrained(hf_folders["qwen2"], dtype=torch.float32).cuda().eval()
    batch = make_batch()
    ids, mask = batch.input_ids.cuda(), batch.attention_mask.cuda()
    with torch.no_grad():
        out = policy_forward(model, ids, mask)
        masked = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    picked = masked[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    real = mask[:, 1:].bool()
    torch.testing.assert_close(out.logprobs[:, 1:][real], picked[real], atol=1e-4, rtol=1e-4)
