"""Calibration and validation on measured-run fixtures (simulated runs written in the RL loop's
format), and the three command lines."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from common.config import save_config
from sim import calibrate as calibrate_cli
from sim import run as run_cli
from sim import validate as validate_cli
from sim.config import (ArmSpec, ClusterSpec, LatencySpec, LengthSpec, PhaseSpec, RolloutSpec, Scenario, SpecSpec,
                        load_scenario)
from sim.calibration.fit import TABLE_MIN_PASSES, calibrate, fit_latency, fit_schedule, forward_table, nnls, step_cut
from sim.model.latency import Fitted, build_latency
from sim.model.lengths import deal
from sim.projection.project import step_lengths
from sim.calibration.runs import DecodeStep, read_run
from sim.model.parts import Techniques, chunks, padded_tokens, phase_times
from sim.model.step import simulate_step
from tests.sim_trace import write_run
from sim.calibration.validation import validate
from tests.test_sim_model import small_scenario

TRUTH = LatencySpec(kind="fitted", base_s=0.004, query_s=1e-5, kv_s=2e-7, attn_s=1e-7, draft_base_s=3e-4, draft_token_s=1e-5,
                    other_base_s=2e-4, other_row_s=1e-6, other_verify_s=3e-6, prefill_token_s=2e-5)
ARM = ArmSpec(name="d3k1v3", depth=3, verify_tokens=3, accept_len=2.5)


def measured_scenario(devices: int, prompts: int, latency: LatencySpec = TRUTH, seed: int = 0) -> Scenario:
    return Scenario(
        name="fixture", seed=seed, steps=4, latency=latency,
        cluster=ClusterSpec(devices=[devices], max_batch=32),
        rollout=RolloutSpec(prompts=prompts, samples_per_prompt=2, prompt_len=20,
                            lengths=LengthSpec(median=40.0, sigma=0.8, max_len=300)),
        spec=SpecSpec(arms=[ARM], schedule="threshold", arm="d3k1v3", threshold=4),
        phases=PhaseSpec(logprob_s_per_token=2e-4, update_s_per_token=6e-4, sync_s=0.05))


def make_run(folder: Path, scn: Scenario, noise: float = 0.0, seed: int = 0) -> Path:
    """A measured-run fixture: the scenario's steps written as metrics / decode_steps / rollouts."""
    latency = build_latency(scn)
    n = scn.cluster.devices[0]
    lengths = step_lengths(scn, n)
    results = [simulate_step(scn, ls, n, Techniques(spec=True), latency) for ls in lengths]
    return write_run(folder, scn, results, [deal(ls, n) for ls in lengths], latency, np.random.default_rng(seed), noise)


def test_nnls_drops_columns_that_would_go_negative():
    x = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    assert nnls(x, np.array([3.0, 2.0, 1.0])) == pytest.approx([2.0, 0.0])
    assert nnls(x, np.array([1.0, 2.0, 3.0])) == pytest.approx([1.0, 1.0])


def test_calibration_recovers_the_latency_model_of_a_noiseless_run(tmp_path):
    scn = measured_scenario(2, 8)
    fitted, metrics = calibrate(read_run(make_run(tmp_path / "a", scn) / "metrics.jsonl"))
    for key in ("base_s", "query_s", "kv_s", "attn_s", "draft_base_s", "draft_token_s", "other_base_s", "other_row_s",
                "other_verify_s", "prefill_token_s"):
        assert getattr(fitted.latency, key) == pytest.approx(getattr(TRUTH, key), rel=1e-4, abs=1e-12), key
    assert metrics["calibrate/forward_r2"] == pytest.approx(1.0)
    table = np.array(fitted.latency.table_tokens)  # a noiseless linear truth: every point on its line
    assert fitted.latency.table_s == pytest.approx(TRUTH.base_s + TRUTH.query_s * table, rel=1e-4)
    assert fitted.rollout.prompt_len == 20 and fitted.cluster.devices == [2]
    assert fitted.rollout.prompts * fitted.rollout.samples_per_prompt == 16
    (arm,) = fitted.spec.arms
    assert arm.name == "d3k1v3" and arm.accept_len == pytest.approx(2.5, abs=0.05)  # per-pass counts rounded
    assert fitted.spec.arm == "d3k1v3" and fitted.spec.threshold <= 4
    assert fitted.phases.logprob_s_per_token == pytest.approx(2e-4)
    assert fitted.phases.update_s_per_token == pytest.approx(6e-4)
    assert fitted.phases.sync_s == pytest.approx(0.05)


