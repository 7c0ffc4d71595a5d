"""Fixtures shared by the vLLM backend's tests (`make test-vllm`, in .venv-vllm)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def vllm_char_model(tmp_path_factory) -> Path:
    """A random Llama over the tasks' character tokenizer with head_dim 32 (vLLM's CPU attention
    has no kernel for the root fixture's head_dim 16)."""
    from pipeline.tasks.tokenizer import build_tokenizer
    from tests.conftest import make_hf_model

    tok = build_tokenizer()
    path = tmp_path_factory.mktemp("vllm-char-model")
    make_hf_model("llama", vocab=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, hidden_size=128, intermediate_size=256).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """(target, drafter): the trained tiny model and its drafter when `make drafters` made them, else
    a random model with a drafter warm-started on it here (~1 min)."""
    tiny, drafter = REPO / "checkpoints/tiny", REPO / "checkpoints/tiny-drafter"
    forced = os.environ.get("TAILSPEC_VLLM_TEST_MODEL") == "random"  # exercise the clean-machine path
    if not forced and (tiny / "config.json").is_file() and (drafter / "config.json").is_file():
        return tiny, drafter
    char_model_dir = vllm_char_model(tmp_path_factory)
    out = tmp_path_factory.mktemp("vllm-drafter")
    prompts = out / "prompts.jsonl"
    subprocess.run([sys.executable, "-m", "pipeline.tasks", "--task", "arith", "--split", "train", "--num", "256",
                    "--seed", "1", "--out", str(prompts)], check=True, cwd=REPO)
    subprocess.run([sys.executable, "-m", "spot.warmstart", "--target", str(char_model_dir), "--prompts", str(prompts),
                    "--out", str(out / "drafter"), "--n", "2", "--max-new-tokens", "48", "--steps", "300",
                    "--max-minutes", "1.5"], check=True, cwd=REPO)
    return char_model_dir, out / "drafter"
