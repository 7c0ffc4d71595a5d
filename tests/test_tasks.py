"""The synthetic arithmetic task, its reward, the character tokenizer and the task CLI; what every
synthetic task's generator keeps (deterministic streams, disjoint splits), for arith and mult."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pipeline.tasks import get_task
from pipeline.tasks.arith import extract_answer, make_problems, reward, worked_solution
from pipeline.tasks.tokenizer import ALPHABET, build_tokenizer

ROOT = Path(__file__).resolve().parents[1]


SYNTHETIC = ("arith", "mult")


@pytest.mark.parametrize("task", SYNTHETIC)
def test_generator_is_deterministic_by_seed(task):
    make_problems = get_task(task).make_problems
    assert make_problems("train", 50, seed=3) == make_problems("train", 50, seed=3)
    assert make_problems("train", 50, seed=3) != make_problems("train", 50, seed=4)


@pytest.mark.parametrize("task", SYNTHETIC)
def test_a_prefix_of_a_longer_draw_equals_a_shorter_draw(task):
    make_problems = get_task(task).make_problems
    assert make_problems("test", 100, seed=0)[:40] == make_problems("test", 40, seed=0)
    assert make_problems("test", 10, seed=0, start=30) == make_problems("test", 40, seed=0)[30:]


@pytest.mark.parametrize("task", SYNTHETIC)
def test_train_and_test_splits_share_no_prompt_and_no_id(task):
    make_problems = get_task(task).make_problems
    train = make_problems("train", 3000, seed=0)
    test = make_problems("test", 300, seed=0)
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert not {p.id for p in train} & {p.id for p in test}
    assert test[123].id == f"{task}-test-000123"


def test_reference_response_ends_with_the_correct_answer():
    for p in make_problems("train", 500, seed=1):
        a, b = map(int, p.prompt.strip().split("+"))
        assert p.answer == str(a + b)
        assert p.response.splitlines()[-1] == f"#### {p.answer}"
        assert extract_answer(p.response) == p.answer


def test_worked_solution_has_one_step_per_column_with_carries():
    assert worked_solution(4728, 395) == "8+5+0=13\n2+9+1=12\n7+3+1=11\n4+0+1=5\n#### 5123"
    assert worked_solution(1, 999).splitlines()[-2:] == ["0+9+1=10", "#### 1000"]
    assert worked_solution(0, 0) == "0+0+0=0\n#### 0"


def test_reward_is_one_for_the_reference_and_zero_for_a_wrong_answer():
    task = get_task("arith")
    for p in make_problems("test", 200, seed=2):
        assert task.reward(p.response, p.answer) == 1.0
        wrong = str(int(p.answer) + 1)
        assert reward(p.response.replace(f"#### {p.answer}", f"#### {wrong}"), p.answer) == 0.0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3+5+0=8\n#### 8", "8"),
        ("#### 1\n#### 12", "12"),  # the last answer line counts
        ("#### 0012", "0012"),  # no normalisation: "0012" is not "12"
        ("3+5+0=8\n#### ", None),
        ("no answer here", None),
        ("#### 8x", None),
    ],
)
def test_extract_answer_reads_the_last_answer_line_exactly(text, expected):
    assert extract_answer(text) == expected


def test_unknown_split_and_task_raise_value_error():
    with pytest.raises(ValueError, match="unknown split"):
        make_problems("dev", 1, seed=0)
    with pytest.raises(ValueError, match="unknown task"):
        get_task("gsm8k-typo")


def test_response_lengths_are_long_tailed():
    tok = build_tokenizer()
    lengths = sorted(len(tok(p.response, add_special_tokens=False).input_ids) + 1 for p in make_problems("train", 2000, seed=0))
    median, p99 = statistics.median(lengths), lengths[int(0.99 * len(lengths))]
    assert p99 >= 3 * median, (median, p99)
    assert lengths[-1] < tok.model_max_length - 32  # the longest problem and its prompt fit a context


def test_tokenizer_round_trips_every_character_of_generated_text():
    tok = build_tokenizer()
    problems = make_problems("train", 300, seed=0) + make_problems("test", 100, seed=0)
    for p in problems:
        full = p.prompt + p.response
        ids = tok(full).input_ids
        assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
        assert len(ids) == len(full) + 1  # one token per character
        assert tok.decode(ids, skip_special_tokens=True) == full
    assert set(ALPHABET) >= set("".join(p.prompt + p.response for p in problems))


def test_prompt_and_response_encodings_concatenate():
    tok = build_tokenizer()
    p = make_problems("test", 1, seed=0)[0]
    prompt = tok(p.prompt).input_ids
    response = tok(p.response, add_special_tokens=False).input_ids
    assert prompt + response == tok(p.prompt + p.response).input_ids
    assert tok.bos_token_id not in response and tok.eos_token_id not in prompt + response


def test_tokenizer_loads_back_through_auto_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "4728+395\n8+5+0=13\n#### 5123"
    assert loaded(text).input_ids == tok(text).input_ids
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert loaded.decode(loaded(text).input_ids + [loaded.eos_token_id], skip_special_tokens=True) == text


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pipeline.tasks", *args], capture_output=True, text=True, env=env, cwd=ROOT)


def test_cli_writes_n_valid_lines(tmp_path):
    out = tmp_path / "test.jsonl"
    proc = run_cli("--task", "arith", "--split", "test", "--num", "25", "--seed", "7", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    expected = make_problems("test", 25, seed=7)
    assert rows == [{"id": p.id, "prompt": p.prompt, "answer": p.answer} for p in expected]


@pytest.mark.parametrize(
    "args, message",
    [
        (("--task", "nope", "--num", "3"), "unknown task 'nope'"),
        (("--task", "arith", "--num", "0"), "--num must be > 0"),
        (("--task", "arith", "--num", "3", "--split", "dev"), "invalid choice"),
    ],
)
def test_cli_rejects_bad_args_with_exit_code_2(tmp_path, args, message):
    proc = run_cli(*args, "--out", str(tmp_path / "x.jsonl"))
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x.jsonl").exists()


def test_the_careless_solution_drops_only_the_last_columns_carry():
    from pipeline.tasks.arith import careless_solution

    assert careless_solution(65, 58) == "5+8+0=13\n6+5+1=12\n#### 23"  # 123 without its carry
    assert careless_solution(7, 8).splitlines()[-1] == "#### 5"
    assert careless_solution(4728, 395) == worked_solution(4728, 395)  # the last column does not carry
    assert reward(careless_solution(65, 58), "123") == 0.0
