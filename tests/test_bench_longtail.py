"""bench.longtail on tiny random models: every policy's rollout is the same, and the JSON says what it measured."""

from __future__ import annotations

import json

import pytest

from bench import longtail


@pytest.mark.slow
def test_every_policy_gives_the_autoregressive_tokens_and_the_json_has_the_ratios(char_model_dir, char_drafter_dir, tmp_path, capsys):
    plot = tmp_path / "trace.png"
    rc = longtail.main(["--model", str(char_model_dir), "--drafter", str(char_drafter_dir), "--requests", "3", "--n", "2",
                        "--arms", "off,d2k1v2,d3k2v4", "--new-tokens", "12", "--tail-batch", "2", "--threads", "1",
                        "--plot", str(plot), "--repeats", "2", "--drafter-products", "bf16", "--products", "bf16", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    assert out["identical"] is True
    assert out["best_fixed"] in ("off", "d2k1v2", "d3k2v4")
    assert out["adaptive_vs_ar"] > 0 and out["adaptive_vs_best_fixed"] > 0 and out["cpu"]
    assert set(out["seconds"]) == {"off", "d2k1v2", "d3k2v4", "tail", "adaptive_scratch", "adaptive"}
    assert out["adaptive_vs_best_fixed"] == pytest.approx(out["seconds"][out["best_fixed"]] / out["seconds"]["adaptive"], rel=0.01)
    assert out["rollouts"] == 6 and out["drafter_products"] == "bf16" and out["products"] == "bf16"
    assert out["repeats"] == 2 and len(out["adaptive_vs_ar_by_round"]) == 2
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_repeat_count_below_one_is_refused(char_model_dir, char_drafter_dir, capsys):
    rc = longtail.main(["--model", str(char_model_dir), "--drafter", str(char_drafter_dir), "--repeats", "0"])
    assert rc == 1
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_an_arm_set_without_a_draft_shape_is_refused(char_model_dir, char_drafter_dir, capsys):
    rc = longtail.main(["--model", str(char_model_dir), "--drafter", str(char_drafter_dir), "--arms", "off"])
    assert rc == 1
    assert "at least one draft shape" in capsys.readouterr().err
