"""`python -m pipeline.data.prepare`: each public layout (fixtures written here) converted to the run's
layout, split by id hash as a run's held-out share is, loadable by the run with its default fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.data.files import RowFields, load_problems, prompt_id
from pipeline.data.layouts import convert, last_boxed
from pipeline.data.prepare import main, prepare
from pipeline.data.split import is_held_out
from tests.test_data_files import verl_row, write_jsonl, write_parquet

N = 200


def gsm8k_rows(n: int = N) -> list[dict]:
    return [{"question": f"Tom has {i} apples and buys 1,000 more. How many?",
             "answer": f"He has {i} + 1000 = <<{i}+1000={i + 1000}>>{i + 1000} apples.\n#### {i + 1000:,}"} for i in range(n)]


def math_rows(n: int = N) -> list[dict]:
    rows = [{"problem": f"Compute $\\frac{{{i}}}{{2}}$.", "level": "Level 1", "type": "Algebra",
             "solution": f"Halving gives $\\boxed{{\\frac{{{i}}}{{2}}}}$."} for i in range(n)]
    rows[0]["answer"] = "0"  # MATH-500's answer column wins over the boxed solution
    return rows


def trl_rows(n: int = N) -> list[dict]:
    return [{"prompt": [{"role": "system", "content": "Think."}, {"role": "user", "content": f"{i} + {i}?"}],
             "solution": f"${2 * i}$"} for i in range(n)]


LAYOUTS = {  # format -> (rows, writer suffix, what the first converted row holds)
    "gsm8k": (gsm8k_rows, ".jsonl", {"prompt": "Tom has 0 apples and buys 1,000 more. How many?", "answer": "1000"}),
    "math": (math_rows, ".json", {"prompt": "Compute $\\frac{0}{2}$.", "answer": "0", "level": "Level 1"}),
    "verl": (lambda n=N: [verl_row(i) for i in range(n)], ".parquet",
             {"prompt": [{"role": "user", "content": "What is 0 + 1? Let's think step by step."}], "answer": "1",
              "data_source": "gsm8k", "extra_info": {"index": 0, "split": "train"}}),
    "dapo": (lambda n=N: [verl_row(i) for i in range(n)], ".parquet", {"answer": "1", "ability": "math"}),
    "trl": (trl_rows, ".parquet", {"answer": "$0$", "solution": "$0$"}),
}


def write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        return write_parquet(path, rows)
    if path.suffix == ".json":
        path.write_text(json.dumps(rows))
        return path
    return write_jsonl(path, rows)


@pytest.mark.parametrize("fmt", list(LAYOUTS))
def test_each_layout_round_trips_into_the_runs_layout_with_its_split(fmt, tmp_path, capsys):
    make, suffix, first = LAYOUTS[fmt]
    source = write(tmp_path / f"in{suffix}", make())
    assert main(["--format", fmt, str(source), str(tmp_path / "out"), "--test-share", "0.2"]) == 0
    printed = capsys.readouterr().out
    train, _ = load_problems(tmp_path / "out" / "train.jsonl")  # the run's default fields read it
    test, _ = load_problems(tmp_path / "out" / "test.jsonl")
    assert len(train) + len(test) == N and 20 < len(test) < 60
    assert all(is_held_out(p.id, 0.2) for p in test) and not any(is_held_out(p.id, 0.2) for p in train)
    assert f"{fmt}: {N} rows from {source} (1 file), 0 bad, 0 duplicate prompts dropped" in printed
    assert f"train: {len(train)} rows -> {tmp_path / 'out' / 'train.jsonl'}" in printed
    assert f"test: {len(test)} rows -> {tmp_path / 'out' / 'test.jsonl'}" in printed
    rows = {r["id"]: r for r in map(json.loads, (tmp_path / "out" / "train.jsonl").read_text().splitlines())}
    rows.update({r["id"]: r for r in map(json.loads, (tmp_path / "out" / "test.jsonl").read_text().splitlines())})
    converted = convert(fmt, make(1)[0])
    assert converted["id"] == prompt_id(converted["prompt"]) and rows[converted["id"]] == converted
    assert {k: converted[k] for k in first} == first


def test_the_split_holds_out_what_a_runs_eval_share_would(tmp_path):
    source = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows())
    prepare("gsm8k", source, tmp_path / "all", test_share=0)
    prepare("gsm8k", source, tmp_path / "split", test_share=0.1)
    assert not (tmp_path / "all" / "test.jsonl").exists()
    everything, _ = load_problems(tmp_path / "all" / "train.jsonl")
    test, _ = load_problems(tmp_path / "split" / "test.jsonl")
    assert [p.id for p in test] == [p.id for p in everything if is_held_out(p.id, 0.1)]
    prepare("gsm8k", source, tmp_path / "only-test", test_share=1)
    assert not (tmp_path / "only-test" / "train.jsonl").exists()
    assert len(load_problems(tmp_path / "only-test" / "test.jsonl")[0]) == N


def test_a_folder_of_math_json_files_and_parquet_output(tmp_path):
    for i, row in enumerate(math_rows(30)):
        (tmp_path / "MATH" / "train" / row["type"].lower()).mkdir(parents=True, exist_ok=True)
        (tmp_path / "MATH" / "train" / row["type"].lower() / f"{i}.json").write_text(json.dumps(row))
    lines = prepare("math", tmp_path / "MATH", tmp_path / "out", test_share=0.5, suffix=".parquet")
    assert lines[0].startswith(f"math: 30 rows from {tmp_path / 'MATH'} (30 files), 0 bad")
    train, _ = load_problems(tmp_path / "out" / "train.parquet", RowFields(response="solution"))
    test, _ = load_problems(tmp_path / "out" / "test.parquet")
    assert len(train) + len(test) == 30 and train[0].response.startswith("Halving gives")


def test_bad_rows_are_reported_duplicates_dropped_and_too_many_refused(tmp_path, capsys):
    rows = gsm8k_rows()
    rows += [{"question": "No final line?", "answer": "It is 4."}, rows[3], dict(rows[4], answer="x\n#### 5")]
    source = write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    assert main(["--format", "gsm8k", str(source), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"gsm8k: {N + 3} rows from {source} (1 file), 1 bad, 2 duplicate prompts dropped (1 with another answer)" in out
    assert f"{source}:{N + 1}: field 'answer' has no '#### N' final answer line: 'It is 4.'" in out
    source = write_jsonl(tmp_path / "bad.jsonl", gsm8k_rows(10) + [{"question": "q"}])
    assert main(["--format", "gsm8k", str(source), str(tmp_path / "out2")]) == 1
    assert f"1 of 11 rows are malformed (9.1%, more than max_bad_share=1.0%)" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()


def test_missing_input_and_unknown_format_are_refused(tmp_path, capsys):
    assert main(["--format", "gsm8k", str(tmp_path / "none.jsonl"), str(tmp_path / "out")]) == 1
    assert "input not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--format", "alpaca", str(tmp_path), str(tmp_path / "out")])
    with pytest.raises(ValueError, match="unknown format 'alpaca'"):
        convert("alpaca", {})


@pytest.mark.parametrize("text, boxed", [
    ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("\\boxed{1} then \\boxed{x^{2}}", "x^{2}"),
    ("\\fbox{7}", "7"),
    ("\\boxed 5$", "5"),
    ("\\boxed{unclosed", None),
    ("no box", None),
])
def test_the_last_boxed_answer_is_found_with_nested_braces(text, boxed):
    assert last_boxed(text) == boxed
