"""Fixtures shared by the vLLM backend's tests (`make test-vllm`, in .venv-vllm)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def models(tmp_path_factory, char_model_dir) -> tuple[Path, Path]:
    """(target, drafter): the trained tiny model and its drafter when `make drafters` made them, else
    a random model with a drafter warm-started on it here (~1 min)."""
    tiny, drafter = REPO / "checkpoints/tiny", REPO / "checkpoints/tiny-drafter"
    forced = os.environ.get("TAILSPEC_VLLM_TEST_MODEL") == "random"  # exercise the clean-machine path
    if not forced and (tiny / "config.json").is_file() and (drafter / "config.json").is_file():
        return tiny, drafter
    out = tmp_path_factory.mktemp("vllm-drafter")
    prompts = out / "prompts.jsonl"
    subprocess.run([sys.executable, "-m", "pipeline.tasks", "--task", "arith", "--split", "train", "--num", "256",
                    "--seed", "1", "--out", str(prompts)], check=True, cwd=REPO)
    subprocess.run([sys.executable, "-m", "spot.warmstart", "--target", str(char_model_dir), "--prompts", str(prompts),
                    "--out", str(out / "drafter"), "--n", "2", "--max-new-tokens", "48", "--steps", "300",
                    "--max-minutes", "1.5"], check=True, cwd=REPO)
    return char_model_dir, out / "drafter"
