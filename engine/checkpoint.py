"""Hugging Face checkpoint folders in and out, and GGUF import through transformers.

A folder is `config.json` plus `model.safetensors` or a sharded `model.safetensors.index.json`.
Writes are atomic per file (temp file, then rename), so a crash never leaves a torn checkpoint.
Knows nothing about tokenizers beyond copying them during GGUF import.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.model import Transformer
from engine.model_config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def read_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist (run `make models` for SmolLM2, `make pretrain-tiny` for the tiny model)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} is missing: a model folder needs config.json and model.safetensors")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
    return ModelConfig.from_hf(hf)


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(str(path / shard)))
        return state
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Transformer:
    path = Path(path)
    cfg = read_config(path)
    state = load_state_dict(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device)
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = expected - set(state)
    unexpected = {k for k in set(state) - expected if not k.endswith("rotary_emb.inv_freq")}
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match its config.json: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_rope()  # the buffer was created on the meta device
    return model.to(dtype).eval()


def atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_checkpoint(model: Transformer, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Writes config.json + model.safetensors that transformers' AutoModelForCausalLM loads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    state = {k: v.detach().to(dtype or v.dtype).contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    hf = cfg.to_hf()
    hf["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    atomic_write(path / "model.safetensors", lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    atomic_write(path / "config.json", lambda p: p.write_text(json.dumps(hf, indent=2)))


def import_gguf(gguf_file: str | Path, out: str | Path) -> Path:
    """Dequantize a GGUF file through transformers into an fp32 HF folder (cached: skipped if present)."""
    gguf_file, out = Path(gguf_file), Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} not found")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf_file.name)
    src = str(gguf_file.parent)
    loaded = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw)
    config = AutoConfig.from_pretrained(src, **kw)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # A GGUF-loaded model refuses save_pretrained: rebuild from the config, then copy the weights.
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src, **kw).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
