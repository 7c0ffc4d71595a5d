"""The multiply-add task: worked solutions, reward, long-tailed lengths, splits, the careless and checking teachers."""

from __future__ import annotations

import statistics

import pytest

from pipeline.tasks import get_task
from pipeline.tasks.mult import (careless_solution, checked_solution, drop_carry, make_problems, operands, reward,
                                 worked_solution)
from pipeline.tasks.tokenizer import ALPHABET, build_tokenizer


def test_worked_solution_adds_a_b_times_counting_down():
    assert worked_solution(35, 7, 4) == "3;35+7=42\n2;42+7=49\n1;49+7=56\n0;56+7=63\n#### 63"
    assert worked_solution(0, 2, 1) == "0;0+2=2\n#### 2"
    assert worked_solution(98, 9, 2) == "1;98+9=107\n0;107+9=116\n#### 116"
    with pytest.raises(ValueError, match="count b must be >= 1"):
        worked_solution(1, 2, 0)


def test_the_reference_answer_is_the_value_on_random_problems():
    for p in make_problems("train", 2000, seed=1) + make_problems("test", 300, seed=1):
        c, a, b = operands(p.prompt)
        assert p.answer == str(eval(p.prompt)) == str(c + a * b)
        lines = p.response.splitlines()
        assert lines[-1] == f"#### {p.answer}" and len(lines) == b + 1
        total = c
        for left, line in zip(range(b - 1, -1, -1), lines):  # every step is one right addition
            assert line == f"{left};{total}+{a}={total + a}"
            total += a


def test_the_reward_accepts_the_right_answer_and_rejects_wrong_or_malformed_ones():
    task = get_task("mult")
    for p in make_problems("test", 200, seed=2):
        assert task.reward(p.response, p.answer) == 1.0
        wrong = str(int(p.answer) + 1)
        assert reward(p.response.replace(f"#### {p.answer}", f"#### {wrong}"), p.answer) == 0.0
    p = make_problems("test", 1, seed=2)[0]
    body = p.response.rpartition("\n")[0]
    malformed = [body, body + "\n####", body + f"\n{p.answer}", body + f"\n#### {p.answer}+0", body + f"\n#### 0{p.answer}",
                 body + f"\n#### {p.answer}\n#### 1", ""]
    for text in malformed:
        assert reward(text, p.answer) == 0.0, text
    assert reward(f"#### {p.answer}\n0;1+2=3", p.answer) == 1.0  # the last answer line counts, wherever it is


def token_lengths(problems) -> list[int]:
    tok = build_tokenizer()
    return [len(tok(p.response, add_special_tokens=False).input_ids) + 1 for p in problems]  # + eos


def test_response_lengths_are_long_tailed_within_a_step_of_32_prompts():
    lengths = token_lengths(make_problems("train", 32 * 24, seed=0))
    ratios, medians = [], []
    for b in range(0, len(lengths), 32):
        batch = lengths[b : b + 32]
        medians.append(statistics.median(batch))
        ratios.append(max(batch) / medians[-1])
    assert statistics.median(ratios) >= 10, ratios  # a step's longest response many times its median
    assert sum(r >= 8 for r in ratios) >= 0.75 * len(ratios), ratios
    assert statistics.median(medians) >= 25, medians  # the median response is not tiny


def test_the_longest_problem_fits_a_1024_token_context():
    tok = build_tokenizer()
    prompt, response = tok("99+9*64\n").input_ids, tok(worked_solution(99, 9, 64), add_special_tokens=False).input_ids
    assert len(prompt) + len(response) + 1 <= 1024 - 128  # room for a sampled response that runs long


def test_a_larger_tail_exponent_gives_shorter_responses():
    short = statistics.mean(token_lengths(make_problems("train", 500, seed=0, tail=3.0)))
    default = statistics.mean(token_lengths(make_problems("train", 500, seed=0)))
    assert short < default / 2


def test_the_careless_teacher_drops_the_carry_of_the_last_addition_only():
    assert careless_solution("35+7*4\n") == "3;35+7=42\n2;42+7=49\n1;49+7=56\n0;56+7=53\n#### 53"
    assert careless_solution("31+2*3\n") == worked_solution(31, 2, 3)  # 35 + 2 does not carry
    assert (drop_carry(56, 7), drop_carry(59, 1), drop_carry(199, 9), drop_carry(40, 9)) == (53, 50, 198, 49)
    assert reward(careless_solution("35+7*4\n"), "63") == 0.0


def test_careless_responses_are_wrong_exactly_where_the_last_addition_carries():
    problems = make_problems("train", 1000, seed=5)
    wrong = 0
    for p in problems:
        c, a, b = operands(p.prompt)
        last_total = c + a * (b - 1)
        careful, careless = p.response.splitlines(), careless_solution(p.prompt).splitlines()
        assert careless[:-2] == careful[:-2]  # every step but the last is the careful teacher's
        carries = last_total % 10 + a >= 10
        assert (reward("\n".join(careless), p.answer) == 0.0) == carries
        wrong += carries
    assert 0.4 < wrong / len(problems) < 0.7  # the slip matters on about half the problems


def test_every_character_is_in_the_tokenizers_alphabet():
    tok = build_tokenizer()
    for p in make_problems("train", 300, seed=0):
        text = p.prompt + p.response + careless_solution(p.prompt)
        assert set(text) <= set(ALPHABET)
        assert tok.unk_token_id not in tok(text).input_ids


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(split="dev"), "unknown split"),
        (dict(max_count=0), "max_count"),
        (dict(tail=-1.0), "tail"),
        (dict(num=-1), "num and start"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, message):
    args = dict(split="train", num=1, seed=0) | kwargs
    with pytest.raises(ValueError, match=message):
        make_problems(**args)


def test_operands_reject_what_is_not_a_prompt_of_the_task():
    assert operands("35+7*4\n") == (35, 7, 4)
    with pytest.raises(ValueError, match="not a c\\+a\\*b prompt"):
        operands("4728+395\n")


def test_a_checked_response_works_the_problem_twice_and_its_careful_check_repairs_a_careless_slip():
    careful = worked_solution(35, 7, 4)
    assert checked_solution("35+7*4\n", careless=False) == careful + "\n" + careful
    slipped = checked_solution("35+7*4\n", careless=True)
    assert slipped == careless_solution("35+7*4\n") + "\n" + careful
    assert reward(careless_solution("35+7*4\n"), "63") == 0.0 and reward(slipped, "63") == 1.0  # the last answer counts
    assert set(slipped) <= set(ALPHABET)


def test_the_longest_checked_problem_fits_a_2048_token_context():
    tok = build_tokenizer()
    prompt = tok("99+9*64\n").input_ids
    response = tok(checked_solution("99+9*64\n", careless=False), add_special_tokens=False).input_ids
    assert len(prompt) + len(response) + 1 <= 1792 <= tok.model_max_length  # configs/tiny-check.yaml's budget
