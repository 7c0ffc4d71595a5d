"""The decoder against transformers: same logits for every family, cache, save and load."""

from __future__ import annotations

import json

import pytest
import torch

from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.kv_cache import KVCache
from tests.conftest import FAMILIES, make_hf_model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def ours_logits(model, ids):
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, pos).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_for_each_family(family, hf_folders):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_folders[family]).eval()
    ours = load_checkpoint(hf_folders[family])
    ids = torch.randint(3, 101, (2, 17))
    assert torch.allclose(ours_logits(ours, ids), hf_logits(hf, ids), atol=1e-4)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_variants_match_transformers(rope, tmp_path):
    hf = make_hf_model("llama", rope_parameters={**rope, "rope_theta": 500000.0})
    hf.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path)
    ids = torch.randint(3, 101, (1, 200))
    assert torch.allclose(ours_logits(ours, ids), hf_logits(hf, ids), atol=1e-4)


def test_smollm2_logits_match_transformers(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = torch.tensor([tok("The capital of France is Paris, and the capital of Italy is")["input_ids"]])
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ours = load_checkpoint(smollm2_dir)
    assert ours.config.num_hidden_layers == 30 and ours.config.tie_word_embeddings
    assert torch.allclose(ours_logits(ours, ids), hf_logits(hf, ids), atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_decoding_with_cache_equals_full_forward(family, hf_folders):
    model = load_checkpoint(hf_folders[family], dtype=torch.float64)
    ids = torch.randint(3, 101, (3, 20))
    full = ours_logits(model, ids)
    cache = KVCache.for_model(model.config, max_batch=4, max_len=32, dtype=torch.float64)
    with torch.no_grad():
        out = model(ids[:, :7], torch.arange(7).expand(3, 7), cache=cache.rows(0, 3))
        cache.lengths[:3] = 7
        steps = [out.logits]
        for t in range(7, 20):
            steps.append(model(ids[:, t : t + 1], cache.lengths[:3, None], cache=cache).logits)
            cache.lengths[:3] += 1
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-10)


def test_rows_of_different_lengths_decode_together(hf_folders):
    model = load_checkpoint(hf_folders["llama"], dtype=torch.float64)
    a, b = torch.randint(3, 101, (1, 9)), torch.randint(3, 101, (1, 4))
    cache = KVCache.for_model(model.config, max_batch=2, max_len=16, dtype=torch.float64)
    padded = torch.cat([a, torch.cat([b, torch.zeros(1, 5, dtype=torch.long)], 1)])
    with torch.no_grad():
        model(padded, torch.arange(9).expand(2, 9), cache=cache)
        cache.lengths[:] = torch.tensor([9, 4])
        nxt = torch.tensor([[5], [6]])
        step = model(nxt, cache.lengths[:, None], cache=cache).logits[:, -1]
    ref_a = ours_logits(model, torch.cat([a, nxt[:1]], 1))[0, -1]
    ref_b = ours_logits(model, torch.cat([b, nxt[1:]], 1))[0, -1]
    assert torch.allclose(step[0], ref_a, atol=1e-10) and torch.allclose(step[1], ref_b, atol=1e-10)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_then_transformers_load_gives_same_logits(family, hf_folders, tmp_path):
    from transformers import AutoModelForCausalLM

    ours = load_checkpoint(hf_folders[family])
    save_checkpoint(ours, tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    ids = torch.randint(3, 101, (2, 11))
    assert torch.allclose(hf_logits(back, ids), ours_logits(ours, ids), atol=1e-5)


def test_hidden_layers_returns_outputs_of_chosen_layers(hf_folders):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_folders["llama"]).eval()
    ours = load_checkpoint(hf_folders["llama"])
    ids = torch.randint(3, 101, (1, 8))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True).hidden_states  # [embeddings, layer 0, ...]
        out = ours(ids, torch.arange(8)[None], hidden_layers=(0, 1))
    assert torch.allclose(out.layer_hidden[0], ref[1], atol=1e-5)
    assert torch.allclose(out.layer_hidden[1], ref[2], atol=1e-5)
    assert torch.allclose(out.hidden, ref[-1], atol=1e-5)


def test_missing_model_folder_error_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_checkpoint(tmp_path / "does-not-exist")


def test_unsupported_architecture_is_rejected_by_name(hf_folders, tmp_path):
    cfg = json.loads((hf_folders["llama"] / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_checkpoint(tmp_path)


def test_missing_weights_file_is_reported(hf_folders, tmp_path):
    (tmp_path / "config.json").write_text((hf_folders["llama"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_checkpoint(tmp_path)


def test_rope_table_gives_exactly_the_computed_values():
    from engine.rope import RopeSpec, RopeTable, inverse_frequencies, rope_cos_sin

    spec = RopeSpec(theta=10000.0, rope_type="yarn", params={"factor": 4.0, "original_max_position_embeddings": 64})
    inv_freq, factor = inverse_frequencies(spec, 32, 256)
    assert factor != 1.0
    table = RopeTable(300, inv_freq, factor, torch.float32)
    positions = torch.tensor([[0, 5, 299], [17, 17, 128]])
    for got, want in zip(table.lookup(positions), rope_cos_sin(positions, inv_freq, factor, torch.float32)):
        assert torch.equal(got, want)