def test_calibration_tolerates_missing_keys(tmp_path):
    folder = make_run(tmp_path / "a", measured_scenario(2, 8))
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    stripped = [{k: v for k, v in m.items() if not k.startswith(("spec/", "timing/update", "timing/sync"))}
                for m in metrics]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in stripped))
    decode = [json.loads(line) for line in (folder / "decode_steps.jsonl").read_text().splitlines()]
    for d in decode:
        if d["shape"] == "off":
            for key in ("drafted", "accepted", "emitted", "draft_s"):
                d.pop(key)
    (folder / "decode_steps.jsonl").write_text("".join(json.dumps(d) + "\n" for d in decode))
    fitted, _ = calibrate(read_run(folder))
    assert fitted.phases.update_s_per_token == 0.0 and fitted.phases.sync_s == 0.0
    assert fitted.latency.base_s == pytest.approx(TRUTH.base_s, rel=1e-4)


def test_bad_shape_names_the_file_and_format(tmp_path):
    folder = make_run(tmp_path / "a", measured_scenario(2, 4))
    with open(folder / "decode_steps.jsonl", "a") as f:
        f.write(json.dumps({"step": 9, "batch_size": 1, "context_mean": 3.0, "shape": "tree", "forward_s": 0.1}) + "\n")
    with pytest.raises(ValueError, match="d<depth>k<topk>v<verify>"):
        read_run(folder)


def test_validation_predicts_another_scale_within_tolerance(tmp_path):
    a = make_run(tmp_path / "a", measured_scenario(2, 8), noise=0.05, seed=1)
    b = make_run(tmp_path / "b", measured_scenario(4, 24, seed=7), noise=0.05, seed=2)
    fitted, _ = calibrate(read_run(a))
    report = validate(fitted, read_run(b), calibrated_on="a")
    assert len(report.steps) == 3
    assert report.error("rollout") < 0.15 and report.error("step") < 0.15 and report.passed()
    assert len(report.steps[0].predicted_rank_s) == 4


def test_validation_fails_when_the_calibration_is_wrong(tmp_path):
    slow = replace(TRUTH, base_s=TRUTH.base_s * 2, kv_s=TRUTH.kv_s * 2, query_s=TRUTH.query_s * 2)
    a = make_run(tmp_path / "a", measured_scenario(2, 8, latency=slow))
    b = make_run(tmp_path / "b", measured_scenario(4, 24, seed=7))
    report = validate(calibrate(read_run(a))[0], read_run(b))
    assert report.error("rollout") > 0.3 and not report.passed()


def test_validation_refuses_a_shape_never_calibrated(tmp_path):
    a = make_run(tmp_path / "a", measured_scenario(2, 8))
    other = ArmSpec(name="d5k1v5", depth=5, verify_tokens=5, accept_len=3.0)
    scn = measured_scenario(2, 8)
    b = make_run(tmp_path / "b", replace(scn, spec=replace(scn.spec, arms=[other], arm="d5k1v5")))
    with pytest.raises(ValueError, match="d5k1v5"):
        validate(calibrate(read_run(a))[0], read_run(b))


