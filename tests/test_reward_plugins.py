"""task.reward: what it can name, one calling convention for all, and load errors that name the key
before any rollout; a result that is not a score is an error naming the row."""

from __future__ import annotations

import pickle
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.config import load_config
from launch.run.config import TrainConfig
from pipeline.tasks import TASKS
from pipeline.tasks.reward_plugins import BuiltinReward, PluginReward, TaskReward, reward_functions
from pipeline.tasks.reward_scoring import RewardRow, read_result
from pipeline.tasks.rewards import MathVerifyReward

REPO = Path(__file__).resolve().parent.parent
ROW = RewardRow(prompt_id="gsm8k-17", sample=2, prompt="2+2?", response="4", answer="4")


def task_cfg(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{"reward": None, "reward_weights": None, "name": "arith", "answer_field": "answer",
                              "chat": False, "file": None, **kw})


def write(path: Path, code: str) -> Path:
    path.write_text(textwrap.dedent(code))
    return path


def test_a_file_plugin_gets_prompt_response_answer_and_the_rows_extra_fields(tmp_path):
    source = write(tmp_path / "my_reward.py", """
        def score(prompt, response, answer, extra):
            return {"score": float(response == answer), "tag_len": len(extra["tag"]), "prompt_len": len(prompt)}
    """)
    train, held_out = reward_functions(task_cfg(reward=f"{source}:score"), TASKS["arith"])
    assert held_out is train and train.name == f"{source}:score" and train.bounds is None
    assert train("2+2?", "4", "4", {"tag": "abc"}) == {"score": 1.0, "tag_len": 3, "prompt_len": 4}


