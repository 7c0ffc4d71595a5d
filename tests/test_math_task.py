"""The math task: the word-problem generator and its shipped files, math-verify rewards, and
loading math files with bad rows reported, counted and bounded."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

from pipeline.tasks import get_task
from pipeline.tasks.make_math import DATA_DIR, make_problems, write_jsonl
from pipeline.tasks.math import BOXED_INSTRUCTION, chat_prompt, load_math_file
from pipeline.tasks.rewards import ExactAnswerReward, MathVerifyReward, checked
from pipeline.tasks.tokenizer import build_tokenizer

TRAIN, TEST = DATA_DIR / "math_train.jsonl", DATA_DIR / "math_test.jsonl"


def test_shipped_files_are_the_generator_output_for_seed_0(tmp_path):
    for split, path, num in (("train", TRAIN, 2000), ("test", TEST, 200)):
        write_jsonl(make_problems(split, num, seed=0), tmp_path / path.name)
        assert (tmp_path / path.name).read_bytes() == path.read_bytes()


def test_test_prompts_never_occur_in_train_and_ids_are_unique():
    train, _ = load_math_file(TRAIN, response_field="solution")
    test, _ = load_math_file(TEST, response_field="solution")
    assert (len(train), len(test)) == (2000, 200)
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert len({p.id for p in train + test}) == 2200


def test_generator_is_deterministic_and_prefix_stable():
    assert make_problems("train", 30, seed=1) == make_problems("train", 30, seed=1)
    assert make_problems("train", 30, seed=1) != make_problems("train", 30, seed=2)
    assert make_problems("test", 10, seed=0, start=5) == make_problems("test", 15, seed=0)[5:]


def test_every_shipped_solution_earns_full_reward_and_ends_boxed():
    task = get_task("math")
    problems, _ = load_math_file(TEST, response_field="solution")
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
    with pytest.raises(ValueError, match=r"reward 'broken' .* row math-train-000042"):
        checked(_Broken(score), "x", "1", row="math-train-000042")
    assert checked(_Broken(1.0), "x", "1", row="r") == (1.0, {})


def test_exact_answer_reward_is_the_arith_reward():
    assert ExactAnswerReward()("1+2+0=3\n#### 3", "3") == (1.0, {"extracted": "3"})
    assert ExactAnswerReward()("#### 4", "3")[0] == 0.0


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def _good(i: int) -> str:
    return json.dumps({"id": f"q{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)})


BAD_LINES = [
    '{"id": "b1", "prompt": "no answer here"}',  # missing field
    '{"id": "b2", "prompt": "x", "answer": "\\\\boxed{"}',  # unparsable answer
    "not json at all",
    '{"id": "q0", "prompt": "again", "answer": "1"}',  # duplicate id
]


def test_bad_rows_are_reported_with_file_and_line_and_counted(tmp_path, caplog):
    lines = [_good(i) for i in range(400)] + BAD_LINES
    path = _write_jsonl(tmp_path / "m.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="pipeline.tasks.math"):
        problems, report = load_math_file(path)
    assert len(problems) == 400 and report.rows == 404
    assert [(b.line, b.reason.split(" ")[0]) for b in report.bad] == [
        (401, "missing"), (402, "math-verify"), (403, "not"), (404, "duplicate")]
    assert "duplicate id 'q0' (first on line 1)" in report.bad[3].reason
    assert f"{path}:401: missing field 'answer'" in caplog.text
    assert report.metrics == {"data/rows": 404.0, "data/bad_rows": 4.0}


def test_too_many_bad_rows_stop_the_load_with_the_first_ones_shown(tmp_path):
    path = _write_jsonl(tmp_path / "m.jsonl", [_good(i) for i in range(100)] + BAD_LINES[:2])
    with pytest.raises(ValueError, match=r"(?s)2 of 102 rows are malformed .*max_bad_share=1\.0%.*m\.jsonl:101"):
        load_math_file(path)
    problems, _ = load_math_file(path, max_bad_share=0.05)
    assert len(problems) == 100


def test_custom_fields_numeric_answers_and_numbered_rows(tmp_path):
    rows = [{"question": "Half of one?", "solution": "\\frac{1}{2}"}, {"question": "Two?", "solution": 2}]
    path = _write_jsonl(tmp_path / "gsm.jsonl", [json.dumps(r) for r in rows])
    with pytest.raises(ValueError, match="missing field 'id' \\(id_field=None numbers the rows instead\\)"):
        load_math_file(path, prompt_field="question", answer_field="solution")
    problems, report = load_math_file(path, prompt_field="question", answer_field="solution", id_field=None)
    assert [(p.id, p.prompt, p.answer) for p in problems] == [("gsm-1", "Half of one?", "\\frac{1}{2}"),
                                                              ("gsm-2", "Two?", "2")]
    assert MathVerifyReward()("It is \\boxed{0.5}.", problems[0].answer)[0] == 1.0


def test_parquet_files_load_and_report_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": ["1+1?", "", "2+2?"], "answer": ["2", "3", "4"]}), path)
    problems, report = load_math_file(path, max_bad_share=0.5)
    assert [p.id for p in problems] == ["a", "c"]
    assert str(report.bad[0]) == f"{path}:2: field 'prompt' must be a non-empty string, got ''"


def test_missing_empty_and_unsupported_files_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="math file not found"):
        load_math_file(tmp_path / "none.jsonl")
    with pytest.raises(ValueError, match="no rows"):
        load_math_file(_write_jsonl(tmp_path / "e.jsonl", [""]))
    (tmp_path / "m.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="expected .jsonl or .parquet"):
        load_math_file(tmp_path / "m.csv")


def test_chat_prompt_wraps_the_question_in_the_tokenizers_template():
    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    text = chat_prompt(tok, "Tom has 3 apples. How many?")
    assert text == f"<|user|>Tom has 3 apples. How many?\n{BOXED_INSTRUCTION}\n<|assistant|>"


def test_stratified_prompt_order_needs_reference_responses():
    from launch.config import load_config
    from launch.run import prompt_loader
    from launch.run_config import TrainConfig

    cfg = load_config(TrainConfig, None, ["model.path=unused", "trainer.prompts_per_step=4",
                                          "trainer.prompt_order=stratified"])
    bare, _ = load_math_file(TEST)  # no response_field: the rows carry no reference response
    with pytest.raises(ValueError, match="200 of 200 have none.*prompt_order=shuffled"):
        prompt_loader(cfg, bare)
    worked, _ = load_math_file(TEST, response_field="solution")
    assert prompt_loader(cfg, worked).sizes == [len(p.response) for p in worked]