def test_command_lines_calibrate_validate_and_project(tmp_path, capsys):
    a = make_run(tmp_path / "a", measured_scenario(2, 8), noise=0.03, seed=1)
    b = make_run(tmp_path / "b", measured_scenario(4, 24, seed=7), noise=0.03, seed=2)
    out = tmp_path / "cal.yaml"
    assert calibrate_cli.main(["--from", str(a / "metrics.jsonl"), "--out", str(out)]) == 0
    assert "accept length d3k1v3" in capsys.readouterr().out
    assert load_scenario(out).latency.kind == "fitted"
    assert validate_cli.main(["--calibrate-on", str(a), "--predict", str(b)]) == 0
    assert "| a | b | 3 |" in capsys.readouterr().out
    assert validate_cli.main(["--calibrate-on", str(a), "--predict", str(b), "--tolerance", "0.0001"]) == 1
    capsys.readouterr()
    assert run_cli.main(["--scenario", str(out), "cluster.devices=[2,4]", "steps=1"]) == 0
    text = capsys.readouterr().out
    assert "| 4 | spec |" in text
    assert "| 4 | spec+spot+split |" in text  # 2 samples a prompt, resampled by prompt: split has rows to act on


def test_run_writes_report_and_small_plots(tmp_path, capsys):
    scn = replace(small_scenario(), steps=1, sweep=replace(small_scenario().sweep, depths=[1, 3], tail_sigmas=[0.5, 1.0],
                                                           accept_lens=[2.0, 4.0], prompt_shares=[0.0, 0.9]))
    path = tmp_path / "small.yaml"
    save_config(scn, path)
    assert run_cli.main(["--scenario", str(path), "--out", str(tmp_path / "out"), "--checks"]) == 0
    text = capsys.readouterr().out
    assert "Analytic limit" in text and "best k" in text and "| 0.9 |" in text.split("Split groups")[1]
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert pngs == [f"small_{k}.png" for k in ("accept", "depth", "scaling", "split", "tail", "timeline")]
    assert all((tmp_path / "out" / p).stat().st_size < 150_000 for p in pngs)
    assert (tmp_path / "out" / "small.md").read_text() == text


def _pass(batch: int, forward_s: float, shape: str = "off") -> DecodeStep:
    return DecodeStep(step=1, rank=0, batch_size=batch, context_mean=50.0, shape=shape, drafted=0, accepted=0,
                      emitted=batch, draft_s=0.0, forward_s=forward_s, other_s=0.0)


def test_forward_table_keeps_a_staircase_that_a_line_misses():
    # SmolLM2-135M on 2 CPU cores: the same cost at 1-6 rows, a jump at 7 and at 13
    cost = {b: 0.09 if b <= 6 else 0.175 if b <= 12 else 0.255 for b in range(1, 17)}
    spec, _ = fit_latency([_pass(b, c) for b, c in cost.items() for _ in range(TABLE_MIN_PASSES)])
    model = Fitted(spec)
    assert [model.forward_s(b, b, 50.0 * b) for b in (1, 6, 7, 12, 13, 16)] == \
        pytest.approx([0.09, 0.09, 0.175, 0.175, 0.255, 0.255])
    # the fitted slopes beyond the last point (decode passes: KV tokens and attention pairs are one count)
    beyond = 0.255 + spec.query_s * 4 + (spec.kv_s + spec.attn_s) * 50.0 * 4
    assert model.forward_s(20, 20, 50.0 * 20) == pytest.approx(beyond)
    line = Fitted(replace(spec, table_tokens=[], table_s=[]))
    assert abs(line.forward_s(6, 6, 300.0) - 0.09) > 0.02  # what the table is for


def test_short_table_pools_join_the_point_before():
    tokens, seconds = forward_table([_pass(1, 0.01)] * 6 + [_pass(2, 0.02)] * 2, kv_s=0.0, min_passes=5)
    assert tokens == [1.0] and seconds == [0.01]  # 8 passes, median of the pooled tokens and seconds


