"""A new team's path, as issue 50 walks it: a GSM8K-layout JSONL file and a verl-layout parquet file,
neither with an id, each prepared with `pipeline.data.prepare`, then trained for 2 RL steps on SmolLM2
with a reward given as `file.py:function`; the held-out problems evaluated are the file's held-out ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import load_config
from launch.run.build import build_run
from launch.run.config import TrainConfig
from pipeline.data.prepare import main as prepare
from pipeline.data.split import is_held_out
from pipeline.dist import Ranks
from tests.test_data_files import write_jsonl, write_parquet
from tests.test_data_run import Recorder

REPO = Path(__file__).resolve().parent.parent

REWARD = '''
def score(prompt, response, answer, extra):
    """1 when the gold answer appears in the response; the row's data_source as a metric."""
    return {"score": float(answer in response), "verl_row": float(extra.get("data_source") == "openai/gsm8k")}
'''


def gsm8k_rows(n: int) -> list[dict]:
    return [{"question": f"Ann has {i} pens and buys {i + 3} more. How many pens does she have?",
             "answer": f"She has {i} + {i + 3} = <<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3} pens.\n#### {2 * i + 3}"}
            for i in range(n)]


def verl_rows(n: int) -> list[dict]:
    return [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "user", "content": f"What is {i} times 3? Let's think step by step and output the "
                                                    "final answer after \"####\"."}],
             "reward_model": {"style": "rule", "ground_truth": str(3 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def run_file(smollm2_dir: Path, out: Path, reward: Path, *overrides: str) -> tuple[dict, Recorder, str]:
    cfg = load_config(TrainConfig, REPO / "configs" / "smollm2.yaml", [
        f"model.path={smollm2_dir}", f"run.out_dir={out}", "task.name=math", f"task.reward={reward}:score",
        "task.format_weight=0", "task.eval_problems=3", "task.eval_max_new_tokens=16", "rollout.n=2", "rollout.max_new_tokens=16",
        "engine.max_len=256", "engine.max_batch=4", "trainer.steps=2", "trainer.prompts_per_step=2",
        "trainer.eval_every=0", "trainer.prompt_order=shuffled", "engine.spec.enabled=false", "bubble.enabled=false",
        "spot.enabled=false", "actor.precision=float32", "metrics.wandb=false", "metrics.console=false",
        "metrics.dashboard=false", *overrides])
    built = build_run(cfg, Ranks())
    try:
        recorder = Recorder(built.engine)
        built.engine.generate = recorder
        summary = built.train()
    finally:
        built.close()
    steps = [json.loads(line) for line in (built.run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"summary": summary, "steps": [s for s in steps if "timing/step" in s]}, recorder, \
        (built.run_dir / "rank0.log").read_text()


def ids_of(path: Path) -> set[str]:
    return {json.loads(line)["id"] for line in path.read_text().splitlines()}


@pytest.mark.slow
def test_a_new_teams_files_prepared_and_trained_evaluate_their_own_held_out_rows(smollm2_dir, tmp_path):
    reward = tmp_path / "my_reward.py"
    reward.write_text(REWARD)

    # GSM8K as downloaded (JSONL, no ids): prepared into train / test, the test file is the held-out set
    gsm8k = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows(60))
    assert prepare(["--format", "gsm8k", str(gsm8k), str(tmp_path / "gsm8k"), "--test-share", "0.2"]) == 0
    train, test = tmp_path / "gsm8k" / "train.jsonl", tmp_path / "gsm8k" / "test.jsonl"
    result, recorder, log = run_file(smollm2_dir, tmp_path / "runs", reward, f"task.file={train}",
                                     f"task.eval_file={test}", "task.chat=true")
    assert len(recorder.greedy) == 2 * 3 and set(recorder.greedy) <= ids_of(test)  # before step 1 and after step 2
    assert set(recorder.sampled) <= ids_of(train) and len(result["steps"]) == 2
    assert f"on {test}, 3 of {len(ids_of(test))} problems" in log
    assert all("reward/mean" in s and s["reward/verl_row"] == 0.0 for s in result["steps"])

    # verl's parquet as downloaded (chat-message prompts, reward_model.ground_truth, no ids): prepared whole,
    # the run holds out its default share of the training file
    verl = write_parquet(tmp_path / "verl.parquet", verl_rows(60))
    assert prepare(["--format", "verl", str(verl), str(tmp_path / "verl"), "--test-share", "0"]) == 0
    train = tmp_path / "verl" / "train.jsonl"
    result, recorder, log = run_file(smollm2_dir, tmp_path / "runs", reward, f"task.file={train}", "task.chat=true",
                                     "task.eval_share=0.25")
    held = {i for i in ids_of(train) if is_held_out(i, 0.25)}
    assert len(recorder.greedy) == 2 * 3 and set(recorder.greedy) <= held
    assert recorder.sampled and not set(recorder.sampled) & held
    assert f"on {train}'s held-out share 0.25, 3 of {len(held)} problems" in log
    assert all(s["reward/verl_row"] == 1.0 for s in result["steps"])  # the row's other fields reach the reward
