"""Live memory over a run: the live-RSS reading follows what the process holds now (unlike a peak),
the growth fit finds a leak and ignores the warm-up, and a short soak of two ranks with spot
training and bubble drafts on keeps every rank's live RSS flat (bench.soak; `make soak` runs 200 steps)."""

from __future__ import annotations

import json

import pytest
import torch

from common import heap
from pipeline.metrics.live_memory import growth_per_step, live_rss_bytes, rss_metrics
from tests.test_separated import step_rows, torchrun

MB = 1 << 20


def test_live_rss_rises_with_memory_touched_and_falls_when_it_is_freed():
    before = live_rss_bytes()
    block = torch.ones(256 * MB // 4)  # 256 MiB, written: resident
    held = live_rss_bytes()
    del block
    heap.trim()  # where glibc carved the block from its heap (earlier tests left it large), hand it back
    after = live_rss_bytes()
    assert held - before > 200 * MB
    assert held - after > 200 * MB  # a peak would stay up: this is what the process holds now


def test_rss_metrics_name_every_rank_and_the_largest():
    assert rss_metrics([1.5, 2.0]) == {"mem/rss_gb": 2.0, "mem/rss_gb/rank0": 1.5, "mem/rss_gb/rank1": 2.0}


def test_the_growth_fit_finds_a_leak_of_a_megabyte_a_step_in_noise_and_ignores_the_warm_up():
    g = torch.Generator().manual_seed(0)
    steps = list(range(1, 61))
    noise = (torch.randn(60, generator=g) * 4e-3).tolist()  # +-4 MB of allocator noise, in GB
    warm = [0.5 if s <= 10 else 0.0 for s in steps]  # half a GB filled in over the warm-up
    flat = [1.0 + w + n for w, n in zip(warm, noise)]
    leak = [v + 1e-3 * s for v, s in zip(flat, steps)]  # 1 MB a step
    assert abs(growth_per_step(steps, flat, warmup=10)) < 0.3e-3
    assert growth_per_step(steps, leak, warmup=10) == pytest.approx(1e-3, abs=0.3e-3)
    assert growth_per_step(steps, flat, warmup=0) < -5e-3  # the warm-up's fill, left in, reads as a trend
    with pytest.raises(ValueError, match="2 steps after the warm-up of 58"):
        growth_per_step(steps, flat, warmup=58)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_short_soak_with_spot_training_and_bubble_drafts_keeps_every_ranks_live_memory_flat(
        char_model_dir, char_drafter_dir, tmp_path):
    steps, warmup = 80, 30  # the char model fills in for ~25 steps (allocator arenas, shapes seen), then stays flat
    run_dir = tmp_path / "soak"
    res = torchrun(2, run_dir, f"model.path={char_model_dir}", "engine.spec.drafter=eagle",
                   f"engine.spec.drafter_path={char_drafter_dir}", "engine.spec.depth=4", "engine.spec.verify_tokens=4",
                   "spot.rows_per_step=4", "spot.window=64", "trainer.save_every=10", "trainer.eval_every=10",
                   "metrics.dashboard=true", "--steps", str(steps), "--warmup", str(warmup), "--max-growth-mb", "1.0",
                   module="bench.soak", check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = step_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert sum(r["spot/micro_steps"] for r in rows) > 0 and sum(r["bubble/pregenerated"] for r in rows) > 0
    for r in rows:
        assert 0.1 < r["mem/rss_gb/rank0"] < 10 and 0.1 < r["mem/rss_gb/rank1"] < 10  # GB, not bytes or pages
        assert r["mem/rss_gb"] == max(r["mem/rss_gb/rank0"], r["mem/rss_gb/rank1"])
    report = json.loads((run_dir / "soak.json").read_text())
    assert sorted(report["ranks"]) == ["0", "1"] and report["worst_growth_mb_per_step"] <= 1.0
    assert (run_dir / "dashboard.png").is_file()


def test_the_dashboard_draws_each_ranks_live_memory_with_its_growth_a_step(tmp_path):
    from pipeline.metrics import MetricsLogger
    from pipeline.metrics.dashboard import dashboard_figure
    from pipeline.metrics.history import load_history
    from pipeline.metrics.sinks import JsonlSink

    with MetricsLogger(tmp_path, [JsonlSink(tmp_path)]) as logger:
        for step in range(1, 21):
            logger.log(step, {"timing/step": 1.0, **rss_metrics([1.0, 2.0 + 0.002 * step])})  # rank 1: 2 MB a step
    ax = next(a for a in dashboard_figure(load_history(tmp_path), "t").axes if a.get_title() == "Live memory per rank")
    assert ax.get_legend_handles_labels()[1] == ["rank 0, +0.00 MB/step after step 5",
                                                 "rank 1, +2.00 MB/step after step 5"]
