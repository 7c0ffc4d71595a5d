"""The eagle3_vllm drafter (vLLM's EAGLE-3 network): what it reads, what it feeds back, its refusals.
That it is vLLM's network is checked against vLLM itself (tests/vllm/test_vllm_drafter_kinds.py:
the same acceptance on the same prompts)."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.model_config import ModelConfig
from engine.spec.eagle import EagleConfig, EagleModel
from engine.spec.eagle3_vllm import Eagle3VllmModel


@pytest.fixture(scope="module")
def target(hf_folders):
    return load_checkpoint(hf_folders["llama"], dtype=torch.float64)


def net_for(target, vocab=None) -> Eagle3VllmModel:
    torch.manual_seed(0)
    cfg = EagleConfig.for_target(target.config, "eagle3_vllm", None if vocab is None else len(vocab))
    return EagleModel(cfg, target, vocab).double().eval()


@torch.no_grad()
def test_it_reads_three_target_levels_once_and_feeds_back_its_own_output(target):
    net = net_for(target)
    assert isinstance(net, Eagle3VllmModel) and len(net.config.aux_layers) == 3
    H, F = target.config.hidden_size, net.config.feature_size
    assert F == 4 * H  # three levels, then the final hidden (which only the loss reads)
    tokens, pos = torch.tensor([[4, 8, 15]]), torch.arange(3)[None]
    feats = torch.randn(1, 3, F, dtype=torch.float64)
    out = net(tokens, feats, pos)
    assert out.shape == (1, 3, H)
    # The final hidden does not enter the network; a fed-back prediction (H wide) passes fc by.
    other_final = torch.cat([feats[..., : 3 * H], torch.randn(1, 3, H, dtype=torch.float64)], -1)
    assert torch.equal(net(tokens, other_final, pos), out)
    assert torch.equal(net(tokens, net.encode(feats), pos), out)
    with pytest.raises(ValueError, match="features of width"):
        net(tokens, feats[..., : 2 * H], pos)


def test_its_lm_head_is_its_own_and_starts_as_the_targets_draft_rows(target):
    vocab = torch.arange(0, 40, 2)
    net = net_for(target, vocab)
    names = {n for n, _ in net.named_parameters()}
    assert "lm_head.weight" in names and "layers.0.hidden_norm.weight" in names
    assert torch.equal(net.lm_head.weight.detach(), target.lm_head.weight.detach()[vocab])
    assert net.layers[0].self_attn.q_proj.in_features == 2 * target.config.hidden_size


def test_the_feature_loss_compares_directions(target):
    net = net_for(target)
    x = torch.randn(5, target.config.hidden_size, dtype=torch.float64)
    assert torch.allclose(net.feature_view(x), net.feature_view(7.0 * x), atol=1e-6)


def test_a_target_with_fewer_than_three_layers_is_refused():
    cfg = ModelConfig(family="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="three distinct target layers"):
        EagleConfig.for_target(cfg, "eagle3_vllm")
