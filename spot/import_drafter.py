"""Import a published EAGLE drafter checkpoint as this project's drafter folder.

    python -m spot.import_drafter --format eagle|eagle3 --checkpoint DIR --target DIR --out DIR

`eagle`: EAGLE-1 as its authors publish it, a one-layer Llama: config.json (hidden_size,
intermediate_size, heads, rms_norm_eps, rope) and `fc.weight` [H, 2H] over [embed(x_{t+1}); f_t]
(+ `fc.bias` [H]), `layers.0.self_attn.{q,k,v,o}_proj.weight`, `layers.0.mlp.{gate,up,down}_proj
.weight`, `layers.0.post_attention_layernorm.weight`; f_t is the target's final hidden state after
its final norm. That is kind `eagle` exactly (engine.spec.eagle: layer 0's input norm is the
identity, the target's embedding and LM head, no final norm), so the names stay; a
`layers.0.input_layernorm.weight` in the file is not applied by EAGLE-1 and is dropped, with a note.

`eagle3`: EAGLE-3 in vLLM's / SpecForge's layout (`Eagle3LlamaForCausalLM`): `fc.weight` [H, 3H]
over three target layers, `midlayer.*` (or `layers.0.*`: q / k / v read 2H, `hidden_norm`),
`norm.weight`, its own `lm_head.weight` [draft_vocab_size, H], `d2t` (draft id i is target id
i + d2t[i]; absent for the full vocabulary) and optionally `t2d` (checked against d2t); config.json's
`eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`; vLLM's default (2, L/2, L-3)
when absent) name the residual stream entering those layers, here the outputs of the layers one
below. That is kind `eagle3_vllm` (engine.spec.eagle3_vllm): `midlayer.` becomes `layers.0.`,
`norm` `final_norm`, d2t the draft vocabulary. The inverse of engine.backends.vllm_export.

Weights are read from model.safetensors (or its sharded index) or pytorch_model.bin, and stored
as float32. An `embed_tokens.weight` in the file is a copy of a target's embedding: the drafter
reads its target's (as vLLM does), and the import reports how far the copy is from this target's
(a large difference: a drafter trained for another model of the same shape). The target's
config.json (and its embedding) is all that is read of the target: importing a drafter for a
large model needs no memory for it. Every mismatch is a ValueError naming it: hidden size and
vocabulary against the target, each tensor's shape against what the checkpoint's config implies.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from common.atomic import atomic_folder
from engine.checkpoint import load_state_dict, read_config
from engine.model_config import ModelConfig
from engine.spec.eagle import EagleConfig, write_drafter

FORMATS = {"eagle": "eagle", "eagle3": "eagle3_vllm"}  # published format -> this project's drafter kind
LEVELS = 3  # EAGLE-3 reads three target layers
EMBED_REL_TOL = 1e-2  # a half-precision copy of the same embedding is within ~1e-3 of its largest entry


@dataclass
class Imported:
    """A checkpoint mapped into this project's names: its config, weights and what the import noticed."""

    config: EagleConfig
    state: dict[str, torch.Tensor]  # EagleModel's names (+ `draft_vocab`), float32
    notes: list[str] = field(default_factory=list)


def read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    """-> (the checkpoint's tensors by name, the file they came from)."""
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return load_state_dict(folder), "model.safetensors"
    if (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"{folder / 'pytorch_model.bin'} is not a state dict of tensors")
        return state, "pytorch_model.bin"
    raise FileNotFoundError(f"{folder} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin: "
                            "point --checkpoint at the drafter's folder as published")


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a published drafter folder holds config.json beside its weights")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def layer_geometry(hf: dict, where: Path) -> ModelConfig:
    """The drafter layer's hyper-parameters from its config.json (a Llama layer, whatever the
    architecture name: EAGLE's drafters are Llama layers for every target family)."""
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in hf]
    if missing:
        raise ValueError(f"{where} has no {', '.join(missing)}: not a drafter config")
    layers = hf.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"{where} describes a drafter of {layers} layers (num_hidden_layers); this project's drafters "
                         "have one")
    return ModelConfig.from_hf({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1})


