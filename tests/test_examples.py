"""Every recipe in examples/ is a config that loads, fits its GPUs by the memory planner and renders
its Slurm job (`DRY_RUN=1`), and every command its README names exists."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import load_config
from launch.memory.report import main as memory_main
from launch.run.config import TrainConfig

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.parent for p in (REPO / "examples").glob("*/config.yaml"))
MODEL_CONFIGS = {"qwen2.5-7b": "launch/model_configs/qwen2.5-7b-instruct.json",
                 "qwen2.5-32b": "launch/model_configs/qwen2.5-32b-instruct.json"}


def model_config(example: Path) -> str | None:
    """The shipped config.json of the recipe's model (None: the recipe's model.path has one)."""
    return next((path for prefix, path in MODEL_CONFIGS.items() if example.name.startswith(prefix)), None)


def filled(example: Path, tmp: Path) -> list[str]:
    """Overrides that fill the recipe's ??? paths, as a user's ARGS would."""
    model = tmp / "model"
    if not model.exists():
        model.mkdir()
        shutil.copy(REPO / (model_config(example) or MODEL_CONFIGS["qwen2.5-7b"]), model / "config.json")
    data = tmp / "train.jsonl"
    data.write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    return [f"model.path={model}", f"task.file={data}", f"task.eval_file={data}", f"engine.spec.drafter_path={tmp}"]


def test_there_are_the_three_recipes_the_docs_name():
    assert {p.name for p in EXAMPLES} == {"smollm2-gsm8k-cpu", "qwen2.5-7b-gsm8k-grpo", "qwen2.5-32b-dapo-math"}
    index = (REPO / "examples" / "README.md").read_text()
    assert all(f"]({p.name}/README.md)" in index for p in EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_a_recipe_fits_its_gpus_by_the_planner(example, capsys):
    args = ["--config", str(example / "config.yaml")]
    if model_config(example):
        args += ["--model-config", str(REPO / model_config(example))]
    assert memory_main(args) == 0, capsys.readouterr().out[-3000:]
    assert "fits" in capsys.readouterr().out


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_a_recipe_renders_its_slurm_job_with_the_paths_given(example, tmp_path):
    overrides = filled(example, tmp_path)
    cfg = load_config(TrainConfig, example / "config.yaml", overrides)
    assert cfg.task.file and cfg.task.eval_file  # the recipe's held-out set is its own data's
    proc = subprocess.run([sys.executable, "-m", "launch.slurm", "--config", str(example / "config.yaml"), "--dry-run",
                           *overrides], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("#!/bin/bash\n") and "-m launch.train --config" in proc.stdout
    syntax = subprocess.run(["bash", "-n"], input=proc.stdout, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr
    assert "FAIL settings" not in proc.stdout  # every ??? is filled by the overrides a README gives


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_the_modules_a_recipe_runs_exist(example):
    text = (example / "README.md").read_text()
    modules = set(re.findall(r"-m ([a-z_]+(?:\.[a-z_]+)+)", text))
    assert {"launch.memory"} <= modules
    for module in modules:
        path = REPO / module.replace(".", "/")
        assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), f"{example.name}: no module {module}"


def test_the_cpu_recipe_reads_the_files_its_readme_prepares_into_a_run(smollm2_dir, tmp_path):
    """examples/smollm2-gsm8k-cpu as its README runs it, up to the run's first step: stand-in rows in
    GSM8K's layout, `prepare --format gsm8k`, then the recipe's config with the files in place builds
    its training problems, held-out set and prompt order (stratified, by GSM8K's worked solutions)."""
    from common.text import load_tokenizer
    from launch.run.problems import prompt_loader, problems_for

    raw, data = tmp_path / "gsm8k-raw.jsonl", tmp_path / "gsm8k"
    for cmd in (["pipeline.data.stand_in", "--layout", "gsm8k", str(raw), "--rows", "200"],
                ["pipeline.data.prepare", "--format", "gsm8k", str(raw), str(data)]):
        subprocess.run([sys.executable, "-m", *cmd], cwd=REPO, check=True, capture_output=True)
    cfg = load_config(TrainConfig, REPO / "examples/smollm2-gsm8k-cpu/config.yaml",
                      [f"model.path={smollm2_dir}", f"task.file={data / 'train.jsonl'}",
                       f"task.eval_file={data / 'test.jsonl'}"])
    problems = problems_for(cfg, load_tokenizer(cfg.model.path))
    assert len(problems.train) + len(problems.held_out) == 200 and problems.held_out
    assert str(data / "test.jsonl") in problems.held_out_source
    loader = prompt_loader(cfg, problems.train)
    assert len(loader.next_step()) == cfg.trainer.prompts_per_step
