"""The simulator's pure model: latency, schedule, the event model of a group, a step, the trends."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sim.config import (ArmSpec, BubbleSpec, BucketSpec, ClusterSpec, HardwareSpec, LatencySpec, LengthSpec,
                        ModelSpec, PhaseSpec, RolloutSpec, Scenario, SpecSpec, load_scenario)
from sim.model.events import simulate_group
from sim.model.latency import Fitted, Roofline
from sim.projection.project import COMBOS, project
from sim.model.schedule import OFF, Schedule, boost, build_schedule, chain_accept_len
from sim.model.parts import Techniques, spread_mask
from sim.model.step import simulate_step
from sim.projection.sweeps import analytic_ceiling, ceiling_limit, depth_sweep, tail_sweep

REPO = Path(__file__).resolve().parent.parent
PASS = Fitted(LatencySpec(kind="fitted", base_s=0.01))  # every pass 10 ms, nothing else costs
ARM4 = ArmSpec(name="d4k1v4", depth=4, verify_tokens=4, accept_len=4.0)


def small_scenario(**kw) -> Scenario:
    base = dict(
        name="small", seed=1, steps=2,
        model=ModelSpec(params_b=1.0, layers=16, q_heads=16, kv_heads=4, head_dim=64),
        hardware=HardwareSpec(hbm_tbps=3.35, tflops=989.0),
        cluster=ClusterSpec(devices=[2, 8], max_batch=64),
        rollout=RolloutSpec(prompts=16, samples_per_prompt=4, prompt_len=64,
                            lengths=LengthSpec(median=300.0, sigma=1.0, max_len=4000)),
        spec=SpecSpec(arms=[ARM4], schedule="threshold", arm="d4k1v4", threshold=16, draft_params_b=0.05),
    )
    base.update(kw)
    return Scenario(**base)


def test_roofline_decode_is_memory_bound_and_large_verify_compute_bound():
    m = ModelSpec(params_b=7.0, layers=28, q_heads=28, kv_heads=4, head_dim=128)
    hw = HardwareSpec(hbm_tbps=2.0, tflops=1000.0, bandwidth_efficiency=1.0, flops_efficiency=1.0, step_overhead_s=0.0)
    r = Roofline(m, hw)
    assert r.forward_s(1, 1, 0) == pytest.approx(7e9 * 2 / 2e12)  # weights once at 2 TB/s
    assert r.forward_s(8, 8, 0) == pytest.approx(r.forward_s(1, 1, 0))  # a small batch rides free
    assert r.forward_s(64, 64 * 65, 0) == pytest.approx(2 * 7e9 * 64 * 65 / 1e15)  # compute-bound
    assert r.forward_s(1, 1, 1000) - r.forward_s(1, 1, 0) == pytest.approx(1000 * m.kv_bytes_per_token / 2e12)
    assert Roofline(m, hw, tensor_parallel=2).forward_s(1, 1, 0) == pytest.approx(r.forward_s(1, 1, 0) / 2)


def test_roofline_moe_reads_only_active_experts_for_one_token():
    m = ModelSpec(params_b=235.0, active_params_b=22.0, experts=128, experts_per_token=8, layers=94, q_heads=64,
                  kv_heads=4, head_dim=128)
    hw = HardwareSpec(hbm_tbps=1.0, tflops=1e6, bandwidth_efficiency=1.0, step_overhead_s=0.0)
    r = Roofline(m, hw)
    assert r.forward_s(1, 1, 0) == pytest.approx(22e9 * 2 / 1e12)
    assert r.forward_s(4096, 4096, 0) == pytest.approx(235e9 * 2 / 1e12)
    two = 235 - (235 - 22) / (1 - 1 / 16) * (1 - 1 / 16) ** 2  # two tokens: 1 - (15/16)^2 of the experts
    assert r.forward_s(2, 2, 0) == pytest.approx(two * 1e9 * 2 / 1e12)
    with pytest.raises(ValueError, match="experts"):
        ModelSpec(params_b=235.0, active_params_b=22.0, layers=94, q_heads=64, kv_heads=4, head_dim=128).validate()


def test_schedule_buckets_pick_arms_by_batch_and_off_above():
    tree = ArmSpec(name="d12k8v64", depth=12, topk=8, verify_tokens=64, accept_len=4.6)
    spec = SpecSpec(arms=[tree, ARM4], schedule="buckets",
                    buckets=[BucketSpec(max_batch=5, arm="d12k8v64"), BucketSpec(max_batch=32, arm="d4k1v4")])
    s = build_schedule(spec)
    assert [getattr(s.arm_for(b), "name", None) for b in (1, 5, 6, 32, 33)] == \
        ["d12k8v64", "d12k8v64", "d4k1v4", "d4k1v4", None]
    assert build_schedule(replace(spec, schedule="always", arm="d4k1v4")).arm_for(10**6) is ARM4


def test_chain_accept_length_and_spot_boost():
    assert chain_accept_len(0.5, 2) == pytest.approx(1.75)
    assert chain_accept_len(1.0, 3) == 4.0
    assert chain_accept_len(0.76, 3) == pytest.approx(2.77, abs=0.01)  # NeMo-RL k = 3
    assert boost(ArmSpec(name="a", depth=3, verify_tokens=3, accept_len=2.0), 1.5).accept_len == 2.5
    assert boost(ArmSpec(name="a", depth=3, verify_tokens=3, accept_len=3.5), 3.0).accept_len == 4.0  # capped


def test_group_time_is_passes_times_cost_with_queueing():
    # 2 slots, lengths 3, 5, 2: [3,5] prefill, 3 passes, admit 2, 2 passes, then 0 left of 5? 5-3-2=0
    g = simulate_group(np.array([3, 5, 2]), prompt_len=1, max_batch=2, latency=PASS, schedule=OFF)
    kinds = [(s.kind, s.rows, s.passes) for s in g.segments]
    assert kinds == [("prefill", 2, 1), ("off", 2, 3), ("prefill", 1, 1), ("off", 2, 2)]
    assert g.time_s == pytest.approx(0.01 * 7)
    assert g.tokens == 10 and g.decode_passes == 5


def test_speculation_divides_passes_by_accept_length():
    lengths = np.array([8, 16, 40])
    off = simulate_group(lengths, prompt_len=1, max_batch=8, latency=PASS, schedule=OFF)
    on = simulate_group(lengths, prompt_len=1, max_batch=8, latency=PASS, schedule=Schedule((99,), (ARM4,)))
    assert off.decode_passes == 40 and on.decode_passes == 10
    assert sum(s.emitted for s in on.segments) == pytest.approx(64)


def test_bubble_rows_verify_their_drafts_even_when_the_schedule_is_off():
    bubble = BubbleSpec(coverage=1.0, depth=9, accept_len=10.0)
    g = simulate_group(np.array([100, 100]), prompt_len=1, max_batch=8, latency=PASS, schedule=OFF,
                       bubble_mask=np.array([True, False]), bubble=bubble)
    seg = g.segments[1]
    assert seg.kind == "bubble" and seg.passes == 10 and seg.query_tokens == 10 + 1
    assert g.decode_passes == 10 + 90


def test_spread_mask_counts_and_spreads():
    m = spread_mask(10, 0.3)
    assert m.sum() == 3 and not (m[:-1] & m[1:]).any()
    assert spread_mask(5, 0.0).sum() == 0 and spread_mask(5, 1.0).all()


def test_step_idle_is_the_wait_for_the_slowest_group_and_phases_add():
    scn = small_scenario(latency=LatencySpec(kind="fitted", base_s=0.01),
                         phases=PhaseSpec(logprob_s_per_token=0.001, update_s_per_token=0.002, sync_s=0.5))
    lengths = np.array([10, 10, 30, 30])  # 2 groups: [10, 10] and [30, 30]
    r = simulate_step(scn, lengths, 2, Techniques())
    assert r.group_rollout_s.tolist() == pytest.approx([0.11, 0.31])
    assert r.idle_s.tolist() == pytest.approx([0.2, 0.0])
    tokens = 80 + 4 * 64
    assert (r.logprob_s, r.update_s, r.sync_s) == pytest.approx((0.001 * tokens / 2, 0.002 * tokens / 2, 0.5))
    assert r.step_s == pytest.approx(r.rollout_s + r.logprob_s + r.update_s + r.sync_s)


def test_one_step_async_overlaps_rollout_and_training():
    scn = small_scenario(latency=LatencySpec(kind="fitted", base_s=0.01),
                         phases=PhaseSpec(logprob_s_per_token=0.001, update_s_per_token=0.002, sync_s=0.5))
    r = simulate_step(scn, np.full(8, 50), 8, Techniques(one_step_async=True))
    assert len(r.groups) == 4  # half the devices generate
    assert r.step_s == pytest.approx(max(r.rollout_s, r.logprob_s + r.update_s) + r.sync_s)


def test_ceiling_is_reproduced_where_it_applies():
    scn = small_scenario()
    for p in ceiling_limit(scn, 8, [1.5, 3.0, 6.0]):
        assert p.rollout_speedup == pytest.approx(p.x, rel=0.01)
        assert p.step_speedup == pytest.approx(p.ceiling, rel=0.01)
    assert analytic_ceiling(1.0, 3.0) == pytest.approx(3.0) and analytic_ceiling(0.0, 3.0) == 1.0


def test_spot_and_bubble_fill_the_idle_window_and_help():
    scn = small_scenario(spot=replace(small_scenario().spot, accept_gain=1.5))
    lengths = np.random.default_rng(0).lognormal(np.log(300), 1.0, 64).astype(int) + 1
    spec = simulate_step(scn, lengths, 8, Techniques(spec=True))
    spot = simulate_step(scn, lengths, 8, Techniques(spec=True, spot=True))
    both = simulate_step(scn, lengths, 8, Techniques(spec=True, spot=True, bubble=True))
    assert spot.used.accept_gain == 1.5 and spot.rollout_s < spec.rollout_s
    assert both.used.coverage > 0 and both.rollout_s < spot.rollout_s
    fill = both.fill.pregen_s + both.fill.spot_s
    assert fill == pytest.approx(both.idle_s)


def test_projection_is_deterministic_given_the_seed():
    scn = small_scenario()
    combos = {k: COMBOS[k] for k in ("baseline", "spec")}
    a, b = project(scn, combos), project(scn, combos)
    c = project(replace(scn, seed=2), combos)
    assert a == b and a != c


def test_speedup_grows_with_scale():
    rows = project(small_scenario(cluster=ClusterSpec(devices=[1, 4, 16], max_batch=64)),
                   {k: COMBOS[k] for k in ("baseline", "spec")})
    spec = [r.rollout_speedup for r in rows if r.combo == "spec"]
    assert spec[0] < spec[1] < spec[2]


def test_speedup_grows_with_the_tail():
    points = tail_sweep(small_scenario(), 2, [0.1, 0.6, 1.2])
    assert points[0].rollout_speedup < points[1].rollout_speedup < points[2].rollout_speedup


def test_shorter_drafts_win_when_verification_is_expensive():
    # A 7B target on a slow-compute device: verifying many tokens for a large batch is compute-bound.
    scn = small_scenario(model=ModelSpec(params_b=7.0, layers=28, q_heads=28, kv_heads=4, head_dim=128),
                         hardware=HardwareSpec(hbm_tbps=3.35, tflops=300.0), steps=1,
                         rollout=replace(small_scenario().rollout, lengths=LengthSpec(median=100.0, sigma=0.3)))
    sweep = depth_sweep(replace(scn, spec=replace(scn.spec, draft_params_b=0.2)), [1, 3, 5, 7], [1, 128], 0.76)
    best = {b: max(pts, key=lambda p: p.rollout_speedup).x for b, pts in sweep.items()}
    assert best[128] < best[1]
    big = {p.x: p.rollout_speedup for p in sweep[128]}
    assert big[3] > big[5] > big[7]  # NeMo-RL: k = 3 beat 5 and 7


def test_scenario_unknown_key_is_named(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text((REPO / "sim/scenarios/7b.yaml").read_text() + "\nbubble:\n  coverag: 0.3\n")
    with pytest.raises(ValueError, match="bubble.coverag"):
        load_scenario(path)


def test_scenario_arm_must_exist(tmp_path):
    with pytest.raises(ValueError, match="not among spec.arms"):
        load_scenario(REPO / "sim/scenarios/7b.yaml", ["spec.buckets=[{max_batch: 4, arm: d9k1v9}]"])


@pytest.mark.parametrize("name", ["7b", "32b", "235b_moe", "7b_separated", "32b_separated"])
def test_shipped_scenarios_load(name):
    scn = load_scenario(REPO / f"sim/scenarios/{name}.yaml")
    assert scn.cluster.devices and scn.spec.arms