def check_target(g: ModelConfig, target: ModelConfig, where: Path) -> list[str]:
    """ValueError naming every size that does not match the target; -> notes on a layer geometry
    that differs (allowed: the layer has its own attention and KV cache)."""
    wrong = [f"{k} {getattr(g, k)} (the target's: {getattr(target, k)})" for k in ("hidden_size", "vocab_size")
             if getattr(g, k) != getattr(target, k)]
    heads = [f"{k} {getattr(g, k)} (the target's: {getattr(target, k)})"
             for k in ("num_attention_heads", "num_key_value_heads", "head_dim") if getattr(g, k) != getattr(target, k)]
    if wrong:
        raise ValueError(f"{where} is a drafter for another model: {', '.join(wrong + heads)}; import a drafter "
                         "published for this target")
    return [f"the drafter layer's own attention geometry differs from the target's: {', '.join(heads)}"] if heads else []


def layer_shapes(cfg: EagleConfig, prefix: str, attn_in: int, attn_in_why: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, the config keys that set it) for one decoder layer whose q / k / v read attn_in inputs."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    q_why = f"num_attention_heads {cfg.num_attention_heads} x head_dim {hd} outputs over {attn_in_why} inputs"
    kv_why = f"num_key_value_heads {cfg.num_key_value_heads} x head_dim {hd} outputs over {attn_in_why} inputs"
    return {
        f"{prefix}self_attn.q_proj.weight": ((nq, attn_in), q_why),
        f"{prefix}self_attn.k_proj.weight": ((nkv, attn_in), kv_why),
        f"{prefix}self_attn.v_proj.weight": ((nkv, attn_in), kv_why),
        f"{prefix}self_attn.o_proj.weight": ((H, nq), f"hidden_size {H} outputs over the heads' {nq}"),
        f"{prefix}post_attention_layernorm.weight": ((H,), f"hidden_size {H}"),
        f"{prefix}mlp.gate_proj.weight": ((I, H), f"intermediate_size {I} x hidden_size {H}"),
        f"{prefix}mlp.up_proj.weight": ((I, H), f"intermediate_size {I} x hidden_size {H}"),
        f"{prefix}mlp.down_proj.weight": ((H, I), f"hidden_size {H} x intermediate_size {I}"),
    }


