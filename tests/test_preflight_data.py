"""Before submission the preflight loads the reward, scores a few rows of the data with it and reads
task.eval_file, naming what is wrong; it sizes the disk by the checkpoints the run keeps
(trainer.keep_checkpoints), which the run prunes to the latest K and the best held-out one."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from common.config import load_config
from launch.slurm.preflight import checkpoint_bytes, submit_checks
from launch.run.config import TrainConfig
from pipeline.checkpoint.keep import kept_steps, retain
from tests.test_data_files import write_jsonl, write_parquet

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"

VERL_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 2:
        raise KeyError("index 2 has no rubric")
    return float(ground_truth in solution_str)
"""


def verl_rows(n: int) -> list[dict]:
    """verl's parquet layout: chat prompts, the answer in reward_model.ground_truth, no worked solution."""
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def checks(*overrides: str) -> dict:
    cfg = load_config(TrainConfig, TINY, list(overrides))
    return {c.name: c for c in submit_checks(cfg, REPO)}


@pytest.fixture
def verl_data(tmp_path) -> list[str]:
    data = write_parquet(tmp_path / "train.parquet", verl_rows(2))
    (tmp_path / "reward.py").write_text(VERL_REWARD)
    return [f"task.file={data}", "task.answer_field=reward_model.ground_truth", "task.chat=true",
            f"task.reward={tmp_path / 'reward.py'}:compute_score", f"run.out_dir={tmp_path / 'runs'}"]


def test_a_verl_reward_scores_a_few_rows_of_a_verl_parquet_in_a_worker_before_submission(verl_data):
    reward = checks(*verl_data)["reward"]
    assert reward.ok, reward.detail
    assert "compute_score scored 2 rows of the training data in a reward worker, at most 10 s a call: 1, 1" in reward.detail


def test_a_reward_that_raises_on_a_row_fails_the_preflight_naming_the_row(verl_data, tmp_path):
    write_parquet(tmp_path / "train.parquet", verl_rows(4))
    reward = checks(*verl_data)["reward"]
    assert reward.failed
    assert "compute_score failed on row" in reward.detail and "KeyError: 'index 2 has no rubric'" in reward.detail


def test_a_reward_file_that_fails_to_import_is_refused_before_submission(verl_data, tmp_path):
    (tmp_path / "reward.py").write_text("import team_only_package\n" + VERL_REWARD)
    reward = checks(*verl_data)["reward"]
    assert reward.failed and "task.reward" in reward.detail and "ModuleNotFoundError" in reward.detail
    assert "task.reward" in reward.fix


def test_a_missing_eval_file_is_refused_before_submission_and_a_present_one_is_read(verl_data, tmp_path):
    missing = checks(*verl_data, f"task.eval_file={tmp_path / 'test.parquet'}")["eval file"]
    assert missing.failed and "test.parquet" in missing.detail and "task.eval_file" in missing.fix
    write_jsonl(tmp_path / "test.jsonl", [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?"}])
    read = checks(f"task.eval_file={tmp_path / 'test.jsonl'}", "task.max_bad_share=0.5")["eval file"]
    assert read.ok and "1 problems, 1 malformed rows skipped" in read.detail


def test_the_disk_check_counts_the_checkpoints_the_run_keeps_and_names_the_key(char_model_dir, tmp_path, monkeypatch):
    base = [f"model.path={char_model_dir}", f"run.out_dir={tmp_path}", "trainer.steps=12", "trainer.save_every=1"]
    one = checkpoint_bytes(load_config(TrainConfig, TINY, base))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(100 * one, 0, int(4.5 * one)))
    every = checks(*base)["disk"]
    assert every.failed and "12 checkpoints" in every.detail and "trainer.keep_checkpoints" in every.fix
    kept = checks(*base, "trainer.keep_checkpoints=2")["disk"]
    assert kept.ok and "4 checkpoints" in kept.detail and "trainer.keep_checkpoints=2" in kept.detail


def test_the_latest_k_and_the_best_held_out_checkpoint_are_kept():
    assert kept_steps(range(1, 7), 2, {2: 0.9, 4: 0.5, 6: 0.7}) == {2, 5, 6}
    assert kept_steps(range(1, 7), 2, {2: 0.9, 4: 0.9}) == {4, 5, 6}  # equal best: the later
    assert kept_steps(range(1, 7), 2, {}) == {5, 6}
    assert kept_steps(range(1, 7), 0, {}) == set(range(1, 7))
    with pytest.raises(ValueError, match="trainer.keep_checkpoints must be >= 0"):
        kept_steps([1], -1, {})


def test_retain_removes_complete_checkpoints_only_and_remembers_scores_across_calls(tmp_path):
    for step in range(1, 7):
        folder = tmp_path / "checkpoints" / f"step-{step}"
        folder.mkdir(parents=True)
        (folder / "state.json").write_text("{}")
        retain(tmp_path, step, {2: 0.9, 4: 0.5}.get(step), keep=2)
    (tmp_path / "checkpoints" / "step-7").mkdir()  # a save that did not finish: not judged here
    retain(tmp_path, 6, None, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-2", "step-5", "step-6", "step-7"]
