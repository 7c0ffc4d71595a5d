"""Rewards in the signatures users bring (verl's compute_score, TRL's batched reward functions and a
weighted list of them, TailSpec's own), told apart by their parameters and run in the worker pool
with deadlines and counted failures; the boxed-answer bonus as math_verify's option, the old
task.format_weight key migrated; the prompt order that takes the data it is given."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.config import load_config
from launch.run.config import TrainConfig
from pipeline.tasks import TASKS, Problem
from pipeline.tasks.reward_plugins import PluginReward, WeightedReward, reward_functions
from pipeline.tasks.reward_pool import RewardPool
from pipeline.tasks.reward_scoring import Rewards, RewardRow
from pipeline.tasks.reward_signatures import convention_of

REPO = Path(__file__).resolve().parent.parent
TINY, SMOLLM2 = REPO / "configs" / "tiny.yaml", REPO / "configs" / "smollm2.yaml"

VERL = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(ground_truth in solution_str), "source_len": len(data_source),
            "split_is_train": float(extra_info["split"] == "train")}

def two_args(solution_str, ground_truth):
    return float(solution_str.strip() == ground_truth)
"""

TRL = """
import time

def accuracy(prompts, completions, solution, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(s in t) for t, s in zip(texts, solution)]

def brevity(completions, **kwargs):
    return [None if kwargs["level"][0] == "skip" else 1.0 / len(c) for c in completions]

def seen(prompts, completions, **kwargs):
    return [json.dumps({"prompts": prompts, "completions": completions, "kwargs": sorted(kwargs)})]

def flaky(prompts, completions, **kwargs):
    if completions[0] == "raise":
        raise ZeroDivisionError("no score")
    if completions[0] == "hang":
        time.sleep(60)
    return [float(len(completions[0]))]
""".replace("import time", "import json, time")


def write(path: Path, code: str) -> Path:
    path.write_text(textwrap.dedent(code))
    return path


def task_cfg(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{"reward": None, "reward_weights": None, "name": "math", "answer_field": "solution",
                              "chat": False, "file": None, **kw})


@pytest.fixture
def rewards_dir(tmp_path) -> Path:
    write(tmp_path / "verl_reward.py", VERL)
    write(tmp_path / "trl_rewards.py", TRL)
    return tmp_path


def test_each_convention_is_told_apart_by_its_parameter_names(rewards_dir):
    import importlib.util

    def load(name):
        spec = importlib.util.spec_from_file_location(name, rewards_dir / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    verl, trl = load("verl_reward"), load("trl_rewards")
    assert convention_of(verl.compute_score, "f") == convention_of(verl.two_args, "f") == "verl"
    assert convention_of(trl.accuracy, "f") == convention_of(trl.brevity, "f") == "trl"
    assert convention_of(lambda prompt, response, answer, extra: 0.0, "f") == "tailspec"
    with pytest.raises(ValueError, match=r"looks like verl's compute_score but cannot be called as verl calls it"):
        convention_of(lambda solution_str, ground_truth, scale: 0.0, "f")


def test_a_verl_compute_score_gets_the_rows_data_source_the_response_ground_truth_and_extra_info(rewards_dir):
    extra = {"data_source": "openai/gsm8k", "extra_info": {"split": "train", "index": 3}, "ability": "math"}
    train, held_out = reward_functions(task_cfg(reward=f"{rewards_dir}/verl_reward.py:compute_score"), TASKS["math"])
    assert held_out is train and train.convention == "verl"
    assert train("q", "so 72", "72", extra) == {"score": 1.0, "source_len": 12.0, "split_is_train": 1.0}
    two, _ = reward_functions(task_cfg(reward=f"{rewards_dir}/verl_reward.py:two_args"), TASKS["math"])
    assert two("q", " 72 ", "72", extra) == 1.0  # the keywords it does not take are left out


def test_a_trl_reward_func_gets_one_row_batches_the_rows_columns_and_the_answer_by_its_field_name(rewards_dir):
    source = f"{rewards_dir}/trl_rewards.py:seen"
    plain, _ = reward_functions(task_cfg(reward=source), TASKS["math"])
    seen = json.loads(plain("2+2?", "4", "4", {"level": "easy"}))
    assert seen == {"prompts": ["2+2?"], "completions": ["4"], "kwargs": ["answer", "level", "solution"]}
    chat, _ = reward_functions(task_cfg(reward=source, chat=True), TASKS["math"])
    seen = json.loads(chat("2+2?", "4", "4", {}))
    assert seen["prompts"] == [[{"role": "user", "content": "2+2?"}]]  # conversational, as TRL gives a chat dataset's
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}]]


def test_a_weighted_list_of_trl_rewards_sums_by_reward_weights_logs_each_and_leaves_out_none(rewards_dir):
    source = f"{rewards_dir}/trl_rewards.py"
    cfg = task_cfg(reward=[f"{source}:accuracy", f"{source}:brevity"], reward_weights=[1.0, 0.5])
    train, held_out = reward_functions(cfg, TASKS["math"])
    assert isinstance(train, WeightedReward) and held_out is train
    assert train("q", "it is 12", "12", {"level": "easy"}) == {"score": 1.0 + 0.5 / 8, "accuracy": 1.0, "brevity": 0.125}
    assert train("q", "it is 13", "12", {"level": "skip"}) == {"score": 0.0, "accuracy": 0.0}  # brevity: None, left out
    alone, _ = reward_functions(task_cfg(reward=[f"{source}:brevity"]), TASKS["math"])
    with pytest.raises(ValueError, match="no reward of 1 x .*brevity scored this row"):
        alone("q", "r", "a", {"level": "skip"})


