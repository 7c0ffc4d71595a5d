"""Published EAGLE checkpoints (made up here, random weights in the published layouts) import as
drafters that draft the same tokens as the same weights built natively; mismatches are named."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from engine.backends.vllm_export import export_eagle
from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.sampling import SamplingParams
from engine.spec.config import SpecConfig
from engine.spec.eagle import EagleConfig, EagleModel, copy_named_weights
from engine.spec.eagle_drafter import EagleDrafter
from engine.types import Request
from spot.import_drafter import import_drafter
from tests.conftest import REPO, make_hf_model

LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


@pytest.fixture(scope="module")
def target_dir(hf_folders) -> Path:
    return hf_folders["llama"]


@pytest.fixture(scope="module")
def target(target_dir):
    return load_checkpoint(target_dir)


def drafter_hf_config(target, **extra) -> dict:
    """config.json as the EAGLE authors publish it: the target's LlamaConfig with one layer."""
    c = target.config
    return LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
                       num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps,
                       max_position_embeddings=c.max_position_embeddings).to_dict() | extra


def random_layer(prefix: str, H: int, I: int, nq: int, nkv: int, attn_in: int, g: torch.Generator) -> dict:
    shapes = {"self_attn.q_proj.weight": (nq, attn_in), "self_attn.k_proj.weight": (nkv, attn_in),
              "self_attn.v_proj.weight": (nkv, attn_in), "self_attn.o_proj.weight": (H, nq),
              "post_attention_layernorm.weight": (H,), "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H),
              "mlp.down_proj.weight": (H, I)}
    out = {}
    for k, shape in shapes.items():
        out[prefix + k] = (1 + 0.1 * torch.randn(shape, generator=g)) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.3
    return out


def write_eagle1(folder: Path, target, *, bias: bool, file: str, seed: int = 0, config: dict | None = None) -> dict:
    """A made-up EAGLE-1 checkpoint in the authors' layout (float16, with the target's embedding
    copied in); -> its tensors."""
    c = target.config
    H, I, hd = c.hidden_size, c.intermediate_size, c.head_dim
    g = torch.Generator().manual_seed(seed)
    t = {"fc.weight": torch.randn(H, 2 * H, generator=g) * 0.3,
         **random_layer("layers.0.", H, I, c.num_attention_heads * hd, c.num_key_value_heads * hd, H, g)}
    if bias:
        t["fc.bias"] = torch.randn(H, generator=g)
    t = {k: v.half() for k, v in t.items()}
    t["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().half()
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config or drafter_hf_config(target)))
    if file == "pytorch_model.bin":
        torch.save(t, folder / file)
    else:
        save_file(t, str(folder / file))
    return t


def write_eagle3(folder: Path, target, vocab: torch.Tensor, seed: int = 0, config: dict | None = None) -> dict:
    """A made-up EAGLE-3 checkpoint in SpecForge's / vLLM's layout (midlayer, norm, lm_head, d2t, t2d)."""
    c = target.config
    H, I, hd, V = c.hidden_size, c.intermediate_size, c.head_dim, c.vocab_size
    g = torch.Generator().manual_seed(seed)
    t = {"fc.weight": torch.randn(H, 3 * H, generator=g) * 0.2,
         **random_layer("midlayer.", H, I, c.num_attention_heads * hd, c.num_key_value_heads * hd, 2 * H, g),
         "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
         "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
         "norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
         "lm_head.weight": torch.randn(len(vocab), H, generator=g) * 0.5,
         "d2t": vocab - torch.arange(len(vocab)),
         "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, vocab, True)}
    folder.mkdir(parents=True)
    cfg = drafter_hf_config(target, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=len(vocab),
                            target_hidden_size=H, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]})
    (folder / "config.json").write_text(json.dumps(config or cfg))
    save_file(t, str(folder / "model.safetensors"))
    return t


def native(target, kind: str, tensors: dict, bias: bool = False, vocab=None) -> EagleModel:
    """The same weights built as this project's network directly (vLLM's names mapped by hand)."""
    cfg = EagleConfig.for_target(target.config, kind, None if vocab is None else len(vocab))
    net = EagleModel(dataclasses.replace(cfg, fc_bias=bias), target, vocab)
    rename = {"norm.weight": "final_norm.weight"}
    named = [(rename.get(k, k.replace("midlayer.", "layers.0.")), v.float()) for k, v in tensors.items()
             if k not in ("embed_tokens.weight", "d2t", "t2d")]
    copy_named_weights(net, named)
    return net


def engine_drafts(target, net: EagleModel, topk: int) -> tuple[list, list]:
    """Every draft tree the engine asked the drafter for while generating, and the rollouts."""
    drafter = EagleDrafter(net)
    trees = []
    propose = drafter.propose
    drafter.propose = lambda ctx: trees.append(propose(ctx)) or trees[-1]
    cfg = EngineConfig(max_batch=4, max_len=96, spec=SpecConfig(depth=4, topk=topk,
                                                               verify_tokens=4 if topk == 1 else 6))
    g = torch.Generator().manual_seed(3)
    reqs = [Request(prompt_id=f"p{i}", prompt=torch.randint(3, 101, (4 + 3 * i,), generator=g).tolist(), n=2)
            for i in range(2)]
    out = RolloutEngine(target, cfg, drafter).generate(reqs, SamplingParams(max_new_tokens=16, temperature=1.0, seed=7))
    return [(t.tokens.tolist(), t.parents.tolist()) for t in trees], [r.tokens for r in out]


