"""The vLLM backend's pure parts, without vLLM: the drafter export, the tuner's schedule, the
speculative config and the counters' statistics (make test-vllm runs them against vLLM itself)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from common.buckets import buckets_of
from engine.backends.vllm_engine import VllmEngine, sample_seed, served_model, speculative_config
from engine.backends.vllm_export import EXPECTED, export_eagle, vllm_eagle_config
from engine.backends.vllm_schedule import schedule_from_tuner, vllm_schedule
from engine.config import EngineConfig
from engine.spec.config import SpecConfig
from engine.spec.eagle import EagleConfig, EagleModel
from engine.checkpoint import load_checkpoint
from engine.spec.tuner import Bandit
from engine.types import RolloutBatch


@pytest.fixture
def drafter_dir(hf_folders, tmp_path):
    target = load_checkpoint(hf_folders["llama"])
    torch.manual_seed(0)
    net = EagleModel(EagleConfig.for_target(target.config), target)
    net.save(tmp_path / "drafter")
    return tmp_path / "drafter", net


def test_the_export_is_a_one_layer_llama_with_the_drafters_weights_unrenamed(drafter_dir, tmp_path):
    path, net = drafter_dir
    out = export_eagle(path, tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["hidden_size"] == net.config.hidden_size and config["vocab_size"] == net.config.vocab_size
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == EXPECTED  # fc + layer 0, no input norm, no embedding, no LM head
    own = dict(net.named_parameters())
    assert all(torch.equal(weights[k], own[k].detach()) for k in weights)


def test_the_export_refuses_what_vllms_eagle_cannot_hold_and_says_what_to_do(drafter_dir):
    path, _ = drafter_dir
    base = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="--draft-vocab 0"):
        vllm_eagle_config({**base, "draft_vocab_size": 8})
    with pytest.raises(ValueError, match="eagle3_vllm drafter"):
        vllm_eagle_config({**base, "kind": "eagle3"})


def test_the_schedule_gives_each_bucket_its_best_arms_depth_and_covers_every_batch_size():
    arms, thresholds = ["off", "d2k1v2", "d4k2v6", "d8k1v8"], [1, 2, 5, 21]
    assert vllm_schedule(arms, thresholds, [3, 2, None, 0], 64, default_k=8) == [(1, 1, 8), (2, 4, 4), (5, 20, 8), (21, 64, 0)]
    assert vllm_schedule(arms, thresholds, [1, 1, 1, 1], 3, default_k=8) == [(1, 1, 2), (2, 3, 2)]  # cut at max_batch
    with pytest.raises(ValueError, match="start at 1"):
        vllm_schedule(arms, [2, 5], [0, 0], 8, 4)


def test_a_saved_tuners_best_arms_become_the_schedule():
    arms, thresholds = ["off", "d2k1v2", "d4k1v4"], [1, 4]
    bandit = Bandit(len(arms), thresholds)
    for arm, reward in ((0, 1.0), (1, 5.0), (2, 3.0)):
        bandit.update(0, arm, reward)  # batch 1-3: d2 pays best
    bandit.update(1, 0, 9.0)  # batch 4+: off
    assert schedule_from_tuner(bandit.state_dict(), arms, thresholds, 16, 4) == [(1, 3, 2), (4, 16, 0)]
    assert schedule_from_tuner(None, arms, thresholds, 16, 4) == [(1, 3, 4), (4, 16, 4)]


def test_the_speculative_config_follows_engine_spec(drafter_dir, tmp_path):
    path, _ = drafter_dir
    off = EngineConfig(backend="vllm")
    assert speculative_config(off, tmp_path) is None
    ngram = EngineConfig(backend="vllm", spec=SpecConfig(enabled=True, drafter="ngram", depth=3, verify_tokens=3))
    assert speculative_config(ngram, tmp_path) == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    tuned = EngineConfig(backend="vllm", max_batch=32, spec=SpecConfig(
        enabled=True, drafter="eagle", drafter_path=str(path), tuner_arms=["off", "d4k1v4"], tuner_buckets=[1, 8]))
    out = speculative_config(tuned, tmp_path)
    assert out["method"] == "eagle" and (tmp_path / "eagle" / "config.json").is_file()
    assert out["num_speculative_tokens"] == 4 and out["num_speculative_tokens_per_batch_size"] == [(1, 7, 4), (8, 32, 4)]
    composed = EngineConfig(backend="vllm", spec=SpecConfig(enabled=True, drafter="ngram+eagle", drafter_path=str(path)))
    assert not VllmEngine.serves(composed.spec.drafter_spec)  # declared on the class: a run's config is refused at load
    with pytest.raises(ValueError, match="eagle, eagle3_vllm, mtp, ngram"):
        speculative_config(composed, tmp_path)


def test_an_eagle3_vllm_drafter_exports_in_specforges_layout_with_d2t(hf_folders, tmp_path):
    target = load_checkpoint(hf_folders["llama"])
    vocab = torch.arange(0, 80, 2)
    net = EagleModel(EagleConfig.for_target(target.config, "eagle3_vllm", len(vocab)), target, vocab)
    net.save(tmp_path / "d")
    out = export_eagle(tmp_path / "d", tmp_path / "v")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 40
    L = target.config.num_hidden_layers
    assert L == 3 and config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # our layers + 1
    t = load_file(str(out / "model.safetensors"))
    H = target.config.hidden_size
    assert t["fc.weight"].shape == (H, 3 * H) and t["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert "midlayer.hidden_norm.weight" in t and "norm.weight" in t and t["lm_head.weight"].shape == (40, H)
    assert (torch.arange(40) + t["d2t"]).tolist() == vocab.tolist()  # vLLM maps draft id i to i + d2t[i]
    assert not any(k.startswith(("layers.", "embed_tokens")) for k in t)  # the embedding is the target's
    cfg = EngineConfig(backend="vllm", spec=SpecConfig(enabled=True, drafter="eagle3_vllm", drafter_path=str(tmp_path / "d"),
                                                       depth=2, verify_tokens=2))
    assert speculative_config(cfg, tmp_path)["method"] == "eagle3"


def test_an_mtp_drafter_is_served_inside_the_policys_mimo_export(hf_folders, tmp_path):
    target = load_checkpoint(hf_folders["llama"])
    EagleModel(EagleConfig.for_target(target.config, "mtp"), target).save(tmp_path / "mtp")
    cfg = EngineConfig(backend="vllm", spec=SpecConfig(enabled=True, drafter="mtp", drafter_path=str(tmp_path / "mtp"),
                                                       depth=2, verify_tokens=2))
    assert speculative_config(cfg, tmp_path) == {"method": "mtp", "num_speculative_tokens": 2}  # no draft model folder
    served = served_model(hf_folders["llama"], cfg, tmp_path)
    assert json.loads((served / "config.json").read_text())["architectures"] == ["MiMoForCausalLM"]
    assert served_model(hf_folders["llama"], EngineConfig(backend="vllm"), tmp_path) == hf_folders["llama"]


def test_pushes_are_cut_into_buckets_of_at_most_the_budget():
    named = [(f"w{i}", torch.zeros(256)) for i in range(10)]  # 1 KiB each
    sizes = [len(b) for b in buckets_of(iter(named), 3 * 1024)]
    assert sizes == [3, 3, 3, 1]
    assert [len(b) for b in buckets_of(iter([("big", torch.zeros(4096))]), 1024)] == [1]  # larger than the budget: alone


def test_seeds_key_on_run_step_prompt_and_sample():
    s = sample_seed(0, 3, "p1", 0)
    assert s == sample_seed(0, 3, "p1", 0) and len({s, sample_seed(1, 3, "p1", 0), sample_seed(0, 4, "p1", 0),
                                                    sample_seed(0, 3, "p2", 0), sample_seed(0, 3, "p1", 1)}) == 5


def test_a_batch_with_counters_only_reports_vllms_acceptance():
    batch = RolloutBatch(rollouts=[], steps=[], prefill_s=0.0, wall_s=2.0, policy_version=0,
                         counters={"drafts": 10, "draft_tokens": 40, "accepted_tokens": 30})
    stats = batch.stats
    assert stats.accept_rate == 0.75 and stats.accept_len == 4.0 and stats.speculative_steps == 10
