"""The simulator's placements: separated actor and rollout devices against the colocated step."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sim.config import (ArmSpec, ClusterSpec, HardwareSpec, LatencySpec, LengthSpec, ModelSpec, PhaseSpec,
                        PlacementSpec, RolloutSpec, Scenario, SpecSpec, SpotSpec, SweepSpec, load_scenario)
from sim.model.latency import Fitted
from sim.placement import best, compare, placement_report
from sim.projection.project import step_lengths
from sim.model.separated import push_sync_s, split_devices, transfer_s
from sim.model.parts import Techniques
from sim.model.step import simulate_step

REPO = Path(__file__).resolve().parent.parent
PASS = Fitted(LatencySpec(kind="fitted", base_s=0.01))  # every pass 10 ms, nothing else costs
ARM4 = ArmSpec(name="d4k1v4", depth=4, verify_tokens=4, accept_len=4.0)
SYNC = Techniques()
ASYNC = Techniques(one_step_async=True)


def scenario(kind: str = "separated", **kw) -> Scenario:
    base = dict(
        name="small", seed=1, steps=1,
        model=ModelSpec(params_b=1.0, layers=16, q_heads=16, kv_heads=4, head_dim=64),
        hardware=HardwareSpec(hbm_tbps=3.35, tflops=989.0),
        latency=LatencySpec(kind="fitted", base_s=0.01),
        cluster=ClusterSpec(devices=[4, 8], max_batch=64),
        rollout=RolloutSpec(prompts=16, samples_per_prompt=4, prompt_len=64,
                            lengths=LengthSpec(median=300.0, sigma=1.0, max_len=4000)),
        spec=SpecSpec(arms=[ARM4], schedule="threshold", arm="d4k1v4", threshold=16),
        spot=SpotSpec(accept_gain=1.5, required_device_s=1000.0),
        phases=PhaseSpec(logprob_s_per_token=1e-5, update_s_per_token=4e-5, sync_s=0.5),
        placement=PlacementSpec(kind=kind, actor_share=0.5, sync_gbps=10.0, transfer_gbps=1.0),
        sweep=SweepSpec(actor_shares=[0.25, 0.5, 0.75]),
    )
    base.update(kw)
    return Scenario(**base)


LENGTHS = np.array([100, 40, 40, 40, 60, 60, 20, 20])


def test_separated_rollout_devices_idle_through_the_transfer_and_the_whole_actor_phase():
    scn = scenario()
    r = simulate_step(scn, LENGTHS, 4, SYNC, PASS)
    assert (r.actor_devices, len(r.groups)) == (2, 2)
    actor_s = r.logprob_s + r.update_s
    assert actor_s > 0 and r.transfer_s > 0
    assert r.window_s == pytest.approx(r.transfer_s + actor_s)
    assert r.idle_s.tolist() == pytest.approx((r.rollout_s - r.group_rollout_s + r.transfer_s + actor_s).tolist())
    assert r.idle_s.min() >= actor_s  # even the slowest group waits through the update
    assert r.step_s == pytest.approx(r.rollout_s + r.transfer_s + actor_s + r.sync_s)
    # the actors train on half the devices: twice a colocated rank's share of the same tokens
    colocated = simulate_step(scenario("colocated"), LENGTHS, 4, SYNC, PASS)
    assert r.update_s == pytest.approx(2 * colocated.update_s)
    assert colocated.window_s == 0.0 and colocated.idle_s.min() == 0.0


def test_one_step_async_overlaps_the_rollout_with_the_actor_phase():
    slow_actor = scenario(phases=PhaseSpec(logprob_s_per_token=1e-3, update_s_per_token=4e-3, sync_s=0.0))
    for scn in (scenario(), slow_actor):
        sync = simulate_step(scn, LENGTHS, 4, SYNC, PASS)
        over = simulate_step(scn, LENGTHS, 4, ASYNC, PASS)
        actor_s = over.logprob_s + over.update_s
        assert over.step_s == pytest.approx(max(over.rollout_s + over.transfer_s, actor_s) + over.sync_s)
        assert over.step_s < sync.step_s
        assert over.window_s == pytest.approx(max(over.transfer_s, actor_s - over.rollout_s))
    assert over.rollout_s < actor_s and over.window_s > over.transfer_s  # the slow actor is waited for


def test_weight_push_grows_with_the_model_and_falls_with_bandwidth_and_tensor_parallelism():
    scn = scenario()
    assert push_sync_s(scn) == pytest.approx(1e9 * 2.0 / 10e9)  # 1B bf16 parameters at 10 GB/s
    bigger = replace(scn, model=replace(scn.model, params_b=7.0))
    faster = replace(scn, placement=replace(scn.placement, sync_gbps=40.0))
    sharded = replace(scn, cluster=replace(scn.cluster, tensor_parallel=2))
    assert push_sync_s(bigger) == pytest.approx(7 * push_sync_s(scn))
    assert push_sync_s(faster) == pytest.approx(push_sync_s(scn) / 4)
    assert push_sync_s(sharded) == pytest.approx(push_sync_s(scn) / 2)  # each device receives its shard
    step = simulate_step(bigger, LENGTHS, 4, SYNC, PASS)
    assert step.sync_s == pytest.approx(push_sync_s(bigger))
    assert transfer_s(scn, LENGTHS) == pytest.approx((LENGTHS.sum() + 8 * 64) * 8.0 / 1e9)


def test_the_spot_pool_gets_the_actor_phase_so_separated_training_reaches_its_full_gain():
    scn = scenario(phases=PhaseSpec(logprob_s_per_token=1e-3, update_s_per_token=4e-3, sync_s=0.0),
                   spot=SpotSpec(accept_gain=1.5, required_device_s=3.0))
    spot = Techniques(spec=True, spot=True)
    colocated = simulate_step(replace(scn, placement=PlacementSpec()), LENGTHS, 4, spot, PASS)
    separated = simulate_step(scn, LENGTHS, 4, spot, PASS)
    assert colocated.used.accept_gain < 1.5  # the tail alone is too short
    assert separated.used.accept_gain == pytest.approx(1.5)
    assert separated.fill.spot_s.sum() == pytest.approx(separated.idle_s.sum())


@pytest.mark.parametrize("devices,share,tp,split", [(8, 0.25, 1, (2, 6)), (8, 0.5, 2, (4, 4)), (8, 0.35, 2, (4, 4)),
                                                    (3, 0.5, 1, (2, 1)), (4, 0.1, 1, (1, 3))])
def test_actor_share_splits_whole_devices_and_whole_rollout_groups(devices, share, tp, split):
    scn = scenario(placement=PlacementSpec(kind="separated", actor_share=share),
                   cluster=ClusterSpec(devices=[8], tensor_parallel=tp))
    assert split_devices(scn, devices) == split


def test_a_split_without_a_rollout_group_names_the_key():
    scn = scenario(placement=PlacementSpec(kind="separated", actor_share=0.75),
                   cluster=ClusterSpec(devices=[4], tensor_parallel=2))
    with pytest.raises(ValueError, match="placement.actor_share"):
        split_devices(scn, 4)
    with pytest.raises(ValueError, match="placement.actor_share"):
        PlacementSpec(kind="separated", actor_share=1.0).validate()


def test_colocated_results_are_those_of_the_simulator_before_placements():
    """The 7B scenario's step at 16 devices, as the simulator computed it before it knew placements."""
    scn = load_scenario(REPO / "sim/scenarios/7b.yaml")
    lengths = step_lengths(scn, 16)[0]
    expected = {Techniques(): (116.03146167949393, 160.3586489983345, 219.24383521776707),
                Techniques(spec=True, spot=True): (55.99589670713681, 100.3230840259774, 146.96254064263948),
                Techniques(spec=True, spot=True, bubble=True, one_step_async=True):
                    (84.83711624744608, 88.62050797101449, 72.60691588916248)}
    for tech, (rollout, step, idle) in expected.items():
        r = simulate_step(scn, lengths, 16, tech)
        assert (r.rollout_s, r.step_s, float(r.idle_s.sum())) == pytest.approx((rollout, step, idle), rel=1e-12)
    # the separated scenario differs from its base only in the placement
    separated = load_scenario(REPO / "sim/scenarios/7b_separated.yaml")
    assert replace(separated, name=scn.name, placement=scn.placement) == scn