def test_a_relative_file_path_is_fixed_against_the_working_directory_when_loaded(tmp_path, monkeypatch):
    write(tmp_path / "rel.py", "def score(prompt, response, answer, extra):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    plugin = PluginReward("rel.py:score")
    monkeypatch.chdir(REPO)
    again = pickle.loads(pickle.dumps(plugin))  # what a worker receives: the name, loaded again there
    assert again.name == "rel.py:score" and again("p", "r", "a", {}) == 0.5


def test_a_module_plugin_is_imported_by_its_dotted_name(tmp_path, monkeypatch):
    package = tmp_path / "team_rewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write(package / "math_score.py", "def score(prompt, response, answer, extra, *, scale=2.0):\n    return scale\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    train, _ = reward_functions(task_cfg(reward="team_rewards.math_score:score"), TASKS["arith"])
    assert train("p", "r", "a", {}) == 2.0


def test_a_pickled_plugin_carries_its_name_not_its_code(tmp_path):
    source = write(tmp_path / "r.py", "def score(prompt, response, answer, extra):\n    return 1.0\n")
    blob = pickle.dumps(PluginReward(f"{source}:score"))
    assert b"def score" not in blob and str(source).encode() in blob


@pytest.mark.parametrize("code, target, error", [
    (None, "{dir}/missing.py:score", r"task.reward=.*missing.py:score: no file .*missing.py \(a relative path is relative"),
    ("def other(prompt, response, answer, extra):\n    return 0\n", "{file}:score",
     r"task.reward=.*r.py:score: .*r.py has no 'score' \(its functions: other\)"),
    ("def score(response, answer):\n    return 0\n", "{file}:score",
     r"task.reward=.*: score\(response, answer\) fits no reward convention .*expected def score\(prompt, response, "
     r"answer, extra\).*; or def score\(data_source, solution_str, ground_truth, extra_info=None\).*; or "
     r"def score\(prompts, completions, \*\*kwargs\)"),
    ("async def score(prompt, response, answer, extra):\n    return 0\n", "{file}:score",
     r"task.reward=.*: score is async; a reward is a plain function"),
    ("score = 3\n", "{file}:score", r"task.reward=.*: score is a int, not a function"),
    ("import not_a_module_here\n", "{file}:score",
     r"task.reward=.*: loading .*r.py failed: ModuleNotFoundError: No module named 'not_a_module_here'"),
    (None, "no_such_package.rewards:score", r"task.reward=no_such_package.rewards:score: no module named"),
    (None, "pipeline.tasks.arith:nope", r"pipeline.tasks.arith has no 'nope'"),
])
def test_a_reward_that_does_not_load_is_a_value_error_naming_task_reward(tmp_path, code, target, error):
    if code is not None:
        write(tmp_path / "r.py", code)
    with pytest.raises(ValueError, match=error):
        reward_functions(task_cfg(reward=target.format(dir=tmp_path, file=tmp_path / "r.py")), TASKS["arith"])


@pytest.mark.parametrize("value", ["mathverify", "score.py", "file.py:9lives", ":score", "file.py:not an identifier"])
def test_a_malformed_task_reward_is_refused_when_the_config_loads(value):
    with pytest.raises(ValueError, match=r"task.reward=.*expected null, math_verify, math_verify\(format_weight=W\), exact"):
        load_config(TrainConfig, REPO / "configs" / "tiny.yaml", [f"task.reward={value}"])


@pytest.mark.parametrize("key, value", [("reward_workers", "-1"), ("reward_timeout_s", "0"),
                                        ("max_reward_error_share", "1.0")])
def test_bad_reward_settings_are_named(key, value):
    with pytest.raises(ValueError, match=f"task.{key}"):
        load_config(TrainConfig, REPO / "configs" / "tiny.yaml", [f"task.{key}={value}"])


def test_null_is_the_tasks_own_reward_and_the_format_bonus_stays_out_of_the_held_out_score():
    train, held_out = reward_functions(task_cfg(), TASKS["mult"])
    assert isinstance(train, TaskReward) and held_out is train and train.fn is TASKS["mult"].reward
    assert train("p", "1*2\n#### 2", "2", {}) == 1.0
    train, held_out = reward_functions(task_cfg(reward="math_verify(format_weight=0.2)"), TASKS["math"])
    assert train("p", "\\boxed{7}", "7", {})["score"] == pytest.approx(1.2)
    assert held_out("p", "\\boxed{7}", "7", {})["score"] == 1.0  # correctness only


def test_named_built_ins_score_correctness_held_out_and_report_their_parts_as_metrics():
    train, held_out = reward_functions(task_cfg(reward="math_verify(format_weight=0.5)"), TASKS["arith"])
    assert train("p", "so \\boxed{\\frac{14}{2}}", "7", {}) == {"score": 1.5, "correct": 1.0, "boxed": 1.0}
    assert held_out("p", "so \\boxed{\\frac{14}{2}}", "7", {})["score"] == 1.0
    assert (train.bounds, held_out.bounds) == ((0.0, 1.5), (0.0, 1.0))
    exact, same = reward_functions(task_cfg(reward="exact"), TASKS["arith"])
    assert same is exact and exact("p", "\\boxed{72}", "72", {}) == {"score": 1.0}


@pytest.mark.parametrize("value, error", [
    ("math_verify(format_weigth=0.2)", r"'format_weigth=0.2' is not an option of math_verify \(its options: "
                                       r"format_weight, timeout_s"),
    ("math_verify(format_weight=-1)", r"format_weight must be >= 0, got -1.0"),
    ("math_verify(format_weight=a lot)", r"math_verify's format_weight must be a float, got 'a lot'"),
    ("exact(format_weight=0.2)", r"'format_weight=0.2' is not an option of exact \(its options: none"),
])
def test_a_built_in_rewards_bad_option_is_refused_naming_task_reward(value, error):
    with pytest.raises(ValueError, match=r"task.reward=.*" + error):
        load_config(TrainConfig, REPO / "configs" / "tiny.yaml", [f"task.reward={value}"])


@pytest.mark.parametrize("value, error", [
    ({"correct": 1.0}, r"the dict returned for prompt 'gsm8k-17' sample 2 has no 'score' \(keys: \['correct'\]\)"),
    ({"score": 1.0, "mean": 0.5}, r"metric 'mean' would be logged as reward/mean, which the run logs itself"),
    ({"score": 1.0, "note": "ok"}, r"metric 'note' of prompt 'gsm8k-17' sample 2 is 'ok'; the entries besides 'score'"),
    ("1.0", r"reward '1.0' of prompt 'gsm8k-17' sample 2 is not a finite number"),
    (float("inf"), r"reward inf of prompt 'gsm8k-17' sample 2 is not a finite number"),
])
def test_a_result_that_is_not_a_score_names_the_reward_and_the_row(value, error):
    with pytest.raises(ValueError, match=f"plug.py:score: {error}"):
        read_result(SimpleNamespace(name="plug.py:score", bounds=None), value, ROW)


def test_a_plugins_dict_gives_its_score_and_numeric_metrics():
    plugin = SimpleNamespace(name="plug.py:score", bounds=None)
    assert read_result(plugin, {"score": -2, "length": 3, "ok": True}, ROW) == (-2.0, {"length": 3.0, "ok": 1.0})
    assert read_result(plugin, 7, ROW) == (7.0, {})  # a plug-in's score has no bounds
    with pytest.raises(ValueError, match=r"math_verify: reward 1.7 of prompt 'gsm8k-17' sample 2 is outside its bounds"):
        read_result(BuiltinReward(MathVerifyReward(format_weight=0.5)), {"score": 1.7}, ROW)

