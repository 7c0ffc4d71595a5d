"""Rejection verification through the engine: rollouts follow the target distribution exactly."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.sampling import SamplingParams
from engine.spec.config import SpecConfig
from engine.spec.eagle import EagleConfig, EagleModel
from engine.spec.eagle_drafter import EagleDrafter
from tests.conftest import make_hf_model

V, PROMPT = 8, [1, 5, 3]


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("v8")
    make_hf_model("llama", vocab=V, seed=3, bos_token_id=1, eos_token_id=None, pad_token_id=0).save_pretrained(path)
    return load_checkpoint(path, dtype=torch.float64)


def exact_pair_distribution(model, temperature: float) -> torch.Tensor:
    """p(x2, x3) = sum_x1 p(x1) p(x2 | x1) p(x3 | x1, x2) for the target: [V, V]."""
    with torch.no_grad():
        seqs = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])  # [V*V, 5]
        logits = model(seqs, torch.arange(5).expand(V * V, 5)).logits.double() / temperature
    p1 = logits[0, 2].softmax(-1)  # [V]
    p2 = logits.view(V, V, 5, V)[:, 0, 3].softmax(-1)  # [x1, x2]
    p3 = logits.view(V, V, 5, V)[:, :, 4].softmax(-1)  # [x1, x2, x3]
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


def draw_pairs(model, drafter, topk: int, rows: int, temperature: float) -> torch.Tensor:
    spec = SpecConfig(enabled=True, depth=3, topk=topk, verify_tokens=3 if topk == 1 else 6, verify="rejection",
                      drafter_path="unused")
    engine = RolloutEngine(model, EngineConfig(max_batch=512, max_len=32, spec=spec), drafter)
    from engine.types import Request

    params = SamplingParams(max_new_tokens=3, temperature=temperature, seed=1)
    rollouts = engine.generate([Request(prompt_id=f"r{i}", prompt=PROMPT) for i in range(rows)], params)
    assert rollouts.stats.drafted > 0
    return torch.tensor([r.tokens[1:3] for r in rollouts])  # the tokens drawn by the verify steps


@pytest.mark.slow
@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
def test_rejection_mode_rollouts_follow_the_target_distribution(small_vocab_target, topk):
    torch.manual_seed(0)
    net = EagleModel(EagleConfig.for_target(small_vocab_target.config), small_vocab_target).double()
    drafter = EagleDrafter(net)  # untrained: its proposals differ from the target, acceptance is partial
    rows, T = 3000, 1.0
    pairs = draw_pairs(small_vocab_target, drafter, topk, rows, T)
    counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double()
    expected = exact_pair_distribution(small_vocab_target, T).flatten() * rows
    big = expected >= 5  # pool the rare cells so the chi-square approximation holds
    obs, exp = counts[big], expected[big]
    if (~big).any():
        obs, exp = torch.cat([obs, counts[~big].sum()[None]]), torch.cat([exp, expected[~big].sum()[None]])
    _, pvalue = chisquare(obs.numpy(), (exp / exp.sum() * obs.sum()).numpy())
    assert pvalue > 1e-3