def test_comparison_speedups_are_over_the_colocated_baseline_and_best_keeps_the_fastest_share(tmp_path):
    scn = scenario(cluster=ClusterSpec(devices=[4], max_batch=64))
    rows = compare(scn)
    colocated = {r.combo: r for r in rows if r.layout == "colocated"}
    assert colocated["baseline"].speedup == pytest.approx(1.0) and colocated["baseline"].actor_devices == 4
    separated = [r for r in rows if r.layout == "separated" and r.combo == "baseline"]
    assert sorted(r.actor_devices for r in separated) == [1, 2, 3]  # every share of the sweep
    top = {(r.layout, r.combo): r for r in best(rows)}
    assert top[("separated", "baseline")].step_s == min(r.step_s for r in separated)
    for r in rows:
        assert r.speedup == pytest.approx(colocated["baseline"].step_s / r.step_s)
    text = placement_report(scn, tmp_path / "placement.png")
    assert "separated+async" in text and (tmp_path / "placement.png").stat().st_size > 1000
    assert (tmp_path / "placement_timeline.png").stat().st_size > 1000


def test_a_separated_scenario_runs_its_report_checks_and_timeline(tmp_path, capsys):
    from common.config import save_config
    from sim import run as run_cli

    scn = replace(scenario(), sweep=SweepSpec(accept_lens=[2.0], depths=[1, 3], tail_sigmas=[1.0]))
    path = tmp_path / "sep.yaml"
    save_config(scn, path)
    assert run_cli.main(["--scenario", str(path), "--out", str(tmp_path / "out"), "--checks"]) == 0
    assert "| 8 | spec+spot |" in capsys.readouterr().out
    assert (tmp_path / "out" / "small_timeline.png").stat().st_size > 1000


