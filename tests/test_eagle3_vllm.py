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


@torch.no_grad()
def test_the_training_time_step_sees_what_a_fed_back_draft_sees(target):
    """fed_back's pair i (its feature the drafter's own prediction) equals the drafting step: pairs
    0..i-1 cached from the target's features, then pair i on the prediction, attending to them."""
    net = net_for(target)
    W, H = 6, target.config.hidden_size
    tokens = torch.tensor([[5, 9, 14, 20, 7, 33]])
    feats = torch.randn(1, W, net.config.feature_size, dtype=torch.float64)
    pos = torch.arange(W)[None]
    causal = torch.ones(W, W, dtype=torch.bool).tril()[None]
    pred = net(tokens, feats, pos, attn_mask=causal)  # [1, W, H]
    out2, valid = net.fed_back(tokens, feats, pred, pos, causal)
    assert out2.shape == (1, W - 1, H) and valid.all()
    for i in range(1, W):
        cache = net.new_cache(1, W + 1)
        slots = torch.arange(i)[None]
        net(tokens[:, :i], feats[:, :i], pos[:, :i], cache=cache, cache_pos=slots)
        cache.lengths[0] = i
        step = net(tokens[:, i : i + 1], pred[:, i - 1 : i], pos[:, i : i + 1], cache=cache, cache_pos=torch.tensor([[i]]))
        assert torch.allclose(step[0, 0], out2[0, i - 1], atol=1e-9), i
    # A pair whose predecessor lies in another segment has no fed-back step.
    two = causal.clone()
    two[:, 3:, :3] = False
    _, valid = net.fed_back(tokens, feats, pred, pos, two)
    assert valid.tolist() == [[True, True, False, True, True]]
