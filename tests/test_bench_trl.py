"""bench.trl: the TailSpec config becomes TRL's GRPOConfig faithfully or is refused by key, each side's
step is split from what it measured, and (with .venv-trl and SmolLM2's tokenizer) the whole bench
runs both sides on the same rows and prints the ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.trl import StepFigures, Side, tailspec_figures, trl_figures, trl_settings
from common.config import load_config
from launch.run.config import TrainConfig
from tests.conftest import REPO, make_hf_model

SMOLLM2 = REPO / "configs" / "smollm2.yaml"
TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
TOKENIZER = REPO / "checkpoints" / "smollm2-135m-instruct"


def test_the_smollm2_job_becomes_grpoconfig_keywords_of_the_same_settings():
    cfg = load_config(TrainConfig, SMOLLM2, [])
    s = trl_settings(cfg, micro_rows=8)
    assert (s["num_generations"], s["max_completion_length"], s["temperature"], s["learning_rate"]) == (8, 160, 0.7, 5e-6)
    assert (s["top_p"], s["top_k"], s["beta"], s["epsilon"], s["epsilon_high"]) == (1.0, 0, 0.0, 0.2, 0.2)
    assert s["per_device_train_batch_size"] * s["gradient_accumulation_steps"] == 64  # one optimizer step a step
    assert (s["num_iterations"], s["lr_scheduler_type"], s["adam_beta2"], s["max_grad_norm"]) == (1, "constant", 0.99, 1.0)
    assert s["loss_type"] == "grpo" and s["scale_rewards"] == "group"  # seq-mean-token-mean, std-normalised groups
    assert s["gradient_checkpointing"] is False  # TRL's default is True; TailSpec's run has none
    token_mean = trl_settings(load_config(TrainConfig, SMOLLM2, ["algorithm.aggregation=token-mean"]), 8)
    assert token_mean["loss_type"] == "dapo"


@pytest.mark.parametrize("overrides, key", [
    (["trainer.ppo_epochs=2"], "trainer.ppo_epochs"),
    (["trainer.mini_batches=2"], "trainer.mini_batches"),
    (["algorithm.name=rloo"], "algorithm.name"),
    (["actor.lr_schedule=cosine"], "actor.lr_schedule"),
    (["task.name=mult", "task.chat=false"], "task.name"),
])
def test_what_the_bench_does_not_give_trl_is_refused_naming_the_key(overrides, key):
    with pytest.raises(ValueError, match=key):
        trl_settings(load_config(TrainConfig, SMOLLM2, overrides), micro_rows=8)


def test_trl_micro_rows_must_divide_the_steps_rows():
    with pytest.raises(ValueError, match="--trl-micro-rows"):
        trl_settings(load_config(TrainConfig, SMOLLM2, []), micro_rows=7)


def test_trl_steps_split_into_generation_the_old_logprob_pass_inside_prepare_and_the_update():
    # Step 1 on [0, 10]: _prepare_inputs [0, 6] holds generate [0.5, 4.5] and a log-prob pass [4.6, 5.6];
    # compute_loss's own log-probs [7, 8] belong to the update. Step 2 on [10, 16]: generation only.
    spans = [("GRPOTrainer.transformers.generate", 0.5, 4.5),
             ("GRPOTrainer._get_per_token_logps_and_entropies", 4.6, 5.6), ("GRPOTrainer._prepare_inputs", 0.0, 6.0),
             ("GRPOTrainer._get_per_token_logps_and_entropies", 7.0, 8.0), ("GRPOTrainer.compute_loss", 6.5, 8.5),
             ("GRPOTrainer.transformers.generate", 10.5, 12.5), ("GRPOTrainer._prepare_inputs", 10.0, 13.0)]
    result = {"steps": [{"step_s": 10.0, "start": 0.0, "end": 10.0, "tokens": 100},
                        {"step_s": 6.0, "start": 10.0, "end": 16.0, "tokens": 90}],
              "spans": spans, "log_history": [{"reward": 0.25}, {"reward": 0.5}, {"train_runtime": 16.0}]}
    one, two = trl_figures(result)
    assert one == StepFigures(step_s=10.0, generation_s=4.0, logprob_s=1.0, update_s=4.0, other_s=1.0, tokens=100,
                              reward=0.25)
    assert two == StepFigures(step_s=6.0, generation_s=2.0, logprob_s=0.0, update_s=3.0, other_s=1.0, tokens=90,
                              reward=0.5)


def test_tailspec_steps_come_from_its_timing_metrics_and_rollout_lengths():
    metrics = [{"step": 1.0, "timing/step": 10.0, "timing/rollout": 3.0, "timing/logprob": 0.5, "timing/update": 6.0,
                "reward/mean": 0.2}]
    rollouts = [{"step": 1, "length": 40}, {"step": 1, "length": 60}, {"step": 2, "length": 7}]
    assert tailspec_figures(metrics, rollouts) == [StepFigures(step_s=10.0, generation_s=3.0, logprob_s=0.5,
                                                               update_s=6.0, other_s=0.5, tokens=100, reward=0.2)]
    side = Side("x", [StepFigures(4, 1, 0, 2, 1, 10, 0.0), StepFigures(6, 2, 0, 3, 1, 21, 1.0)], 0, 0.0)
    assert side.mean == StepFigures(5, 1.5, 0, 2.5, 1, 16, 0.5)


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory) -> Path:
    """A random 3-layer Llama over SmolLM2's tokenizer (and chat template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    path = tmp_path_factory.mktemp("tiny-chat")
    make_hf_model("llama", vocab=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not TRL_PYTHON.is_file(), reason="no .venv-trl (make setup-trl)")
@pytest.mark.skipif(not (TOKENIZER / "tokenizer.json").is_file(), reason="no SmolLM2 tokenizer (make models)")
def test_the_bench_runs_both_sides_on_the_same_rows_and_prints_the_ratio(tiny_chat_model, tmp_path):
    cmd = [sys.executable, "-m", "bench.trl", "--steps", "2", "--trl-micro-rows", "2", "--out", str(tmp_path), "--json",
           f"model.path={tiny_chat_model}", "trainer.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8",
           "engine.max_batch=4", "engine.spec.enabled=false", "bubble.enabled=false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    trl_side = next(v for k, v in out["sides"].items() if k.startswith("TRL"))
    ours = out["sides"]["TailSpec"]
    for side in (trl_side, ours):
        assert len(side["steps"]) == 2 and side["peak_rss_bytes"] > 2**27
        for s in side["steps"]:
            assert s["step_s"] > s["generation_s"] > 0 and s["update_s"] > 0 and 0 < s["tokens"] <= 4 * 8
    assert all(s["logprob_s"] == 0 for s in trl_side["steps"])  # num_iterations=1: TRL runs no old-log-prob pass
    assert out["ratio"] == pytest.approx(trl_side["mean"]["step_s"] / ours["mean"]["step_s"], rel=1e-2)
    assert "TailSpec's step is" in proc.stdout and out["cpu"]
    job = json.loads((tmp_path / "trl-job.json").read_text())
    assert len(job["rows"]) == 4 and job["grpo"]["num_generations"] == 2