def test_prefill_is_charged_per_prompt_token_once_measured():
    measured = Fitted(LatencySpec(kind="fitted", base_s=0.01, query_s=1e-3, prefill_token_s=1e-4))
    assert measured.prefill_s(4, 10) == pytest.approx(4 * 10 * 1e-4)
    one_pass = Fitted(LatencySpec(kind="fitted", base_s=0.01, query_s=1e-3))
    assert one_pass.prefill_s(4, 10) == pytest.approx(0.01 + 1e-3 * 40)


def test_other_cost_tells_verified_tokens_from_rows():
    model = Fitted(TRUTH)
    assert model.other_s(8, 8, True) == pytest.approx(TRUTH.other_base_s + 8 * TRUTH.other_row_s)
    assert model.other_s(8, 32, True) - model.other_s(8, 8, True) == pytest.approx(24 * TRUTH.other_verify_s)


def test_padded_update_waits_for_the_longest_row_of_each_mini_batch_on_the_largest_rank():
    phases = PhaseSpec(logprob_s_per_token=1.0, update_s_per_token=1.0, sync_s=0.0, mini_batches=2)
    parts = [np.array([1, 9, 2, 2]), np.array([5, 5])]
    real, padded = padded_tokens(phases, parts, prompt_len=1)
    # rank 0: [1, 9] -> 2 x 10, [2, 2] -> 2 x 3; rank 1: [5] -> 6, [5] -> 6; each mini-batch its largest
    assert padded == 20 + 6 and real == 14 + 4
    assert [len(c) for c in chunks(np.arange(5), 2)] == [3, 2]  # torch.chunk's cut
    scn = replace(measured_scenario(2, 8), phases=phases)
    scn = replace(scn, rollout=replace(scn.rollout, prompt_len=1))
    assert phase_times(scn, parts) == pytest.approx((18.0, 26.0, 0.0))


@pytest.mark.parametrize("budget", [0, 16, 40, 1000])
def test_micro_batch_padding_is_the_actors_cut(budget):
    import torch

    from pipeline.actors.forward import micro_batches
    from sim.model.parts import micro_padded

    rng = np.random.default_rng(budget)
    for _ in range(20):
        lengths = rng.integers(1, 60, size=int(rng.integers(1, 30)))
        mask = torch.arange(60)[None, :] < torch.as_tensor(lengths)[:, None]
        groups = micro_batches(mask, budget) if budget else [(torch.arange(len(lengths)), int(lengths.max()))]
        assert micro_padded(lengths, budget) == sum(len(rows) * length for rows, length in groups)


def test_verify_passes_cost_attention_pairs_beyond_their_kv_tokens():
    model = Fitted(replace(TRUTH, base_s=0.0, query_s=0.0, kv_s=0.0))
    decode, verify = model.forward_s(4, 4, 400.0), model.forward_s(4, 16, 400.0)  # 4 rows at context 100
    assert decode == pytest.approx(TRUTH.attn_s * 400) and verify == pytest.approx(4 * decode)


@pytest.mark.parametrize("micro", [0, 120])
def test_calibration_recovers_the_padded_update_cost(tmp_path, micro):
    scn = measured_scenario(2, 8)
    scn = replace(scn, phases=replace(scn.phases, mini_batches=2, micro_batch_tokens=micro))
    folder = make_run(tmp_path / "a", scn)
    actor = f"actor:\n  micro_batch_tokens: {micro}\n" if micro else ""
    (folder / "config.yaml").write_text("trainer:\n  mini_batches: 2\n  ppo_epochs: 1\n" + actor)
    fitted, _ = calibrate(read_run(folder))
    assert fitted.phases.mini_batches == 2 and fitted.phases.micro_batch_tokens == micro
    assert fitted.phases.update_s_per_token == pytest.approx(6e-4)
    assert fitted.phases.logprob_s_per_token == pytest.approx(2e-4)


