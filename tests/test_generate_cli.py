"""`python -m launch.generate`: output format, and bad input exits non-zero without a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.generate", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def write_prompts(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_cli_writes_one_line_per_sample_with_the_documented_fields(char_model_dir, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "12+34="}, {"id": 7, "prompt": "5*6="}])
    out = tmp_path / "out.jsonl"
    res = run_cli("--model", str(char_model_dir), "--prompts", prompts, "--n", "3", "--max-new-tokens", "12",
                  "--temperature", "1.0", "--top-p", "0.9", "--seed", "1", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "tok/s" in res.stdout
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["id"], x["sample"]) for x in lines] == [("a", 0), ("a", 1), ("a", 2), ("7", 0), ("7", 1), ("7", 2)]
    for x in lines:
        assert set(x) == {"id", "sample", "prompt_tokens", "tokens", "text", "logprobs", "finish_reason"}
        assert len(x["tokens"]) == len(x["logprobs"]) <= 12 and x["finish_reason"] in ("stop", "length")
    assert lines[0]["prompt_tokens"] == 7  # <bos> + 6 characters


@pytest.mark.parametrize(
    "rows,extra,message",
    [
        (['{"id": 1, "prompt": "1+1="}', "{not json"], [], "p.jsonl:2: not valid JSON"),
        ([{"id": 1, "text": "1+1="}], [], 'expected an object with "id" and a string "prompt"'),
        ([{"id": 1, "prompt": "1+1="}], ["--top-p", "1.5"], "top_p must be in"),
        ([{"id": 1, "prompt": "1" * 300}], ["--max-len", "64"], "has 301 tokens but the context holds 64"),
    ],
    ids=["malformed-line", "missing-prompt", "top-p", "prompt-too-long"],
)
def test_cli_bad_input_exits_nonzero_with_a_message_and_no_traceback(char_model_dir, tmp_path, rows, extra, message):
    prompts = write_prompts(tmp_path / "p.jsonl", rows)
    res = run_cli("--model", str(char_model_dir), "--prompts", prompts, "--out", str(tmp_path / "o.jsonl"), *extra)
    assert res.returncode != 0
    assert message in res.stderr and "Traceback" not in res.stderr


def test_cli_missing_model_folder_is_reported(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": 1, "prompt": "x"}])
    res = run_cli("--model", str(tmp_path / "nope"), "--prompts", prompts, "--out", str(tmp_path / "o.jsonl"))
    assert res.returncode == 1 and "nope does not exist" in res.stderr and "Traceback" not in res.stderr
