"""The `mtp` drafter computes MiMo's multi-token-prediction layer as vLLM serves it (checked against
Hugging Face's Qwen2 modules on the exported weights), and the export writes MiMo's layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2Model, Qwen2RMSNorm

from engine.backends.vllm_mtp import MTP, export_mtp, mtp_tensors, policy_tensors
from engine.checkpoint import load_checkpoint
from engine.spec.eagle import EagleConfig, EagleModel
from engine.spec.eagle_drafter import EagleDrafter


@pytest.fixture(scope="module")
def target(hf_folders):
    t = load_checkpoint(hf_folders["llama"], dtype=torch.float64)
    with torch.no_grad():  # a final norm that is not all ones: the drafter must divide it out exactly
        t.model.norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(3))
    return t


def mtp_net(target) -> EagleModel:
    torch.manual_seed(0)
    net = EagleModel(EagleConfig.for_target(target.config, "mtp"), target).double()
    with torch.no_grad():
        for norm in (net.token_norm, net.hidden_norm, net.final_norm, net.layers[0].input_layernorm):
            norm.weight.uniform_(0.5, 1.5)
    return net.eval()


def mimo_reference(net: EagleModel, target, hidden_pre, next_tokens, positions):
    """vLLM's MiMoMultiTokenPredictorLayer on the exported weights, from HF's Qwen2 modules: the
    target's pre-norm state and the next token in, the normed output (the LM head's input) out."""
    c = target.config
    w = {k.removeprefix(MTP): v for k, v in mtp_tensors(net.state_dict()).items()}
    H = c.hidden_size
    qcfg = Qwen2Config(vocab_size=c.vocab_size, hidden_size=H, intermediate_size=c.intermediate_size, num_hidden_layers=1,
                       num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                       rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
                       rope_theta=c.rope_theta, attn_implementation="eager", torch_dtype=torch.float64)
    block = Qwen2Model(qcfg).double().eval()  # its one layer is the MTP block, its final norm MiMo's final_layernorm
    state = {f"layers.0.{k}": v for k, v in w.items() if k.startswith(("self_attn.", "mlp.", "input_layernorm", "post_"))}
    state |= {"norm.weight": w["final_layernorm.weight"], "embed_tokens.weight": block.embed_tokens.weight}
    block.load_state_dict(state, strict=True)
    token_ln, hidden_ln = Qwen2RMSNorm(H, c.rms_norm_eps).double(), Qwen2RMSNorm(H, c.rms_norm_eps).double()
    token_ln.weight.data, hidden_ln.weight.data = w["token_layernorm.weight"], w["hidden_layernorm.weight"]
    emb = target.model.embed_tokens(next_tokens)
    emb = torch.where(positions[..., None] == 0, 0, emb)
    x = torch.cat([hidden_ln(hidden_pre), token_ln(emb)], -1) @ w["input_proj.weight"].t()
    return block(inputs_embeds=x, position_ids=positions).last_hidden_state


@torch.no_grad()
def test_mtp_drafter_computes_mimos_layer_from_the_post_norm_features(target):
    net = mtp_net(target)
    L = target.config.num_hidden_layers
    seq = torch.tensor([[5, 9, 14, 20, 7, 33, 2, 61, 8]])
    T = seq.shape[1] - 1
    out = target(seq[:, :T], torch.arange(T)[None], hidden_layers=(L - 1,))
    features, hidden_pre = out.hidden, out.layer_hidden[L - 1]  # [1, T, H] post-norm (what drafters get) and pre-norm
    positions = torch.arange(T)[None]
    pred = net(seq[:, 1:], features, positions)  # [1, T, H]
    ref = mimo_reference(net, target, hidden_pre, seq[:, 1:], positions)
    g = target.model.norm.weight
    assert torch.allclose(pred / g, ref, atol=1e-6)
    # Its logits are the target's LM head on MiMo's output, and feeding the prediction back gives
    # MiMo's next step on that output (vLLM feeds the MTP its own output as the next hidden state).
    assert torch.allclose(net.logits(pred), ref @ target.lm_head.weight.t(), atol=1e-6)
    again = net(seq[:, 2:], pred[:, :-1], positions[:, :-1])
    assert torch.allclose(again / g, mimo_reference(net, target, ref[:, :-1], seq[:, 2:], positions[:, :-1]), atol=1e-6)


@torch.no_grad()
def test_mtp_prediction_target_has_the_targets_logits(target):
    net = mtp_net(target)
    f = torch.randn(4, target.config.hidden_size, dtype=torch.float64)
    assert torch.allclose(net.logits(net.prediction_target(f)), f @ target.lm_head.weight.t(), atol=1e-9)


def test_mtp_drafter_round_trips_and_loads_as_mtp(target, tmp_path):
    net = mtp_net(target)
    net.save(tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"token_norm.weight", "hidden_norm.weight", "final_norm.weight", "layers.0.input_layernorm.weight"} <= names
    loaded = EagleDrafter.load(tmp_path, target, expect="mtp").net
    seq, pos = torch.tensor([[4, 8, 15, 16]]), torch.arange(4)[None]
    f = torch.randn(1, 4, target.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(net(seq, f, pos), loaded.double()(seq, f, pos))


def test_mtp_drafter_refuses_a_target_with_a_zero_norm_weight(target):
    g = target.model.norm.weight
    saved = g.detach().clone()
    try:
        with torch.no_grad():
            g[3] = 0.0
        with pytest.raises(ValueError, match="final-norm weights are all nonzero"):
            EagleModel(EagleConfig.for_target(target.config, "mtp"), target)
    finally:
        with torch.no_grad():
            g.copy_(saved)


def test_export_writes_mimos_layout(target, hf_folders, tmp_path):
    net = EagleModel(EagleConfig.for_target(target.config, "mtp"), target)
    net.save(tmp_path / "mtp")
    out = export_mtp(hf_folders["llama"], tmp_path / "mtp", tmp_path / "mimo")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MiMoForCausalLM"] and config["num_nextn_predict_layers"] == 1
    tensors = load_file(str(out / "model.safetensors"))
    policy = load_file(str(hf_folders["llama"] / "model.safetensors"))
    assert all(torch.equal(tensors[k], v) for k, v in policy.items())  # the policy unchanged
    L = config["num_hidden_layers"]
    biases = [f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(L) for p in "qkv"] + \
             [f"{MTP}self_attn.{p}_proj.bias" for p in "qkv"]
    assert all(k in tensors and not tensors[k].any() for k in biases)  # a Llama is a Qwen2 with zero biases
    H = config["hidden_size"]
    fc = net.fc.weight.detach()
    assert torch.equal(tensors[MTP + "input_proj.weight"], torch.cat([fc[:, H:], fc[:, :H]], 1))  # [hidden; emb]
    assert set(tensors) == set(policy_tensors(policy.items())) | set(mtp_tensors(net.state_dict()))


def test_export_refuses_an_eagle_drafter(target, hf_folders, tmp_path):
    EagleModel(EagleConfig.for_target(target.config, "eagle"), target).save(tmp_path / "eagle")
    with pytest.raises(ValueError, match="needs an mtp head"):
        export_mtp(hf_folders["llama"], tmp_path / "eagle", tmp_path / "out")
