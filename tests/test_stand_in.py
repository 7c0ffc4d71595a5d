"""`python -m pipeline.data.stand_in`: the built-in word problems written in GSM8K's and verl's layouts,
read back by `prepare` as the real files are, with the problems' answers and no id."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from pipeline.data.files import RowFields, load_problems
from pipeline.data.prepare import prepare
from pipeline.data.stand_in import main, write_stand_in
from pipeline.tasks.make_math import make_problems


@pytest.mark.parametrize("layout,suffix", [("gsm8k", ".jsonl"), ("verl", ".parquet")])
def test_a_stand_in_file_prepares_to_the_word_problems_with_their_answers(layout, suffix, tmp_path):
    src = write_stand_in(layout, tmp_path / f"raw{suffix}", rows=40, seed=3)
    rows = ([json.loads(line) for line in src.read_text().splitlines()] if suffix == ".jsonl"
            else pq.read_table(src).to_pylist())
    assert len(rows) == 40 and all("id" not in r for r in rows)  # as the public files: no id
    prepare(layout, src, tmp_path / "out", test_share=0.0)
    problems, report = load_problems(tmp_path / "out" / "train.jsonl", RowFields())
    assert not report.bad
    made = {p.prompt: p.answer for p in make_problems("train", 40, 3)}
    got = {(p.messages[-1][1] if p.messages else p.prompt): p.answer for p in problems}  # verl's: one user message
    assert got == made


def test_the_command_refuses_a_file_name_of_the_other_layout(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--layout", "verl", str(tmp_path / "x.jsonl")])
    assert "name the output file *.parquet" in capsys.readouterr().err
    assert main(["--layout", "gsm8k", str(tmp_path / "x.jsonl"), "--rows", "3"]) == 0
    assert len((tmp_path / "x.jsonl").read_text().splitlines()) == 3