@pytest.mark.parametrize("bias,file", [(True, "pytorch_model.bin"), (False, "model.safetensors")],
                         ids=["bias-bin", "nobias-safetensors"])
@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
def test_an_imported_eagle1_checkpoint_drafts_the_tokens_of_its_weights_built_natively(target, target_dir, tmp_path,
                                                                                      bias, file, topk):
    tensors = write_eagle1(tmp_path / "published", target, bias=bias, file=file)
    summary = import_drafter("eagle", tmp_path / "published", target_dir, tmp_path / "drafter")
    assert summary["kind"] == "eagle" and summary["weights"] == file and summary["embedding_rel_diff"] < 1e-2
    imported = EagleModel.load(tmp_path / "drafter", target)
    assert imported.config.fc_bias == bias
    trees, rollouts = engine_drafts(target, imported, topk)
    same_trees, same_rollouts = engine_drafts(target, native(target, "eagle", tensors, bias), topk)
    assert len(trees) > 10 and trees == same_trees and rollouts == same_rollouts
    # The check has power: fc's halves swapped ([hidden; embedding], a plausible import mistake) drafts otherwise.
    H = target.config.hidden_size
    swapped = dict(tensors, **{"fc.weight": torch.cat([tensors["fc.weight"][:, H:], tensors["fc.weight"][:, :H]], 1)})
    assert engine_drafts(target, native(target, "eagle", swapped, bias), topk)[0] != trees


@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
def test_an_imported_eagle3_checkpoint_drafts_the_tokens_of_its_weights_built_natively(target, target_dir, tmp_path, topk):
    vocab = torch.arange(1, 101, 2)  # 50 of 101 ids
    tensors = write_eagle3(tmp_path / "published", target, vocab)
    summary = import_drafter("eagle3", tmp_path / "published", target_dir, tmp_path / "drafter")
    assert summary["kind"] == "eagle3_vllm" and summary["notes"] == []
    imported = EagleModel.load(tmp_path / "drafter", target)
    assert imported.config.aux_layers == [0, 1, 2] and imported.vocab_ids.tolist() == vocab.tolist()
    trees, rollouts = engine_drafts(target, imported, topk)
    same_trees, same_rollouts = engine_drafts(target, native(target, "eagle3_vllm", tensors, vocab=vocab), topk)
    assert len(trees) > 10 and trees == same_trees and rollouts == same_rollouts
    assert all(t in vocab.tolist() for tokens, _ in trees for t in tokens)  # drafts come from d2t's ids
    shifted = dict(tensors, **{"midlayer.hidden_norm.weight": tensors["midlayer.input_layernorm.weight"]})
    assert engine_drafts(target, native(target, "eagle3_vllm", shifted, vocab=vocab), topk)[0] != trees


def test_the_eagle3_import_is_the_inverse_of_the_vllm_export(target, target_dir, tmp_path):
    vocab = torch.arange(0, 80, 2)
    tensors = write_eagle3(tmp_path / "published", target, vocab)
    import_drafter("eagle3", tmp_path / "published", target_dir, tmp_path / "drafter")
    back = load_file(str(export_eagle(tmp_path / "drafter", tmp_path / "vllm") / "model.safetensors"))
    assert set(back) == set(tensors) - {"t2d"}
    assert all(torch.equal(back[k], tensors[k]) for k in back)
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and config["draft_vocab_size"] == 40


def test_without_layer_ids_eagle3_reads_vllms_default_layers(tmp_path):
    deep = make_hf_model("llama", num_hidden_layers=8)
    deep.save_pretrained(tmp_path / "target")
    target = load_checkpoint(tmp_path / "target")
    cfg = drafter_hf_config(target, draft_vocab_size=101)
    write_eagle3(tmp_path / "published", target, torch.arange(101), config=cfg)
    summary = import_drafter("eagle3", tmp_path / "published", tmp_path / "target", tmp_path / "drafter")
    net = EagleModel.load(tmp_path / "drafter", target)
    assert net.config.aux_layers == [1, 3, 4]  # vLLM's (2, L/2, L-3) for L = 8, one layer below each
    assert net.vocab_ids is None  # d2t all zeros over the full vocabulary
    assert "vLLM's default [2, 4, 5]" in summary["notes"][0]


