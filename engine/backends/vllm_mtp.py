"""A policy with its multi-token-prediction head in the layout vLLM's `mtp` method serves
(`python -m engine.backends.vllm_mtp TARGET DRAFTER OUT`).

Models that ship an MTP head (DeepSeek-V3, MiMo, Qwen3-Next, GLM-4.5; NeMo-RL's native path)
speculate in vLLM with `speculative_config={"method": "mtp"}`: the head is read from the policy's
own checkpoint, and vLLM shares the policy's embedding and LM head with it. Of vLLM's MTP models
the one whose backbone is this engine's (a Llama-style decoder) is Xiaomi's MiMo: a Qwen2 model
(`MiMoForCausalLM`) whose checkpoint adds `model.mtp_layers.0.*`. A Llama-style policy is a Qwen2
one with zero q / k / v biases, so the export writes the policy unchanged under Qwen2's config,
the zero biases, and this project's `mtp` drafter (engine.spec.eagle, which computes MiMo's
layer) under MiMo's names: `input_proj` (this project's `fc`, its halves swapped: MiMo reads
[hidden; embedding]), `token_layernorm`, `hidden_layernorm`, `final_layernorm`, and the block's
`self_attn.*`, `mlp.*` and norms. `mtp_tensors` gives the same names for a push of the head's new
weights after a spot window (VllmEngine.load_drafter_weights).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from common.atomic import atomic_folder

MTP = "model.mtp_layers.0."
RENAMED = {"token_norm.weight": "token_layernorm.weight", "hidden_norm.weight": "hidden_layernorm.weight",
           "final_norm.weight": "final_layernorm.weight"}


def mimo_config(target: dict) -> dict:
    """MiMo's config.json (Qwen2 fields, one MTP layer) for a Llama-style policy's config.json."""
    H, heads = target["hidden_size"], target["num_attention_heads"]
    if target.get("head_dim", H // heads) != H // heads:
        raise ValueError(f"vLLM's MiMo (Qwen2) derives head_dim as hidden_size / heads = {H // heads}, this policy has "
                         f"head_dim {target['head_dim']}: serve it with an eagle drafter instead of mtp")
    if target.get("attention_bias") or target.get("mlp_bias"):
        raise ValueError("the mtp export writes zero attention biases; this policy has its own: serve it with eagle")
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters",
            "rope_scaling", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype")
    out = {k: target[k] for k in keep if k in target}
    return out | {"architectures": ["MiMoForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
                  "use_sliding_window": False, "max_window_layers": target["num_hidden_layers"],
                  "num_nextn_predict_layers": 1}


def zero_biases(prefix: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen2's q / k / v biases, zero, for the attention whose weights are `prefix`self_attn.*."""
    return {f"{prefix}self_attn.{p}_proj.bias": torch.zeros(weights[f"{prefix}self_attn.{p}_proj.weight"].shape[0],
                                                            dtype=weights[f"{prefix}self_attn.{p}_proj.weight"].dtype)
            for p in "qkv"}


def mtp_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An mtp drafter's weights (engine.spec.eagle names) under MiMo's checkpoint names."""
    state = {k: v for k, v in state.items() if k != "draft_vocab"}
    if "token_norm.weight" not in state or "fc.weight" not in state:
        raise ValueError(f"not an mtp drafter's weights (no token_norm / fc): {sorted(state)[:4]}")
    out = {}
    for name, t in state.items():
        if name == "fc.weight":  # [H, 2H] over [emb; f] -> MiMo's input_proj over [hidden; emb]
            H = t.shape[0]
            out[MTP + "input_proj.weight"] = torch.cat([t[:, H:], t[:, :H]], 1).contiguous()
        elif name in RENAMED:
            out[MTP + RENAMED[name]] = t.contiguous()
        elif name.startswith("layers.0."):
            out[MTP + name.removeprefix("layers.0.")] = t.contiguous()
        else:
            raise ValueError(f"mtp drafter weight {name!r} has no place in MiMo's layout")
    return out | zero_biases(MTP, out)


def with_zero_biases(named):
    """A Llama-style policy's (name, tensor) pairs, streamed, each q / k / v weight followed by the zero
    bias MiMo's Qwen2 layers hold (a push re-sends them: vLLM's layerwise reload expects a layer whole)."""
    for name, t in named:
        yield name, t
        if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            yield name.removesuffix("weight") + "bias", torch.zeros(t.shape[0], dtype=t.dtype, device=t.device)


def policy_tensors(named) -> dict[str, torch.Tensor]:
    """A Llama-style policy's (name, tensor) pairs plus the zero q / k / v biases MiMo's Qwen2 layers hold."""
    return dict(with_zero_biases(named))


def export_mtp(target_path: str | Path, drafter_path: str | Path, out: str | Path) -> Path:
    """Writes the policy at `target_path` with the mtp drafter at `drafter_path` as its MTP head, in
    MiMo's layout, to `out` (atomically; tokenizer files copied); returns `out`."""
    target_path, drafter_path = Path(target_path), Path(drafter_path)
    for folder, what in ((target_path, "policy"), (drafter_path, "drafter")):
        for name in ("config.json", "model.safetensors"):
            if not (folder / name).is_file():
                raise FileNotFoundError(f"{what} folder {folder} has no {name}")
    drafter = json.loads((drafter_path / "config.json").read_text())
    if drafter.get("kind") != "mtp":
        raise ValueError(f"{drafter_path} holds a {drafter.get('kind')!r} drafter; vLLM's mtp method needs an mtp head "
                         "(spot.warmstart --kind mtp), or serve this one with engine.spec.drafter=eagle")
    if drafter.get("draft_vocab_size") not in (None, drafter["vocab_size"]):
        raise ValueError("an MTP head predicts over the full vocabulary: warm-start it with --draft-vocab 0")
    config = mimo_config(json.loads((target_path / "config.json").read_text()))
    tensors = policy_tensors(load_file(str(target_path / "model.safetensors")).items())
    tensors |= mtp_tensors(load_file(str(drafter_path / "model.safetensors")))
    with atomic_folder(Path(out)) as tmp:
        for f in target_path.iterdir():  # tokenizer and generation files
            if f.is_file() and f.name not in ("config.json", "model.safetensors") and not f.name.endswith(".pt"):
                shutil.copy2(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.backends.vllm_mtp", description=__doc__.splitlines()[0])
    p.add_argument("target", help="the policy's folder (config.json, model.safetensors, tokenizer)")
    p.add_argument("drafter", help="an mtp drafter folder (spot.warmstart --kind mtp --out)")
    p.add_argument("out", help="the folder to write: vLLM's model with speculative_config method mtp")
    args = p.parse_args(argv)
    try:
        print(f"wrote {export_mtp(args.target, args.drafter, args.out)}")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
