"""Data files: field paths, rows from JSONL / JSON / parquet, text and chat-message prompts, hashed
ids, bad rows and duplicates reported, chat rendering, and a row's problem in its run."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pipeline.data.chat import check_instruction, conversation, encode_problem, parse_messages, render
from pipeline.data.fields import MISSING, field, read_rows
from pipeline.data.files import RowFields, load_problems, prompt_id
from pipeline.tasks.arith import Problem
from pipeline.tasks.tokenizer import build_tokenizer

# A chat template in the character tokenizer's alphabet: system turns open with '#', user turns with '*'.
TEMPLATE = ("{% for m in messages %}{{ '#' if m.role == 'system' else '*' }}{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}={% endif %}")
SMOLLM2 = Path("checkpoints/smollm2-135m-instruct")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def chat_tokenizer():
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def verl_row(i: int) -> dict:
    return {"data_source": "gsm8k", "ability": "math",
            "prompt": [{"role": "user", "content": f"What is {i} + 1? Let's think step by step."}],
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"index": i, "split": "train"}}


# --- fields and rows ---------------------------------------------------------------------------

def test_field_paths_reach_nested_objects_list_items_and_dotted_keys():
    row = {"reward_model": {"ground_truth": "7"}, "prompt": [{"role": "user", "content": "q"}], "a.b": 1,
           "a": {"c": 2}, "none": None}
    assert field(row, "reward_model.ground_truth") == "7"
    assert field(row, "prompt.0.content") == "q"
    assert field(row, "a.b") == 1 and field(row, "a.c") == 2
    for absent in ("reward_model.style", "prompt.1.content", "prompt.x", "none", "nothing", "a.b.c"):
        assert field(row, absent) is MISSING


def test_rows_carry_their_file_line_or_row_number(tmp_path):
    jsonl = write_jsonl(tmp_path / "a.jsonl", ['{"x": 1}', "", "not json", "[1]"])
    rows = read_rows(jsonl)
    assert [line for line, _ in rows] == [1, 3, 4]
    assert rows[0][1] == {"x": 1} and isinstance(rows[1][1], json.JSONDecodeError) and rows[2][1] == [1]
    (tmp_path / "b.json").write_text(json.dumps([{"x": 1}, {"x": 2}]))
    assert read_rows(tmp_path / "b.json") == [(1, {"x": 1}), (2, {"x": 2})]
    assert read_rows(write_parquet(tmp_path / "c.parquet", [{"x": 5}, {"x": 6}])) == [(1, {"x": 5}), (2, {"x": 6})]


def test_missing_empty_and_unsupported_files_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="data file not found"):
        load_problems(tmp_path / "none.jsonl")
    with pytest.raises(ValueError, match="no rows"):
        load_problems(write_jsonl(tmp_path / "e.jsonl", [""]))
    (tmp_path / "m.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"unsupported data file type '\.csv'; expected one of \.jsonl, \.json, \.parquet"):
        load_problems(tmp_path / "m.csv")


# --- problems from rows ------------------------------------------------------------------------

def test_a_verl_parquet_loads_with_a_dotted_answer_path_and_chat_message_prompts(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", [verl_row(i) for i in range(3)])
    problems, report = load_problems(path, RowFields(answer="reward_model.ground_truth"))
    assert report.rows == 3 and not report.bad
    p = problems[1]
    assert p.messages == (("user", "What is 1 + 1? Let's think step by step."),)
    assert p.prompt == "What is 1 + 1? Let's think step by step." and p.answer == "2"
    assert p.id == prompt_id(verl_row(1)["prompt"])  # no id field: the prompt's hash
    assert p.extra == {"data_source": "gsm8k", "ability": "math", "reward_model": {"style": "rule", "ground_truth": "2"},
                       "extra_info": {"index": 1, "split": "train"}}


def test_text_prompts_numeric_answers_worked_solutions_and_other_fields_load(tmp_path):
    rows = [{"question": "Half of one?", "final": "\\frac{1}{2}", "steps": "1/2", "level": 3},
            {"question": "Two?", "final": 2, "steps": "2", "level": 1}]
    path = write_jsonl(tmp_path / "gsm.jsonl", rows)
    problems, _ = load_problems(path, RowFields(prompt="question", answer="final", response="steps"))
    assert [(p.prompt, p.answer, p.response, p.extra, p.messages) for p in problems] == [
        ("Half of one?", "\\frac{1}{2}", "1/2", {"level": 3}, ()), ("Two?", "2", "2", {"level": 1}, ())]


def test_ids_are_the_rows_own_or_a_hash_of_the_prompt_stable_under_reordering(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": "1"} for i in range(5)] + [{"id": 17, "prompt": "q5", "answer": "1"}]
    first, _ = load_problems(write_jsonl(tmp_path / "a.jsonl", rows))
    again, _ = load_problems(write_jsonl(tmp_path / "b.jsonl", rows[::-1]))
    assert [p.id for p in first] == [prompt_id(f"q{i}") for i in range(5)] + ["17"]
    assert {p.id: p.prompt for p in first} == {p.id: p.prompt for p in again}
    assert prompt_id("q0").startswith("h-") and len(prompt_id("q0")) == 18
    assert prompt_id("q0") != prompt_id([{"role": "user", "content": "q0"}])  # text and messages are other prompts
    hashed, _ = load_problems(tmp_path / "a.jsonl", RowFields(id=None))
    assert hashed[-1].id == prompt_id("q5")


def test_duplicate_ids_are_bad_rows_and_duplicate_prompts_are_reported(tmp_path, caplog):
    rows = [{"prompt": "same", "answer": "1"}, {"prompt": "same", "answer": "1"},  # one hash id twice: bad
            {"id": "a", "prompt": "twice", "answer": "2"}, {"id": "b", "prompt": "twice", "answer": "2"}]
    rows += [{"prompt": f"q{i}", "answer": "1"} for i in range(200)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="pipeline.data.files"):
        problems, report = load_problems(path)
    assert len(problems) == 203 and len(report.bad) == 1
    assert str(report.bad[0]) == f"{path}:2 (id {prompt_id('same')}): duplicate id '{prompt_id('same')}' (first on line 1)"
    assert [str(d) for d in report.duplicate_prompts] == [f"{path}:4 (id b): the same prompt as line 3 (id a)"]
    assert f"{path}:4 (id b): the same prompt" in caplog.text
    assert report.metrics == {"data/rows": 204.0, "data/bad_rows": 1.0, "data/duplicate_prompts": 1.0}


BAD_LINES = [
    '{"id": "b1", "prompt": "no answer here"}',  # missing field
    '{"id": "b2", "prompt": "x", "answer": "  "}',  # empty answer
    "not json at all",
    '{"id": "q0", "prompt": "again", "answer": "1"}',  # duplicate id
    '{"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "answer": "1"}',
]


def test_bad_rows_are_reported_by_file_line_and_id_and_counted(tmp_path, caplog):
    lines = [json.dumps({"id": f"q{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)}) for i in range(500)]
    path = write_jsonl(tmp_path / "m.jsonl", lines + BAD_LINES)
    with caplog.at_level(logging.WARNING, logger="pipeline.data.files"):
        problems, report = load_problems(path)
    assert len(problems) == 500 and report.rows == 505
    assert [str(b) for b in report.bad] == [
        f"{path}:501 (id b1): missing field 'answer'",
        f"{path}:502 (id b2): field 'answer' must be a non-empty string, got '  '",
        f"{path}:503: not valid JSON (Expecting value)",
        f"{path}:504 (id q0): duplicate id 'q0' (first on line 1)",
        f"{path}:505 (id {prompt_id(json.loads(BAD_LINES[4])['prompt'])}): the last message must be a non-empty user "
        "turn (the assistant replies to it), got a assistant turn 'yo'"]
    assert f"{path}:501 (id b1): missing field 'answer'" in caplog.text


def test_too_many_bad_rows_stop_the_load_with_the_first_ones_shown(tmp_path):
    lines = [json.dumps({"id": f"q{i}", "prompt": f"{i}?", "answer": "1"}) for i in range(100)]
    path = write_jsonl(tmp_path / "m.jsonl", lines + BAD_LINES[:2])
    with pytest.raises(ValueError, match=r"(?s)2 of 102 rows are malformed .*max_bad_share=1\.0%.*m\.jsonl:101 \(id b1\)"):
        load_problems(path)
    problems, _ = load_problems(path, max_bad_share=0.05)
    assert len(problems) == 100


def test_the_callers_check_makes_bad_rows_naming_the_reason(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "prompt": "short", "answer": "1"},
                                              {"id": "b", "prompt": "much too long", "answer": "1"}])
    problems, report = load_problems(path, max_bad_share=0.5,
                                     check=lambda p: "too long" if len(p.prompt) > 5 else None)
    assert [p.id for p in problems] == ["a"] and str(report.bad[0]) == f"{path}:2 (id b): too long"


@pytest.mark.parametrize("messages, error", [
    ([], "non-empty list"),
    ("text", "non-empty list"),
    ([{"role": "user"}], "string \"role\" and a \"content\""),
    ([{"role": "tool", "content": "x"}], "role 'tool'; expected one of system, user, assistant"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "content must be a string"),
    ([{"role": "user", "content": "  "}], "non-empty user turn"),
])
def test_malformed_chat_messages_say_what_is_wrong(messages, error):
    with pytest.raises(ValueError, match=error):
        parse_messages(messages)


# --- chat --------------------------------------------------------------------------------------

def test_text_prompts_get_the_system_prompt_and_instruction_and_messages_stay_as_given():
    text = Problem(id="t", prompt="Q?", answer="1", response="")
    chat = Problem(id="m", prompt="Q?", answer="1", response="", messages=(("user", "Q? Answer: N"),))
    system = Problem(id="s", prompt="Q?", answer="1", response="", messages=(("system", "mine"), ("user", "Q?")))
    assert conversation(text, system_prompt=None, instruction="{prompt}!") == (("user", "Q?!"),)
    assert conversation(text, system_prompt="Be brief.", instruction="Solve: {prompt}") == (
        ("system", "Be brief."), ("user", "Solve: Q?"))
    assert conversation(chat, system_prompt="Be brief.", instruction="{prompt}!") == (
        ("system", "Be brief."), ("user", "Q? Answer: N"))
    assert conversation(system, system_prompt="Be brief.", instruction="{prompt}!") == system.messages
    with pytest.raises(ValueError, match=r"holds \{prompt\} exactly once"):
        check_instruction("no placeholder")


def test_chat_prompts_render_in_the_tokenizers_template():
    tok = chat_tokenizer()
    p = Problem(id="m", prompt="1+1", answer="2", response="", messages=(("system", "0"), ("user", "1+1")))
    assert tok.decode(encode_problem(tok, p, chat=True)) == "#0\n*1+1\n="  # no <bos>: the template owns the specials
    with pytest.raises(ValueError, match="only a chat run renders: set task.chat=true"):
        encode_problem(tok, p, chat=False)
    bare = Problem(id="t", prompt="1+1", answer="2", response="")
    with pytest.raises(ValueError, match="no conversation to render"):
        encode_problem(tok, bare, chat=True)
    assert encode_problem(tok, bare, chat=False) == list(tok("1+1")["input_ids"])
    tok.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        render(tok, p.messages)


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").exists(), reason="needs `make models` (SmolLM2's tokenizer)")
def test_smollm2s_template_renders_a_verl_prompt_as_transformers_does():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    messages = verl_row(4)["prompt"]
    p = Problem(id="v", prompt=messages[0]["content"], answer="5", response="", messages=parse_messages(messages))
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.decode(encode_problem(tok, p, chat=True)) == expected
    assert expected.endswith("<|im_start|>user\nWhat is 4 + 1? Let's think step by step.<|im_end|>\n<|im_start|>assistant\n")