def test_sensitivity_varies_one_key_and_can_grow_the_batch_with_the_devices(tmp_path):
    from common.config import save_config
    from sim.sensitivity import speedups, variation_rows

    scn = scenario("colocated", cluster=ClusterSpec(devices=[2, 4], max_batch=64))
    path = tmp_path / "s.yaml"
    save_config(scn, path)
    table = variation_rows(str(path), [], ["spec.threshold=1", "rollout.prompts=scale:32"], [2, 4]).splitlines()
    assert [line.split(" | ")[0] for line in table[2:]] == ["| as in the scenario", "| spec.threshold=1",
                                                            "| rollout.prompts=scale:32"]
    fixed, grown = speedups(scn, [2, 4]), speedups(scn, [2, 4], rows_per_device=32)
    assert fixed[(2, "spec")] == pytest.approx(grown[(2, "spec")])  # 32 rows a device at 2 devices: the scenario's 64
    assert fixed[(4, "spec")] != pytest.approx(grown[(4, "spec")])


def test_sensitivity_shows_split_groups_paying_only_once_a_prompts_samples_are_alike(tmp_path):
    from common.config import save_config
    from sim.sensitivity import WITH_SPLIT, variation_rows

    path = tmp_path / "s.yaml"
    rows_cost = LatencySpec(kind="fitted", base_s=0.001, query_s=5e-4)  # a pass costs more with more rows, as on a CPU
    save_config(scenario("colocated", cluster=ClusterSpec(devices=[4], max_batch=64), latency=rows_cost, steps=32), path)
    table = variation_rows(str(path), [], ["rollout.lengths.prompt_share=0.95"], [4], WITH_SPLIT).splitlines()
    assert table[0] == "| variation | spec @ 4 | spec+spot @ 4 | spec+spot+split @ 4 |"
    as_is, alike = ([float(x.strip(" x|")) for x in row.split(" | ")[1:]] for row in table[2:])
    assert as_is[2] == pytest.approx(as_is[1], rel=0.05)  # each response drawn alone: split changes ~nothing
    assert alike[2] > alike[1]