def test_validation_times_the_slowest_rank_and_leaves_out_the_warm_up(tmp_path):
    a = make_run(tmp_path / "a", measured_scenario(2, 8))
    fitted, _ = calibrate(read_run(a))
    clean = validate(fitted, read_run(a))
    metrics = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()]
    for m in metrics[:1]:  # a ruined warm-up: rank 0 evaluated while rank 1 rolled out
        m["timing/step"] *= 10
        m["timing/rollout_max"] *= 10
    (a / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    report = validate(fitted, read_run(a))
    assert [s.step for s in report.steps] == [1, 2, 3]
    assert report.error("rollout") == pytest.approx(clean.error("rollout")) and report.error("rollout") < 1e-4
    for s, m in zip(report.steps, metrics[1:]):
        assert s.measured_rollout_s == m["timing/rollout_max"] > m["timing/rollout"]  # not the mean over ranks


def test_validation_replays_the_requests_each_rank_generated_not_those_it_trained(tmp_path):
    a = make_run(tmp_path / "a", measured_scenario(2, 8))
    fitted, _ = calibrate(read_run(a))
    clean = validate(fitted, read_run(a))
    rows = [json.loads(line) for line in (a / "rollouts.jsonl").read_text().splitlines()]
    for r in rows:  # an exchange: every row trained on the other rank than the one that made it
        r["gen_rank"], r["rank"] = r["rank"], 1 - r["rank"]
    (a / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    moved = validate(fitted, read_run(a))
    assert [s.predicted_rank_s for s in moved.steps] == [s.predicted_rank_s for s in clean.steps]
    for r in rows:  # a record from before runs wrote gen_rank: its trained rank stands in
        del r["gen_rank"]
    (a / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    old = validate(fitted, read_run(a))
    assert [s.predicted_rank_s for s in old.steps] == [s.predicted_rank_s[::-1] for s in clean.steps]


def test_the_fitted_schedule_is_the_shape_used_most_at_each_batch_size():
    arms = [ArmSpec(name=n, depth=d, verify_tokens=d, accept_len=2.0) for n, d in (("d8k1v8", 8), ("d16k1v16", 16))]
    tuner = ([_pass(b, 0.01, "d8k1v8") for b in (1, 2, 3)] + [_pass(b, 0.01, "d16k1v16") for b in (5, 9, 20)]
             + [_pass(9, 0.01, "d8k1v8")]  # the bandit exploring at 9 rows: outvoted
             + [_pass(b, 0.01, "off") for b in (21, 32)])
    spec = fit_schedule(tuner, arms)
    assert spec.schedule == "buckets"
    assert [(b.max_batch, b.arm) for b in spec.buckets] == [(3, "d8k1v8"), (20, "d16k1v16")]  # off above
    switch = [_pass(b, 0.01, "d8k1v8") for b in (1, 4, 8)] + [_pass(b, 0.01, "off") for b in (9, 32)]
    assert (fit_schedule(switch, arms).schedule, fit_schedule(switch, arms).threshold) == ("threshold", 8)
    assert fit_schedule([_pass(4, 0.01, "off")], arms).arm is None  # never speculated


def test_step_speedup_is_the_calibration_runs_mean_step_over_the_predicted_runs(tmp_path):
    a = make_run(tmp_path / "a", measured_scenario(2, 8), noise=0.05, seed=1)
    b = make_run(tmp_path / "b", measured_scenario(4, 24, seed=7), noise=0.05, seed=2)
    fitted, _ = calibrate(read_run(a))
    own = validate(fitted, read_run(a))
    report = validate(fitted, read_run(b), reference=own)
    measured = np.mean([s.measured_step_s for s in own.steps]) / np.mean([s.measured_step_s for s in report.steps])
    assert report.speedup("measured") == pytest.approx(measured)
    assert report.speedup_error() < 0.15 and report.passed()


def test_the_replayed_update_cuts_mini_batches_where_the_run_recorded_them(tmp_path):
    a = make_run(tmp_path / "a", measured_scenario(2, 8))
    rows = [json.loads(line) for line in (a / "rollouts.jsonl").read_text().splitlines()]
    assert read_run(a).trained_mini_batches() is None  # no record names its mini-batch: even chunks
    seen = set()
    for r in rows:  # the first row of each rank's step in mini-batch 0, the rest in 1 (not an even cut)
        r["mini_batch"] = 0 if (r["step"], r["rank"]) not in seen else 1
        seen.add((r["step"], r["rank"]))
    (a / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = read_run(a)
    cuts = run.trained_mini_batches()
    step = rows[0]["step"]
    mine = [r["length"] for r in rows if (r["step"], r["rank"]) == (step, 0)]
    assert cuts[step][0] == [mine[:1], mine[1:]]
    phases = PhaseSpec(mini_batches=2, micro_batch_tokens=0)
    parts = [np.asarray(run.trained_lengths_by_rank()[step][r]) for r in (0, 1)]
    cut = step_cut(cuts, step, (0, 1))
    expected = sum(max(len(c[k]) * (max(c[k]) + 20) for c in cut) for k in range(2))
    assert padded_tokens(phases, parts, 20, cut)[1] == expected != padded_tokens(phases, parts, 20)[1]
    del rows[-1]["mini_batch"]  # records that do not all name one: the even cut
    (a / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_run(a).trained_mini_batches() is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_simulators_row_deal_is_the_rl_loops(seed):
    from pipeline.shares import row_shares
    from sim.model.lengths import row_deal

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(40), 1.0, size=16 * 4).astype(np.int64), 1, 800)  # 16 prompts x 4
    cut = row_deal(lengths, 2, 4, 2)
    loop = row_shares(lengths.reshape(16, 4).tolist(), 2, 2)
    assert [[c.tolist() for c in rank] for rank in cut] == [[[int(lengths[g * 4 + s]) for g, s in cell] for cell in rank]
                                                            for rank in loop]


def test_a_projection_with_the_row_deal_waits_less_for_the_slowest_rank_than_contiguous_shards():
    scn = measured_scenario(2, 16)
    ph = replace(scn.phases, mini_batches=2, micro_batch_tokens=512)  # micro-batches as configs/tiny.yaml's
    lengths = np.array([700, 650, 720, 690] + [20] * 28 + [300, 20, 20, 20] + [20] * 28)  # one long group
    shards = simulate_step(replace(scn, phases=ph), lengths, 2, Techniques())
    rows = simulate_step(replace(scn, phases=replace(ph, row_deal=True)), lengths, 2, Techniques())
    assert rows.update_s < 0.75 * shards.update_s
    assert rows.rollout_s == shards.rollout_s  # the deal is the update's, not the rollout's


def test_a_plain_run_tells_the_drafters_bookkeeping_apart_from_every_passs_overhead(tmp_path):
    truth = replace(TRUTH, other_drafter_s=3e-4)  # every pass of an engine holding a drafter, "off" ones too
    scn = measured_scenario(2, 8, latency=truth)
    spec = make_run(tmp_path / "spec", scn)
    latency, n = build_latency(scn), scn.cluster.devices[0]
    lengths = step_lengths(scn, n)
    results = [simulate_step(scn, ls, n, Techniques(), latency) for ls in lengths]  # no drafter
    plain = write_run(tmp_path / "plain", scn, results, [deal(ls, n) for ls in lengths], latency, np.random.default_rng(0))
    assert read_run(spec).has_drafter and not read_run(plain).has_drafter
    alone, _ = calibrate(read_run(spec))
    assert alone.latency.other_drafter_s == 0.0
    assert alone.latency.other_base_s == pytest.approx(truth.other_base_s + 3e-4, rel=1e-3)  # the intercept holds it
    both, _ = calibrate(read_run(spec), read_run(plain))
    assert both.latency.other_drafter_s == pytest.approx(3e-4, rel=1e-3)
    assert both.latency.other_base_s == pytest.approx(truth.other_base_s, rel=1e-3)
    assert validate(both, read_run(plain)).error("rollout") < 1e-3 < validate(alone, read_run(plain)).error("rollout")
    with pytest.raises(ValueError, match="ran with a drafter"):
        calibrate(read_run(spec), read_run(spec))
