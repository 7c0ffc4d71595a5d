"""bench.longtail on tiny random models: every policy's rollout is the same, and the JSON says what it measured."""

from __future__ import annotations

import json

import pytest

from bench import longtail
from engine.spec.tuner import Bandit
from engine.types import RolloutBatch, StepRecord


def _steps(spec: list[tuple[int, int, float]]) -> RolloutBatch:
    """(active rows, tokens emitted, seconds) per decode step -> a RolloutBatch of those steps."""
    steps = [StepRecord(index=i, batch_size=b, shape="off", drafted=[0] * b, accepted=[0] * b,
                        emitted=[tokens // b] * b, context_mean=0.0, draft_s=0.0, forward_s=s, other_s=0.0)
             for i, (b, tokens, s) in enumerate(spec)]
    return RolloutBatch(rollouts=[], steps=steps, prefill_s=0.0, wall_s=0.0, policy_version=0)


def test_the_per_bucket_ceiling_takes_each_buckets_fastest_arm_over_the_autoregressive_runs_tokens():
    # Buckets from 1 and from 4 rows. Autoregressive: 8 tokens at 4 rows in 2 s (4 tokens/s), 2 tokens
    # at 1 row in 2 s (1/s); the drafted arm: 8 tokens at 4 rows in 4 s (2/s), 4 tokens at 1 row in 1 s (4/s).
    runs = {"off": _steps([(4, 4, 1.0), (4, 4, 1.0), (1, 1, 1.0), (1, 1, 1.0)]),
            "d2": _steps([(4, 8, 4.0), (1, 4, 1.0)])}
    seconds, arms = longtail.per_bucket_best(runs, ["off", "d2"], Bandit(2, [1, 4]), wall_ar=5.0)
    # 1 s outside decode steps (5 - 4), 8 tokens at 4/s, 2 tokens at 4/s
    assert seconds == pytest.approx(1.0 + 2.0 + 0.5)
    assert arms == {"1": "d2", "4": "off"}
    assert longtail.per_bucket_best(runs, ["d2"], Bandit(2, [1, 4]), wall_ar=5.0) == (seconds, arms)  # off not among --arms


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
    assert out["per_bucket_best_vs_ar"] > 0 and set(out["per_bucket_best_arms"].values()) <= {"off", "d2k1v2", "d3k2v4"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_repeat_count_below_one_is_refused(char_model_dir, char_drafter_dir, capsys):
    rc = longtail.main(["--model", str(char_model_dir), "--drafter", str(char_drafter_dir), "--repeats", "0"])
    assert rc == 1
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_an_arm_set_without_a_draft_shape_is_refused(char_model_dir, char_drafter_dir, capsys):
    rc = longtail.main(["--model", str(char_model_dir), "--drafter", str(char_drafter_dir), "--arms", "off"])
    assert rc == 1
    assert "at least one draft shape" in capsys.readouterr().err
