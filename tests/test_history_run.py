"""History drafts in the RL loop: the same run with them on, a store kept across steps, restored on resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launch.run.build import build_run, run
from pipeline.dist import Ranks
from tests.test_trainer import LEARNED, config, digits_task, step_rows, weights  # noqa: F401 (a fixture)

# 8 prompts, 4 a step: every prompt recurs from step 3 on. The tuner's arms include a length-aware budget.
HISTORY = ("task.train_problems=8", "engine.spec.enabled=true", "engine.spec.drafter=history+eagle", "engine.spec.history_min_match=2",
           'engine.spec.tuner_arms=["d2k1v2L4","d4k1v4"]', "engine.spec.long_row_tokens=6")


@pytest.mark.slow
def test_history_drafts_and_the_length_budget_learn_exactly_the_same_run(char_model_dir, char_drafter_dir, digits_task,
                                                                          tmp_path):
    off = run(config(char_model_dir, tmp_path / "off", "task.train_problems=8", "trainer.steps=4",
                     "engine.spec.enabled=false"), Ranks())
    on = run(config(char_model_dir, tmp_path / "on", *HISTORY, "trainer.steps=4",
                    f"engine.spec.drafter_path={char_drafter_dir}"), Ranks())
    rows_off, rows_on = step_rows(off["run_dir"]), step_rows(on["run_dir"])
    for a, b in zip(rows_off, rows_on, strict=True):
        assert {k: a[k] for k in LEARNED} == {k: b[k] for k in LEARNED}
    w_off, w_on = weights(off["run_dir"], 4), weights(on["run_dir"], 4)
    assert all(torch.equal(w_off[k], w_on[k]) for k in w_off)
    # Recurring prompts (steps 3 and 4) draft from the store: more coverage than steps 1-2's siblings alone.
    cover = [r["spec/history_coverage"] for r in rows_on]
    assert min(cover[2:]) > max(cover[:2])
    assert all(r["spec/history_accept_len"] >= 1 for r in rows_on if r["spec/history_coverage"] > 0)


@pytest.mark.slow
def test_resume_restores_the_history_store(char_model_dir, char_drafter_dir, digits_task, tmp_path):
    spec = (*HISTORY, f"engine.spec.drafter_path={char_drafter_dir}")
    full = run(config(char_model_dir, tmp_path / "full", *spec, "trainer.steps=3"), Ranks())
    first = run(config(char_model_dir, tmp_path / "cut", *spec, "trainer.steps=2"), Ranks())
    ckpt = Path(first["run_dir"]) / "checkpoints" / "step-2"
    saved = json.loads((ckpt / "state.json").read_text())["components"]["history"]
    assert len(saved["prompts"]) == 8 and all(len(responses) == 4 for _, responses in saved["prompts"])
    built = build_run(config(char_model_dir, tmp_path / "cut", *spec, "trainer.steps=3", f"trainer.resume={ckpt}"), Ranks())
    try:
        history = next(hook for hook in built.trainer.hooks if hook.name == "history")
        assert history.state_dict() == saved
        built.train()
    finally:
        built.close()
    # Step 3's drafts (and so its coverage) are those of the uninterrupted run only with the store restored.
    assert step_rows(full["run_dir"])[2]["spec/history_coverage"] == step_rows(first["run_dir"])[2]["spec/history_coverage"]
