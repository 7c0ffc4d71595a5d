"""bench.rollout_profile: a run's decode passes by batch-size bucket, against a reference, and the drafter-free bound."""

from __future__ import annotations

import json

import pytest

from bench import rollout_profile as rp
from engine.spec.pass_costs import PassCosts


def write_run(folder, passes, steps=((10.0, 5.0), (12.0, 6.0))):
    folder.mkdir(parents=True)
    (folder / "decode_steps.jsonl").write_text("".join(json.dumps(p) + "\n" for p in passes))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "timing/step": s, "timing/rollout": r,
                                                              "timing/idle": 0.0}) + "\n" for i, (s, r) in enumerate(steps)))
    return folder


def decode(step, b, seconds, shape="off", drafted=0, emitted=None):
    return {"step": step, "rank": 0, "index": 0, "batch_size": b, "shape": shape, "drafted": drafted, "accepted": 0,
            "emitted": b if emitted is None else emitted, "context_mean": 100.0, "draft_s": 0.0, "forward_s": seconds,
            "other_s": 0.0}


def test_passes_fall_into_buckets_and_step_1_is_left_out(tmp_path):
    run = write_run(tmp_path / "off", [decode(1, 3, 99.0), decode(2, 32, 0.2), decode(2, 20, 0.2), decode(2, 3, 0.05),
                                        decode(3, 1, 0.05)])
    table = rp.profile(rp.read_passes(run))
    assert list(table) == ["1", "2-4", "17-32"]
    assert table["17-32"]["passes"] == 2 and table["17-32"]["seconds"] == pytest.approx(0.4)
    assert table["17-32"]["share"] == pytest.approx(0.4 / 0.5)
    assert table["2-4"]["accept_len"] == 1.0 and table["2-4"]["entries_per_row"] == 1.0


def test_a_speculative_bucket_reports_its_entries_and_accept_length(tmp_path):
    run = write_run(tmp_path / "on", [decode(2, 4, 0.1, shape="d3k1v3", drafted=12, emitted=10)])
    a = rp.profile(rp.read_passes(run))["2-4"]
    assert a["entries_per_row"] == 4.0 and a["accept_len"] == 2.5 and a["speculative_share"] == 1.0


def test_the_bound_is_one_without_acceptance_and_grows_with_it_where_passes_are_cheap():
    passes = [decode(2, 1, 0.05)] * 10 + [decode(2, 32, 0.2)] * 10
    cpu = PassCosts.make_dummy(fixed=0.07, per_token=0.003)
    assert rp.bound(passes, cpu, 0.0, 8) == pytest.approx(1.0)
    low, high = rp.bound(passes, cpu, 0.5, 8), rp.bound(passes, cpu, 0.95, 8)
    assert 1.0 < low < high
    compute_bound = PassCosts.make_dummy(fixed=1e-6, per_token=0.003)  # every entry costs a step: nothing to gain
    assert rp.bound(passes, compute_bound, 0.95, 8) == pytest.approx(1.0, abs=1e-3)


def test_the_cli_prints_each_run_against_the_reference(tmp_path, capsys):
    off = write_run(tmp_path / "off", [decode(2, 8, 0.1), decode(2, 2, 0.04)])
    on = write_run(tmp_path / "on", [decode(2, 8, 0.2, shape="d2k1v2", drafted=16, emitted=12), decode(2, 2, 0.02)])
    assert rp.main([str(off), str(on), "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["runs"][str(on)]["5-8"]["accept_len"] == 1.5
    assert "0.50x" in captured.err and "2.00x" in captured.err  # the 5-8 bucket lost half, the 2-4 bucket doubled


def test_a_folder_without_decode_steps_is_named(tmp_path, capsys):
    assert rp.main([str(tmp_path)]) == 1
    assert "decode_steps.jsonl" in capsys.readouterr().err
