"""bench.spec on a tiny char model and its drafter: speculation against autoregressive per batch size,
the same tokens, and the JSON says what it measured."""

from __future__ import annotations

import json

import pytest

from bench import spec


@pytest.mark.parametrize("products", ["float32", "bf16"])
def test_speculation_gives_the_autoregressive_tokens_and_the_json_has_the_ratios(char_model_dir, char_drafter_dir,
                                                                                 capsys, products):
    rc = spec.main(["--model", str(char_model_dir), "--drafter", str(char_drafter_dir), "--batch", "1,2",
                    "--depth", "3", "--verify-tokens", "3", "--new-tokens", "12", "--rounds", "1", "--threads", "1",
                    "--drafter-products", products, "--cost-model", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["identical"] is True
    assert set(out["ratio"]) == set(out["accept_len"]) == {"1", "2"}
    assert all(v > 0 for v in out["ratio"].values()) and all(v >= 1 for v in out["accept_len"].values())
    assert out["drafter"] == "eagle" and out["drafter_products"] == products
    assert set(out["forward_s"]) == {"1", "2", "4", "8", "16"} and out["implied_ratio"] > 0


def test_a_missing_drafter_folder_is_an_error_not_a_crash(char_model_dir, tmp_path, capsys):
    rc = spec.main(["--model", str(char_model_dir), "--drafter", str(tmp_path / "none"), "--batch", "1"])
    assert rc == 1 and "error:" in capsys.readouterr().err
