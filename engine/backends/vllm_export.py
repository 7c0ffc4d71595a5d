"""The project's EAGLE drafters in vLLM's format (`python -m engine.backends.vllm_export DRAFTER OUT`).

vLLM (0.32) serves an EAGLE-1 drafter for a Llama-style target as `EagleLlamaForCausalLM`: a
folder whose config.json names a one-layer `LlamaForCausalLM` and whose weights are `fc.weight`
(on cat(embedding, feature), in that order) and `layers.0.*` with no input norm on layer 0, no
embedding and no LM head: vLLM shares the target's. That is this project's EagleModel exactly
(engine.spec.eagle: fc over [emb, f_t], layer 0's input_layernorm is the identity, logits through
the target's head without a final norm), so the export renames nothing; it only writes vLLM's
config. What vLLM's EAGLE-1 cannot hold is refused with the reason: a reduced draft vocabulary
(it has no draft-to-target map for EAGLE-1) and this project's `eagle3` (one fc over [emb,
aux features] where vLLM's Eagle3 normalises embedding and hidden apart and widens attention's
input to 2H: a different network, not a renaming).

An `eagle3_vllm` drafter (engine.spec.eagle3_vllm) *is* vLLM's `Eagle3LlamaForCausalLM`: it is
written in SpecForge's layout, `fc.weight` over the three levels, `midlayer.*` (with
`hidden_norm` and 2H-wide q / k / v), `norm.weight`, its own `lm_head.weight` over the draft
vocabulary and `d2t` (draft id -> target id offset) when that vocabulary is reduced, with
`eagle_config.eagle_aux_hidden_state_layer_ids` = its target layers + 1 (vLLM counts the residual
stream entering a layer, this project the output of the one before).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from common.atomic import atomic_folder

LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
              "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
EXPECTED = {"fc.weight", *(f"layers.0.{k}" for k in LAYER_KEYS)}


def vllm_eagle_config(drafter: dict) -> dict:
    """vLLM's draft config.json from this project's drafter config.json."""
    if drafter.get("kind") != "eagle":
        raise ValueError(f"vLLM export supports this project's eagle and eagle3_vllm drafters, not {drafter.get('kind')!r}: "
                         "its eagle3 fuses embedding and features in one fc, vLLM's Eagle3 is a different network; "
                         "warm-start an eagle or eagle3_vllm drafter (spot.warmstart --kind eagle3_vllm) for the vLLM backend")
    if drafter.get("fc_bias"):
        raise ValueError("this drafter's fc has a bias (an EAGLE-1 checkpoint imported by spot.import_drafter) and vLLM's "
                         "EAGLE-1 fc has none: serve it with the native engine, or warm-start a drafter for the vLLM backend")
    if drafter.get("draft_vocab_size") not in (None, drafter["vocab_size"]):
        raise ValueError(f"this drafter proposes from a reduced vocabulary ({drafter['draft_vocab_size']} of "
                         f"{drafter['vocab_size']} tokens); vLLM's EAGLE-1 has no draft-to-target map: warm-start with "
                         "--draft-vocab 0 (the full vocabulary) for the vLLM backend")
    rope = dict(drafter.get("rope_scaling") or {"rope_type": "default"})
    rope.setdefault("rope_theta", drafter["rope_theta"])
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": drafter["hidden_size"], "intermediate_size": drafter["intermediate_size"],
        "num_attention_heads": drafter["num_attention_heads"], "num_key_value_heads": drafter["num_key_value_heads"],
        "head_dim": drafter["head_dim"], "rms_norm_eps": drafter["rms_norm_eps"], "vocab_size": drafter["vocab_size"],
        "max_position_embeddings": drafter["max_position_embeddings"], "rope_theta": drafter["rope_theta"],
        "rope_parameters": rope, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }


def vllm_eagle_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The drafter's weights under vLLM's names (the same names; the draft-vocab buffer dropped)."""
    out = {k: v for k, v in state.items() if k != "draft_vocab"}
    if set(out) != EXPECTED:
        missing, extra = sorted(EXPECTED - set(out)), sorted(set(out) - EXPECTED)
        raise ValueError(f"not an eagle drafter's weights: missing {missing[:4]}, unexpected {extra[:4]}")
    return {k: v.contiguous() for k, v in out.items()}


def vllm_eagle3_config(drafter: dict) -> dict:
    """vLLM's EAGLE-3 config.json from an eagle3_vllm drafter's config.json."""
    base = vllm_eagle_config(drafter | {"kind": "eagle", "draft_vocab_size": None})
    return base | {
        "architectures": ["LlamaForCausalLMEagle3"], "target_hidden_size": drafter["hidden_size"],
        "draft_vocab_size": drafter.get("draft_vocab_size") or drafter["vocab_size"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in drafter["aux_layers"]],
                         "use_aux_hidden_state": True},
    }


def vllm_eagle3_tensors(state: dict[str, torch.Tensor], draft_vocab: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """An eagle3_vllm drafter's weights under SpecForge / vLLM names (+ `d2t` for a reduced vocabulary)."""
    vocab = state.get("draft_vocab", draft_vocab)
    out = {}
    for name, t in state.items():
        if name == "draft_vocab":
            continue
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        elif name == "final_norm.weight":
            name = "norm.weight"
        elif name not in ("fc.weight", "lm_head.weight"):
            raise ValueError(f"eagle3_vllm weight {name!r} has no place in vLLM's EAGLE-3 layout")
        out[name] = t.contiguous()
    if vocab is not None and vocab.numel():
        out["d2t"] = (vocab.long() - torch.arange(vocab.numel())).contiguous()
    return out


def export_eagle(drafter_path: str | Path, out: str | Path) -> Path:
    """Writes vLLM's EAGLE (or EAGLE-3, for an eagle3_vllm drafter) folder for the drafter folder
    `drafter_path` (atomically); returns it."""
    drafter_path = Path(drafter_path)
    for name in ("config.json", "model.safetensors"):
        if not (drafter_path / name).is_file():
            raise FileNotFoundError(f"drafter folder {drafter_path} has no {name} (spot.warmstart writes both)")
    meta = json.loads((drafter_path / "config.json").read_text())
    state = load_file(str(drafter_path / "model.safetensors"))
    if meta.get("kind") == "eagle3_vllm":
        config, tensors = vllm_eagle3_config(meta), vllm_eagle3_tensors(state)
    else:
        config, tensors = vllm_eagle_config(meta), vllm_eagle_tensors(state)
    with atomic_folder(Path(out)) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"))
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.backends.vllm_export", description=__doc__.splitlines()[0])
    p.add_argument("drafter", help="this project's drafter folder (spot.warmstart --out)")
    p.add_argument("out", help="the vLLM EAGLE folder to write (speculative_config model)")
    args = p.parse_args(argv)
    try:
        print(f"wrote {export_eagle(args.drafter, args.out)}")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
