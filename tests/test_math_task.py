"""The math task: the word-problem generator and its shipped files, math-verify rewards, its check
of gold answers and its chat instruction. (Loading data files: tests/test_data_files.py.)"""

from __future__ import annotations

import threading

import pytest

from pipeline.tasks import get_task
from pipeline.tasks.make_math import DATA_DIR, make_problems, write_jsonl
from pipeline.data.files import RowFields, load_problems
from pipeline.tasks.math import BOXED_INSTRUCTION, INSTRUCTION, unreadable_answer
from pipeline.tasks.reward_plugins import BuiltinReward
from pipeline.tasks.reward_scoring import RewardRow, read_result
from pipeline.tasks.rewards import ExactAnswerReward, MathVerifyReward
from pipeline.tasks.tokenizer import build_tokenizer

TRAIN, TEST = DATA_DIR / "math_train.jsonl", DATA_DIR / "math_test.jsonl"


def test_shipped_files_are_the_generator_output_for_seed_0(tmp_path):
    for split, path, num in (("train", TRAIN, 2000), ("test", TEST, 200)):
        write_jsonl(make_problems(split, num, seed=0), tmp_path / path.name)
        assert (tmp_path / path.name).read_bytes() == path.read_bytes()


def test_test_prompts_never_occur_in_train_and_ids_are_unique():
    train, _ = load_problems(TRAIN, RowFields(response="solution"))
    test, _ = load_problems(TEST, RowFields(response="solution"))
    assert (len(train), len(test)) == (2000, 200)
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert len({p.id for p in train + test}) == 2200


def test_generator_is_deterministic_and_prefix_stable():
    assert make_problems("train", 30, seed=1) == make_problems("train", 30, seed=1)
    assert make_problems("train", 30, seed=1) != make_problems("train", 30, seed=2)
    assert make_problems("test", 10, seed=0, start=5) == make_problems("test", 15, seed=0)[5:]


def test_every_shipped_solution_earns_full_reward_and_ends_boxed():
    task = get_task("math")
    problems, _ = load_problems(TEST, RowFields(response="solution"))
    for p in problems:
        assert p.response.endswith(f"The answer is \\boxed{{{p.answer}}}.")
        assert task.reward(p.response, p.answer) == 1.0
        assert task.reward(p.response.replace(f"\\boxed{{{p.answer}}}", f"\\boxed{{{int(p.answer) + 1}}}"),
                           p.answer) == 0.0


def test_the_task_answers_are_the_arithmetic_of_the_steps():
    for p in make_problems("train", 300, seed=0):
        *steps, _ = p.response.split("\n")
        for step in steps:
            lhs, rhs = step.rstrip(".").split(" = ")
            assert eval(lhs) == int(rhs)  # noqa: S307  (our own generated "a op b")
        assert int(steps[-1].rstrip(".").split(" = ")[1]) == int(p.answer) >= 0


@pytest.mark.parametrize("response, gold, correct", [
    ("So the answer is \\boxed{7}.", "7", True),
    ("3 + 4 = 7. Tom has 7 apples.", "7", True),
    ("\\boxed{\\frac{14}{2}}", "7", True),  # symbolic equality, not string equality
    ("The answer is 7.0", "7", True),
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("\\boxed{8}", "7", False),
    ("I cannot tell.", "7", False),
])
def test_math_verify_reward_compares_values_not_strings(response, gold, correct):
    score, info = MathVerifyReward()(response, gold)
    assert (score, info["correct"]) == (float(correct), correct)


def test_format_weight_adds_a_bonus_for_a_boxed_answer():
    reward = MathVerifyReward(format_weight=0.2)
    assert reward.bounds == (0.0, 1.2)
    assert reward("\\boxed{7}", "7")[0] == pytest.approx(1.2)
    assert reward("7", "7")[0] == 1.0
    assert reward("\\boxed{8}", "7")[0] == pytest.approx(0.2)


def test_math_verify_reward_works_outside_the_main_thread():
    from math_verify import parse

    results = {}

    def worker():
        try:
            parse("\\boxed{7}", parsing_timeout=5)  # math-verify's own signal-based timeout
        except ValueError as e:
            results["plain"] = str(e)
        results["ours"] = MathVerifyReward()("\\boxed{7}", "7")[0]

    t = threading.Thread(target=worker)
    t.start()
    t.join(timeout=60)
    assert "threaded environment" in results["plain"]  # what we work around
    assert results["ours"] == 1.0


class _Broken:
    name, bounds = "broken", (0.0, 1.0)

    def __init__(self, score):
        self.score = score

    def __call__(self, response, answer):
        return self.score, {}


@pytest.mark.parametrize("score", [float("nan"), float("inf"), 1.5, -0.1])
def test_a_non_finite_or_out_of_range_score_names_the_reward_and_row(score):
    row = RewardRow(prompt_id="math-train-000042", sample=3, prompt="p", response="x", answer="1")
    with pytest.raises(ValueError, match=r"broken: reward .* of prompt 'math-train-000042' sample 3 is (not a finite|outside)"):
        read_result(BuiltinReward(_Broken(score)), BuiltinReward(_Broken(score))("p", "x", "1", {}), row)
    assert read_result(BuiltinReward(_Broken(1.0)), {"score": 1.0}, row) == (1.0, {})


def test_exact_answer_reward_reads_the_arith_answer_line_or_the_last_box():
    assert ExactAnswerReward()("1+2+0=3\n#### 3", "3") == (1.0, {"extracted": "3"})
    assert ExactAnswerReward()("#### 4", "3")[0] == 0.0
    assert ExactAnswerReward()("\\boxed{2} no: \\boxed{ \\frac{1}{2} }", "\\frac{1}{2}") == (1.0, {"extracted": " \\frac{1}{2} "})
    assert ExactAnswerReward()("\\boxed{0.5}", "\\frac{1}{2}")[0] == 0.0  # strings, not values
    assert ExactAnswerReward()("\\boxed{3", "3") == (0.0, {"extracted": None})  # never closed


def test_the_gold_answer_check_names_what_math_verify_cannot_read():
    assert unreadable_answer("\\frac{1}{2}") is None and unreadable_answer("72") is None
    assert unreadable_answer("\\boxed{") == "math-verify cannot parse the answer '\\\\boxed{'"


def test_the_default_instruction_asks_for_a_boxed_answer_after_the_question():
    assert INSTRUCTION.replace("{prompt}", "Q?") == f"Q?\n{BOXED_INSTRUCTION}"
    assert "\\boxed{}" in BOXED_INSTRUCTION


def test_stratified_prompt_order_needs_reference_responses():
    from common.config import load_config
    from launch.run.problems import prompt_loader
    from launch.run.config import TrainConfig

    cfg = load_config(TrainConfig, None, ["model.path=unused", "trainer.prompts_per_step=4",
                                          "trainer.prompt_order=stratified"])
    bare, _ = load_problems(TEST)  # no response_field: the rows carry no reference response
    with pytest.raises(ValueError, match="200 of 200 have none.*prompt_order=shuffled"):
        prompt_loader(cfg, bare)
    worked, _ = load_problems(TEST, RowFields(response="solution"))
    assert prompt_loader(cfg, worked).sizes == [len(p.response) for p in worked]