def test_a_list_mixing_math_verify_with_a_plugin_keeps_the_bonus_out_of_the_held_out_score(rewards_dir):
    cfg = task_cfg(reward=["math_verify(format_weight=0.5)", f"{rewards_dir}/verl_reward.py:two_args"],
                   reward_weights=[1.0, 2.0])
    train, held_out = reward_functions(cfg, TASKS["math"])
    assert train("q", "\\boxed{7}", "7", {})["score"] == 1.5 + 0.0
    assert held_out("q", "\\boxed{7}", "7", {})["score"] == 1.0
    assert train("q", "7", "7", {}) == {"score": 1.0 + 2.0, "math_verify": 1.0, "two_args": 1.0}


def test_verl_and_trl_rewards_run_in_the_worker_pool_with_their_deadline_and_counted_failures(rewards_dir):
    verl = PluginReward(f"{rewards_dir}/verl_reward.py:compute_score")
    trl = PluginReward(f"{rewards_dir}/trl_rewards.py:flaky")
    pool = RewardPool([trl, verl], workers=2, timeout_s=2.0)
    rewards = Rewards(trl, verl, pool, max_error_share=0.5, timeout_s=2.0, log=lambda msg: None)
    try:
        rows = [RewardRow(prompt_id=f"p{i}", sample=0, prompt="q", response=r, answer="ok", extra={})
                for i, r in enumerate(["abc", "raise", "hang", "ok"])]
        assert rewards.score(rows, step=0) == [3.0, 0.0, 0.0, 2.0]
        stats = rewards.take_stats()
        assert (stats.calls, stats.errors, stats.timeouts) == (4, 1, 1)
        extra = {"data_source": "gsm8k", "extra_info": {"split": "test"}}
        held = [RewardRow(prompt_id="h", sample=0, prompt="q", response="ok then", answer="ok", extra=extra)]
        assert rewards.score_held_out(held) == [1.0]  # verl's, in a worker
    finally:
        rewards.close()


def test_the_format_bonus_is_math_verifys_option_and_the_old_key_migrates_or_is_ignored_beside_a_plugin(rewards_dir):
    with pytest.warns(FutureWarning, match=r"task.format_weight=0.2 is read as task.reward=math_verify\(format_weight=0.2\)"):
        cfg = load_config(TrainConfig, TINY, ["task.name=math", "task.format_weight=0.2"])
    assert cfg.task.reward == "math_verify(format_weight=0.2)" and cfg.task.format_weight is None
    plugin = f"{rewards_dir}/verl_reward.py:compute_score"
    with pytest.warns(UserWarning, match=r"task.format_weight=0.2 is ignored: .* task.reward=.*compute_score is another"):
        cfg = load_config(TrainConfig, TINY, ["task.name=math", "task.format_weight=0.2", f"task.reward={plugin}"])
    assert cfg.task.reward == plugin
    with pytest.raises(ValueError, match=r"task.format_weight .* the mult task's own reward is not math-verify"):
        load_config(TrainConfig, TINY, ["task.format_weight=0.2"])


def test_smollm2_takes_a_plugin_reward_changing_task_keys_only(rewards_dir, recwarn):
    cfg = load_config(TrainConfig, SMOLLM2, [f"task.reward={rewards_dir}/verl_reward.py:compute_score"])
    assert cfg.task.reward.endswith("compute_score") and not [w for w in recwarn if "format_weight" in str(w.message)]
    cfg = load_config(TrainConfig, SMOLLM2, [f"task.reward=[{rewards_dir}/trl_rewards.py:accuracy, "
                                             f"{rewards_dir}/trl_rewards.py:brevity]", "task.reward_weights=[1.0, 0.2]"])
    assert cfg.task.reward_weights == [1.0, 0.2]


@pytest.mark.parametrize("overrides, error", [
    (["task.reward=[exact, math_verify]", "task.reward_weights=[1.0]"],
     r"task.reward_weights has 1 weights for 2 rewards in task.reward"),
    (["task.reward_weights=[1.0]"], r"task.reward_weights weigh the rewards of a task.reward list; task.reward is null"),
    (["task.reward=[]"], r"task.reward is an empty list"),
])
def test_reward_weights_that_do_not_fit_the_rewards_are_refused_naming_the_key(overrides, error):
    with pytest.raises(ValueError, match=error):
        load_config(TrainConfig, TINY, overrides)


def test_prompt_order_auto_stratifies_problems_with_reference_responses_and_else_shuffles_saying_why():
    from launch.run.problems import prompt_loader

    cfg = load_config(TrainConfig, TINY, ["trainer.prompts_per_step=4"])
    assert cfg.trainer.prompt_order == "auto"
    worked = [Problem(id=f"w{i}", prompt=f"q{i}", answer="1", response="x" * (i + 1)) for i in range(8)]
    bare = [Problem(id=f"b{i}", prompt=f"q{i}", answer="1", response="") for i in range(8)]
    said: list[str] = []
    assert prompt_loader(cfg, worked, log=said.append).sizes == list(range(1, 9))
    assert prompt_loader(cfg, bare, log=said.append).sizes is None
    assert said[0].startswith("prompt order: stratified (trainer.prompt_order=auto: every problem has a reference")
    assert said[1].startswith("prompt order: shuffled (trainer.prompt_order=auto: 8 of 8 problems have no reference")