def check_shapes(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[tuple[int, ...], str]], where: Path) -> None:
    """ValueError naming missing and unexpected tensors and every shape that is not what the config implies."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [f"{k} has shape {tuple(tensors[k].shape)}, expected {expected[k][0]} ({expected[k][1]})"
             for k in sorted(set(expected) & set(tensors)) if tuple(tensors[k].shape) != expected[k][0]]
    problems = ([f"missing {missing}"] if missing else []) + ([f"unexpected {unexpected}"] if unexpected else []) + wrong
    if problems:
        raise ValueError(f"{where} does not hold the layout its format and config.json describe: " + "; ".join(problems))


def base_config(kind: str, g: ModelConfig, target: ModelConfig, **kw) -> EagleConfig:
    return EagleConfig(
        kind=kind, hidden_size=g.hidden_size, intermediate_size=g.intermediate_size,
        num_attention_heads=g.num_attention_heads, num_key_value_heads=g.num_key_value_heads, head_dim=g.head_dim,
        rms_norm_eps=g.rms_norm_eps, vocab_size=target.vocab_size, max_position_embeddings=g.max_position_embeddings,
        rope_theta=g.rope_theta, rope_scaling=g.rope_scaling, **kw,
    )


def map_eagle(tensors: dict[str, torch.Tensor], hf: dict, target: ModelConfig, where: Path) -> Imported:
    """EAGLE-1 -> kind eagle (the same names; layer 0's input norm dropped)."""
    g = layer_geometry(hf, where / "config.json")
    notes = check_target(g, target, where / "config.json")
    tensors = dict(tensors)
    if tensors.pop("layers.0.input_layernorm.weight", None) is not None:
        notes.append("layers.0.input_layernorm.weight dropped: EAGLE-1 does not apply layer 0's input norm")
    cfg = base_config("eagle", g, target, fc_bias="fc.bias" in tensors)
    H = cfg.hidden_size
    expected = {"fc.weight": ((H, 2 * H), f"hidden_size {H} over [embedding; hidden] = 2 x {H}"),
                **layer_shapes(cfg, "layers.0.", H, f"hidden_size {H}")}
    if cfg.fc_bias:
        expected["fc.bias"] = ((H,), f"hidden_size {H}")
    check_shapes(tensors, expected, where)
    return Imported(cfg, {k: v.float().contiguous() for k, v in tensors.items()}, notes)


def aux_layer_ids(hf: dict, target: ModelConfig, where: Path) -> tuple[list[int], list[str]]:
    """vLLM's `eagle_aux_hidden_state_layer_ids` (the residual stream entering each layer) ->
    (this engine's aux layers: the outputs of the layers one below, notes)."""
    ids = hf.get("eagle_aux_hidden_state_layer_ids", (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
    L = target.num_hidden_layers
    notes = []
    if ids is None:
        ids = [2, L // 2, L - 3]
        notes.append(f"no eagle_aux_hidden_state_layer_ids in config.json: vLLM's default {ids} for a {L}-layer target")
    if len(ids) != LEVELS or not all(isinstance(i, int) and 1 <= i <= L for i in ids):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {ids} must be {LEVELS} layer ids in 1..{L} (the "
                         f"residual stream entering that layer of this {L}-layer target; 0, the embeddings, is not a "
                         "layer this engine returns)")
    return [i - 1 for i in ids], notes


def draft_vocabulary(tensors: dict[str, torch.Tensor], rows: int, vocab_size: int, where: Path) -> torch.Tensor | None:
    """d2t (and t2d) -> the draft vocabulary's target ids [Vd], or None for the full vocabulary."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None:
        if rows != vocab_size:
            raise ValueError(f"{where}: lm_head.weight has {rows} rows but there is no d2t mapping them to the target's "
                             f"{vocab_size} ids")
        ids = torch.arange(vocab_size)
    else:
        if tuple(d2t.shape) != (rows,):
            raise ValueError(f"{where}: d2t has shape {tuple(d2t.shape)}, expected ({rows},) (draft_vocab_size)")
        ids = torch.arange(rows) + d2t.long()
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != rows:
            raise ValueError(f"{where}: d2t maps draft ids outside the target's {vocab_size} ids or onto one id twice")
    if t2d is not None:
        if tuple(t2d.shape) != (vocab_size,):
            raise ValueError(f"{where}: t2d has shape {tuple(t2d.shape)}, expected ({vocab_size},) (the target's vocab)")
        if t2d.bool().nonzero().flatten().tolist() != sorted(ids.tolist()):
            raise ValueError(f"{where}: t2d and d2t disagree about which target ids the draft vocabulary holds")
    return None if rows == vocab_size and torch.equal(ids, torch.arange(vocab_size)) else ids


def map_eagle3(tensors: dict[str, torch.Tensor], hf: dict, target: ModelConfig, where: Path) -> Imported:
    """vLLM's EAGLE-3 -> kind eagle3_vllm (midlayer -> layers.0, norm -> final_norm, d2t -> draft vocabulary)."""
    g = layer_geometry(hf, where / "config.json")
    notes = check_target(g, target, where / "config.json")
    if hf.get("target_hidden_size", g.hidden_size) != g.hidden_size:
        raise ValueError(f"{where / 'config.json'}: the drafter is {g.hidden_size} wide over a target of "
                         f"target_hidden_size {hf['target_hidden_size']}; this project's eagle3_vllm has its target's width")
    if hf.get("norm_before_residual"):
        raise ValueError(f"{where / 'config.json'}: norm_before_residual=true is another EAGLE-3 variant (the residual "
                         "is the normed hidden state); this project's eagle3_vllm adds the un-normed one")
    layer_prefixes = {k.split(".")[0] + ("." + k.split(".")[1] if k.startswith("layers.") else "") for k in tensors
                      if k.startswith(("midlayer.", "layers."))}
    if len(layer_prefixes) > 1:
        raise ValueError(f"{where} holds more than one decoder layer ({sorted(layer_prefixes)}); EAGLE-3 has one")
    renamed = {}
    for k, v in tensors.items():
        if k.startswith("midlayer."):
            k = "layers.0." + k.removeprefix("midlayer.")
        elif k == "norm.weight":
            k = "final_norm.weight"
        renamed[k] = v
    aux, more = aux_layer_ids(hf, target, where / "config.json")
    notes += more
    head = renamed.get("lm_head.weight")
    rows = head.shape[0] if head is not None else hf.get("draft_vocab_size", target.vocab_size)
    if hf.get("draft_vocab_size", rows) != rows:
        raise ValueError(f"{where}: lm_head.weight has {rows} rows, config.json's draft_vocab_size is {hf['draft_vocab_size']}")
    vocab = draft_vocabulary(renamed, rows, target.vocab_size, where)
    for k in ("d2t", "t2d"):
        renamed.pop(k, None)
    cfg = base_config("eagle3_vllm", g, target, aux_layers=aux, draft_vocab_size=None if vocab is None else rows)
    H = cfg.hidden_size
    expected = {
        "fc.weight": ((H, LEVELS * H), f"hidden_size {H} over {LEVELS} target levels of {H}"),
        **layer_shapes(cfg, "layers.0.", 2 * H, f"[embedding; hidden] = 2 x hidden_size {H}"),
        "layers.0.input_layernorm.weight": ((H,), f"hidden_size {H}"),
        "layers.0.hidden_norm.weight": ((H,), f"hidden_size {H}"),
        "final_norm.weight": ((H,), f"hidden_size {H}"),
        "lm_head.weight": ((rows, H), f"draft_vocab_size {rows} x hidden_size {H}"),
    }
    check_shapes(renamed, expected, where)
    state = {k: v.float().contiguous() for k, v in renamed.items()}
    if vocab is not None:
        state["draft_vocab"] = vocab.contiguous()
    return Imported(cfg, state, notes)


def target_embedding(target_path: Path) -> torch.Tensor:
    """The target's `model.embed_tokens.weight`, read alone from its safetensors."""
    index = target_path / "model.safetensors.index.json"
    name = "model.embed_tokens.weight"
    file = json.loads(index.read_text())["weight_map"][name] if index.is_file() else "model.safetensors"
    with safe_open(str(target_path / file), framework="pt") as f:
        return f.get_tensor(name)


def embedding_note(copy: torch.Tensor, target_path: Path, target: ModelConfig) -> tuple[float, list[str]]:
    """How far the checkpoint's embedding copy is from the target's (max |diff| over the target's max |entry|)."""
    if tuple(copy.shape) != (target.vocab_size, target.hidden_size):
        raise ValueError(f"the checkpoint's embed_tokens.weight has shape {tuple(copy.shape)}, the target's embedding "
                         f"({target.vocab_size}, {target.hidden_size}): a drafter for another model")
    own = target_embedding(target_path).float()
    rel = float((copy.float() - own).abs().max() / own.abs().max().clamp_min(1e-12))
    note = "the checkpoint's embed_tokens.weight is not used: the drafter reads the target's"
    if rel > EMBED_REL_TOL:
        note += (f"; it differs from this target's by {rel:.3g} of the largest entry: the drafter was trained for "
                 "another model of this shape (a base model, an earlier checkpoint), so expect fewer accepted tokens")
    return rel, [note]


def import_drafter(fmt: str, checkpoint: str | Path, target_path: str | Path, out: str | Path) -> dict:
    """Reads the published checkpoint, maps it, writes the drafter folder `out` atomically; -> a summary."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    checkpoint, target_path, out = Path(checkpoint), Path(target_path), Path(out)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"checkpoint folder {checkpoint} does not exist")
    target = read_config(target_path)
    hf = read_json(checkpoint / "config.json")
    tensors, weights_file = read_weights(checkpoint)
    embed = tensors.pop("embed_tokens.weight", None)
    imported = (map_eagle if fmt == "eagle" else map_eagle3)(tensors, hf, target, checkpoint)
    embed_rel, notes = embedding_note(embed, target_path, target) if embed is not None else (None, [])
    summary = {"format": fmt, "kind": imported.config.kind, "checkpoint": str(checkpoint), "weights": weights_file,
               "target": str(target_path), "embedding_rel_diff": embed_rel, "notes": imported.notes + notes}
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_folder(out) as tmp:
        write_drafter(tmp, imported.config, imported.state, extra={"imported": summary})
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spot.import_drafter", description=__doc__.splitlines()[0])
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="eagle: EAGLE-1 as its authors publish it; eagle3: vLLM's / SpecForge's EAGLE-3 layout")
    p.add_argument("--checkpoint", required=True, help="the published drafter's folder (config.json + weights)")
    p.add_argument("--target", required=True, help="the target's HF folder (its config.json and embedding are read)")
    p.add_argument("--out", required=True, help="the drafter folder to write (engine.spec.drafter_path; replaced atomically)")
    args = p.parse_args(argv)
    try:
        s = import_drafter(args.format, args.checkpoint, args.target, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for note in s["notes"]:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {args.out}: a {s['kind']} drafter (engine.spec.drafter={s['kind']}) from {args.checkpoint} "
          f"({s['format']}, {s['weights']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
