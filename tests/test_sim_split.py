"""The simulator's split groups: dealing a prompt's samples to different rollout groups, response
lengths alike within a prompt (lognormal prompt_share, empirical by_prompt), and what it buys."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from sim.config import LatencySpec, LengthSpec, load_scenario
from sim.calibration.fit import calibrate
from sim.model.latency import Fitted
from sim.model.lengths import draw_lengths, read_lengths_by_prompt, split_deal
from sim.projection.project import project
from sim.calibration.runs import read_run
from sim.model.parts import Techniques
from sim.model.step import simulate_step
from sim.projection.sweeps import prompt_share_sweep
from tests.test_sim_calibrate import make_run, measured_scenario
from tests.test_sim_model import small_scenario


def test_split_deal_gives_each_group_its_part_of_every_prompt_as_a_rank_does():
    lengths = np.arange(3 * 4) * 10  # 3 prompts x 4 samples: request p*4+s has length 10*(p*4+s)
    parts = split_deal(lengths, 2, 4)
    # group 0: samples 0-1 of prompts 0, 1, 2 in prompt order; group 1: samples 2-3
    assert [list(p // 10) for p in parts] == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]


@pytest.mark.parametrize("groups", [3, 5, 8, 16])
def test_split_deal_deals_every_request_once_and_spreads_a_prompt_when_groups_do_not_divide_samples(groups):
    lengths = np.arange(6 * 4)
    parts = split_deal(lengths, groups, 4)
    assert sorted(np.concatenate(parts).tolist()) == lengths.tolist()
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    groups_of_prompt0 = {g for g, p in enumerate(parts) if set(p.tolist()) & {0, 1, 2, 3}}
    assert len(groups_of_prompt0) == min(4, groups)


def test_split_deal_refuses_requests_that_are_not_whole_prompts():
    with pytest.raises(ValueError, match="samples_per_prompt=4"):
        split_deal(np.arange(10), 2, 4)


def test_prompt_share_zero_is_the_plain_draw_and_one_makes_a_prompts_samples_equal():
    spec = LengthSpec(median=100.0, sigma=1.0, max_len=100_000)
    plain = np.clip(np.rint(np.random.default_rng(3).lognormal(np.log(100.0), 1.0, size=32)), 1, 100_000)
    assert draw_lengths(spec, 8, 4, np.random.default_rng(3)).tolist() == plain.astype(np.int64).tolist()
    alike = draw_lengths(replace(spec, prompt_share=1.0), 8, 4, np.random.default_rng(3)).reshape(8, 4)
    assert (alike == alike[:, :1]).all() and len(set(alike[:, 0].tolist())) > 1


@pytest.mark.parametrize("share", [0.25, 0.75])
def test_prompt_share_is_the_share_of_log_length_variance_between_prompts(share):
    spec = LengthSpec(median=1000.0, sigma=0.8, max_len=10**9, prompt_share=share)
    logs = np.log(draw_lengths(spec, 4000, 8, np.random.default_rng(0))).reshape(4000, 8)
    between = logs.mean(1).var() - logs.var(1, ddof=1).mean() / 8  # the prompts' means, less their noise
    assert between / logs.var() == pytest.approx(share, abs=0.03)
    assert logs.var() == pytest.approx(0.8 ** 2, rel=0.05)  # the total spread is sigma's whatever the share


def test_length_settings_that_do_not_apply_are_refused_by_name():
    with pytest.raises(ValueError, match="prompt_share must be in"):
        LengthSpec(prompt_share=1.5).validate()
    with pytest.raises(ValueError, match="by_prompt=true"):
        LengthSpec(kind="empirical", path="r.jsonl", prompt_share=0.5).validate()
    with pytest.raises(ValueError, match="prompt_share instead"):
        LengthSpec(by_prompt=True).validate()
    with pytest.raises(ValueError, match="by_prompt=true"):
        LengthSpec(kind="empirical", path="r.jsonl", stratified=True).validate()


def test_lengths_by_prompt_keep_each_prompts_samples_and_drop_partial_prompts(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    rows = [{"step": 1, "prompt_id": "a", "sample": s, "length": 10 + s} for s in (1, 0)]
    rows += [{"step": 2, "prompt_id": "a", "sample": s, "length": 50 + s} for s in (0, 1)]
    rows += [{"step": 2, "prompt_id": "b", "sample": 0, "length": 7}]  # its other sample never came
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_lengths_by_prompt(path, 2).tolist() == [[10, 11], [50, 51]]
    with pytest.raises(ValueError, match="exactly 3 samples"):
        read_lengths_by_prompt(path, 3)
    spec = LengthSpec(kind="empirical", path=str(path), by_prompt=True)
    drawn = draw_lengths(spec, 50, 2, np.random.default_rng(0), read_lengths_by_prompt(path, 2)).reshape(50, 2)
    assert {tuple(r) for r in drawn.tolist()} == {(10, 11), (50, 51)}


def test_stratified_draws_take_one_group_of_each_length_stratum():
    groups = np.arange(64)[:, None] * np.ones((1, 2), dtype=np.int64) + 1  # [64, 2]: group k's samples are k + 1
    spec = LengthSpec(kind="empirical", path="r.jsonl", by_prompt=True, stratified=True)
    orders = set()
    for seed in range(20):
        drawn = draw_lengths(spec, 16, 2, np.random.default_rng(seed), groups).reshape(16, 2)
        assert (drawn[:, 0] == drawn[:, 1]).all()  # whole groups
        assert sorted((drawn[:, 0] - 1) // 4) == list(range(16))  # one from each stratum of 4
        orders.add(tuple(drawn[:, 0]))
    assert len(orders) == 20  # which member, and in what order, varies
    with pytest.raises(ValueError, match="at least as many prompt groups"):
        draw_lengths(spec, 65, 2, np.random.default_rng(0), groups)


def test_calibration_resamples_whole_prompts_when_the_run_drew_several_samples(tmp_path):
    run = read_run(make_run(tmp_path / "a", measured_scenario(2, 8)))
    assert calibrate(run)[0].rollout.lengths.by_prompt
    assert not calibrate(run)[0].rollout.lengths.stratified
    folder = make_run(tmp_path / "b", measured_scenario(2, 8))
    (folder / "config.yaml").write_text("trainer:\n  prompt_order: stratified\n")
    assert calibrate(read_run(folder))[0].rollout.lengths.stratified  # the run's prompt order, projected


def test_split_groups_shorten_a_rollout_whose_tail_is_one_prompt():
    # Every pass costs in proportion to its rows (a CPU-like device); one prompt's 4 samples are
    # 10x the others. Whole, they hold one group for 20 passes of 16 rows and 180 of 4 (1,040
    # row-passes); split, each group has 20 of 16 and 180 of 1 (500).
    rows_cost = Fitted(LatencySpec(kind="fitted", base_s=0.0, query_s=1e-3))
    scn = replace(small_scenario(), rollout=replace(small_scenario().rollout, prompt_len=1))
    lengths = np.full(16 * 4, 20)
    lengths[:4] = 200
    whole = simulate_step(scn, lengths, 4, Techniques(), rows_cost)
    split = simulate_step(scn, lengths, 4, Techniques(split=True), rows_cost)
    assert split.rollout_s < 0.6 * whole.rollout_s
    assert sum(g.tokens for g in split.groups) == pytest.approx(sum(g.tokens for g in whole.groups))


def test_split_pays_more_the_more_a_prompts_samples_are_alike():
    scn = load_scenario("sim/scenarios/7b.yaml")
    points = prompt_share_sweep(replace(scn, steps=2), 64, [0.0, 0.95])
    assert points[0].split_rollout == pytest.approx(1.0, abs=0.03)  # lengths drawn alone: nothing to balance
    assert points[1].split_rollout > 1.08
    assert points[1].spec_spot_split_step > points[1].spec_spot_step


def test_the_projection_adds_split_rows_only_where_a_prompts_samples_are_alike():
    scn = replace(small_scenario(), steps=1)
    assert "split" not in {r.combo for r in project(scn)}  # drawn alone: nothing for split to balance
    alike = replace(scn, rollout=replace(scn.rollout, lengths=replace(scn.rollout.lengths, prompt_share=0.9)))
    rows = {(r.devices, r.combo): r for r in project(alike)}
    assert {"split", "spec+spot+split"} <= {combo for _, combo in rows}
    assert rows[(8, "split")].rollout_speedup > 1.0


def test_calibration_reads_the_order_an_auto_prompt_order_chose_from_the_runs_log(tmp_path):
    for chose, stratified in (("stratified", True), ("shuffled", False)):
        folder = make_run(tmp_path / chose, measured_scenario(2, 8))
        (folder / "config.yaml").write_text("trainer:\n  prompt_order: auto\n")
        (folder / "rank0.log").write_text(f"[10:00:00] prompt order: {chose} (trainer.prompt_order=auto: ...)\n")
        assert calibrate(read_run(folder))[0].rollout.lengths.stratified == stratified
