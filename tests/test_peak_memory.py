"""Each rank's peak resident memory: measured in GB, logged per step in the rank's log and as metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.trainer import peak_rss_gb


def resident_gb() -> float:
    """This process's resident memory now (VmRSS in /proc/self/status, kB), in GB."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024 / 1e9


def test_the_peak_is_at_least_the_resident_memory_now_and_counts_a_touched_allocation():
    # The kernel counts resident pages per thread in batches: the two readings may differ by a few MB.
    slack = 0.01
    now = resident_gb()
    assert now - slack <= peak_rss_gb() < now + 64  # GB both: a unit slip of 1024x would break one side
    before = peak_rss_gb()
    big = torch.ones(int((before + 0.3) * 1e9 / 4))  # touched: more than the peak so far, resident
    assert peak_rss_gb() >= big.numel() * 4 / 1e9 > before


def test_each_phase_reads_its_own_peak_and_the_peak_so_far_keeps_every_phases():
    from common import heap
    from pipeline.metrics import phase_peaks

    phase_peaks.mark()
    big = torch.ones(int(0.4e9 / 4))  # 400 MB, touched, then freed: the first phase's peak
    del big
    heap.trim()  # handed back to the OS even where glibc's threshold (raised by earlier tests) kept it in the heap
    first = phase_peaks.mark()
    small = torch.ones(int(0.05e9 / 4))
    second = phase_peaks.mark()
    del small
    assert first - second > 0.3e9  # the mark was reset between the phases
    assert phase_peaks.peak_bytes() >= first and peak_rss_gb() * 1e9 >= first


@pytest.mark.slow
def test_a_run_logs_each_ranks_peak_resident_memory_every_step(char_model_dir, tmp_path):
    from common.config import load_config
    from launch.run.build import run
    from launch.run.config import TrainConfig
    from pipeline.dist import Ranks

    repo = Path(__file__).resolve().parent.parent
    cfg = load_config(TrainConfig, repo / "configs" / "tiny.yaml", [
        f"model.path={char_model_dir}", f"run.out_dir={tmp_path}", "task.train_problems=16", "task.eval_problems=2",
        "rollout.n=2", "rollout.max_new_tokens=8", "engine.max_batch=8", "engine.max_len=64", "trainer.steps=2",
        "trainer.prompts_per_step=2", "trainer.eval_every=0", "trainer.save_every=0", "engine.spec.enabled=false",
        "spot.enabled=false", "bubble.enabled=false", "metrics.wandb=false", "metrics.console=false",
        "metrics.dashboard=false"])
    summary = run(cfg, Ranks())
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.1 < r["memory/peak_rss_gb"] == r["memory/peak_rss_gb/rank0"] <= peak_rss_gb()
        phases = [r[f"mem/peak_gb/{p}/rank0"] for p in ("other", "rollout", "update")]
        assert 0.1 < max(phases) <= r["memory/peak_rss_gb"]
    assert rows[0]["memory/peak_rss_gb"] <= rows[1]["memory/peak_rss_gb"]  # a peak only grows
    logged = [x for x in (run_dir / "rank0.log").read_text().splitlines() if "peak RSS" in x]
    assert len(logged) == 2 and logged[1].endswith("GB on rank 0") and "step 2: peak RSS" in logged[1]