def test_an_input_norm_and_a_foreign_embedding_are_reported_not_used(target, target_dir, tmp_path):
    tensors = write_eagle1(tmp_path / "p", target, bias=False, file="model.safetensors")
    tensors["layers.0.input_layernorm.weight"] = torch.ones(target.config.hidden_size).half()
    tensors["embed_tokens.weight"] = (tensors["embed_tokens.weight"].float() + 0.5).half()
    save_file(tensors, str(tmp_path / "p" / "model.safetensors"))
    summary = import_drafter("eagle", tmp_path / "p", target_dir, tmp_path / "d")
    assert summary["embedding_rel_diff"] > 1e-2
    assert any("input_layernorm.weight dropped" in n for n in summary["notes"])
    assert any("trained for another model" in n for n in summary["notes"])
    assert "layers.0.input_layernorm.weight" not in load_file(str(tmp_path / "d" / "model.safetensors"))


def test_a_drafter_for_another_model_is_refused_naming_each_size(target, target_dir, tmp_path):
    cfg = drafter_hf_config(target) | {"hidden_size": 32, "vocab_size": 200}
    write_eagle1(tmp_path / "p", target, bias=False, file="model.safetensors", config=cfg)
    with pytest.raises(ValueError, match=r"hidden_size 32 \(the target's: 64\), vocab_size 200 \(the target's: 101\)"):
        import_drafter("eagle", tmp_path / "p", target_dir, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_a_tensor_whose_shape_the_config_contradicts_is_named_with_the_key_that_sets_it(target, target_dir, tmp_path):
    cfg = drafter_hf_config(target) | {"num_key_value_heads": 4}  # the file's k / v have 2 heads
    write_eagle1(tmp_path / "p", target, bias=False, file="model.safetensors", config=cfg)
    with pytest.raises(ValueError, match=r"layers.0.self_attn.k_proj.weight has shape \(32, 64\), expected \(64, 64\) "
                                         r"\(num_key_value_heads 4 x head_dim 16"):
        import_drafter("eagle", tmp_path / "p", target_dir, tmp_path / "d")


def test_missing_and_extra_tensors_and_a_second_layer_are_named(target, target_dir, tmp_path):
    tensors = write_eagle1(tmp_path / "p", target, bias=False, file="model.safetensors")
    del tensors["layers.0.mlp.up_proj.weight"]
    tensors["layers.0.self_attn.q_proj.bias"] = torch.zeros(64).half()
    save_file(tensors, str(tmp_path / "p" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['layers.0.mlp.up_proj.weight'\]; unexpected \['layers.0.self_attn.q_proj.bias'\]"):
        import_drafter("eagle", tmp_path / "p", target_dir, tmp_path / "d")
    write_eagle1(tmp_path / "two", target, bias=False, file="model.safetensors",
                 config=drafter_hf_config(target) | {"num_hidden_layers": 2})
    with pytest.raises(ValueError, match="a drafter of 2 layers"):
        import_drafter("eagle", tmp_path / "two", target_dir, tmp_path / "d")


def test_eagle3_vocabulary_maps_that_disagree_are_refused(target, target_dir, tmp_path):
    vocab = torch.arange(0, 80, 2)
    tensors = write_eagle3(tmp_path / "p", target, vocab)
    tensors["t2d"] = torch.roll(tensors["t2d"], 1)
    save_file(tensors, str(tmp_path / "p" / "model.safetensors"))
    with pytest.raises(ValueError, match="t2d and d2t disagree"):
        import_drafter("eagle3", tmp_path / "p", target_dir, tmp_path / "d")
    del tensors["d2t"], tensors["t2d"]
    save_file(tensors, str(tmp_path / "p" / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight has 40 rows but there is no d2t"):
        import_drafter("eagle3", tmp_path / "p", target_dir, tmp_path / "d")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spot.import_drafter", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_cli_writes_the_drafter_and_names_a_missing_checkpoint(target, target_dir, tmp_path):
    write_eagle1(tmp_path / "p", target, bias=True, file="pytorch_model.bin")
    ok = run_cli("--format", "eagle", "--checkpoint", str(tmp_path / "p"), "--target", str(target_dir), "--out",
                 str(tmp_path / "d"))
    assert ok.returncode == 0, ok.stderr
    assert "engine.spec.drafter=eagle" in ok.stdout and (tmp_path / "d" / "model.safetensors").is_file()
    bad = run_cli("--format", "eagle", "--checkpoint", str(tmp_path / "nope"), "--target", str(target_dir), "--out",
                  str(tmp_path / "e"))
    assert bad.returncode == 1 and "error:" in bad.stderr and str(tmp_path / "nope") in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "e").exists()


def test_an_fc_bias_is_refused_where_the_network_has_none(target, target_dir, tmp_path):
    write_eagle1(tmp_path / "p", target, bias=True, file="model.safetensors")
    import_drafter("eagle", tmp_path / "p", target_dir, tmp_path / "d")
    with pytest.raises(ValueError, match="vLLM's EAGLE-1 fc has none"):
        export_eagle(tmp_path / "d", tmp_path / "vllm")
    with pytest.raises(ValueError, match="a mtp drafter's fc has no bias"):
        dataclasses.replace(EagleConfig.for_target(target.config, "mtp"), fc_bias=True)
