"""Metrics: the logger's three sinks, rank filtering, crash safety, resume, the dashboard and summary."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.config import from_dict
from pipeline.metrics import MetricsConfig, MetricsLogger
from pipeline.metrics.dashboard import dashboard_figure, main, render_dashboard
from pipeline.metrics.history import load_history
from pipeline.metrics.jsonl import read_records
from pipeline.metrics.lengths import length_stats
from pipeline.metrics.sinks import ConsoleSink, JsonlSink, resolve_wandb_mode
from pipeline.metrics.summary import summary_lines, write_summary

REPO = Path(__file__).resolve().parent.parent
OFFLINE = {"WANDB_MODE": "offline"}
QUIET = MetricsConfig(wandb=False, console=False, dashboard=False)


def step_metrics(step: int) -> dict[str, float]:
    """A full step as the loop logs it, two ranks, with numbers that are easy to check."""
    return {
        "reward/mean": 0.1 * step, "reward/std": 0.2, "rollout/response_length/mean": 50.0 + step,
        "rollout/response_length/max": 100.0 + step, "rollout/tokens_per_s": 400.0, "rollout/batch_size": 8,
        "spec/accept_len": 3.0, "spec/accept_rate": 0.5, "timing/step": 10.0, "timing/rollout": 5.0,
        "timing/logprob": 1.0, "timing/update": 2.0, "timing/sync": 0.5, "timing/idle": 1.0,
        "timing/rollout/rank0": 6.0, "timing/rollout/rank1": 4.0, "timing/idle/rank0": 0.0, "timing/idle/rank1": 2.0,
        "train/pg_loss": 0.01, "train/kl": 0.001, "mem/rss_gb": 1.1, "mem/rss_gb/rank0": 1.0, "mem/rss_gb/rank1": 1.1,
    }


def write_run(run_dir: Path, steps: int, *, eval_every: int = 0, lengths: bool = True) -> None:
    with MetricsLogger(run_dir, [JsonlSink(run_dir)]) as logger:
        for step in range(steps):
            logger.log(step, step_metrics(step), lengths=[10 + step, 20 + step, 30] if lengths else None)
            if eval_every and step % eval_every == 0:
                logger.log(step, {"eval/accuracy": 0.3 + 0.1 * step})


@pytest.mark.slow  # W&B's offline init starts its service process (~1-3 s)
def test_logger_writes_jsonl_wandb_offline_and_console(tmp_path, capsys):
    config = MetricsConfig(wandb=True, console=True, dashboard=False)
    with MetricsLogger.from_config(tmp_path, config, run_name="t", resolved_config={"seed": 0},
                                   environ=OFFLINE) as logger:
        assert logger.sink_names == ["jsonl", "wandb", "console"]
        logger.log(0, step_metrics(0), lengths=[10, 20])
        logger.log(1, step_metrics(1), lengths=[11, 21])
        logger.log(1, {"eval/accuracy": 0.4})
    assert read_records(tmp_path / "metrics.jsonl") == [
        {"step": 0, **step_metrics(0), **length_stats([10, 20])},
        {"step": 1, **step_metrics(1), **length_stats([11, 21])}, {"step": 1, "eval/accuracy": 0.4}]
    assert read_records(tmp_path / "lengths.jsonl") == [{"step": 0, "lengths": [10, 20]},
                                                        {"step": 1, "lengths": [11, 21]}]
    offline_runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1 and list(offline_runs[0].glob("run-*.wandb"))
    out = capsys.readouterr().out
    assert "step 1  reward 0.100  len p50 16  max 21  rollout 5.0s  accept 3.00  tok/s 400  idle 10%" in out
    assert "step 1  eval 0.400" in out


def test_other_ranks_write_nothing(tmp_path):
    run_dir = tmp_path / "run"
    config = MetricsConfig(wandb=True, console=True, dashboard=True)
    with MetricsLogger.from_config(run_dir, config, rank=1, environ=OFFLINE) as logger:
        assert logger.sink_names == []
        logger.log(0, step_metrics(0), lengths=[1, 2])
    assert not run_dir.exists()
    with pytest.raises(ValueError, match="only rank 0"):
        MetricsLogger(run_dir, [JsonlSink(tmp_path / "other")], rank=1)


def test_jsonl_lines_survive_a_crash(tmp_path):
    script = (
        "import os\n"
        "from pipeline.metrics import MetricsConfig, MetricsLogger\n"
        f"logger = MetricsLogger.from_config({str(tmp_path)!r}, MetricsConfig(wandb=False, console=False))\n"
        "for step in range(3):\n"
        "    logger.log(step, {'reward/mean': step / 2}, lengths=[step])\n"
        "os._exit(3)  # no close(), no atexit, no buffers flushed by the interpreter\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=60)
    assert proc.returncode == 3
    records = read_records(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward/mean"], r["rollout/response_length/max"]) for r in records] == [
        (s, s / 2, s) for s in range(3)]
    assert [r["lengths"] for r in read_records(tmp_path / "lengths.jsonl")] == [[0], [1], [2]]


def test_resume_drops_later_steps_and_a_torn_line(tmp_path):
    write_run(tmp_path, 5)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "reward/me')  # killed mid-write
    with pytest.warns(RuntimeWarning, match="torn last line"):
        logger = MetricsLogger.from_config(tmp_path, QUIET, resume_after_step=2)
    logger.log(3, {"reward/mean": 9.0}, lengths=[7])
    logger.close()
    records = read_records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3] and records[-1] == {"step": 3, "reward/mean": 9.0,
                                                                           **length_stats([7])}
    assert [r["step"] for r in read_records(tmp_path / "lengths.jsonl")] == [0, 1, 2, 3]


def test_a_corrupt_middle_line_is_an_error_naming_it(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not JSON"):
        read_records(tmp_path / "metrics.jsonl")


class BrokenSink:
    name = "broken"

    def __init__(self) -> None:
        self.closed = False

    def write(self, step, metrics, lengths) -> None:
        raise OSError("disk full")

    def close(self) -> None:
        self.closed = True


def test_a_failing_sink_warns_once_by_name_and_the_others_go_on(tmp_path):
    broken = BrokenSink()
    logger = MetricsLogger(tmp_path, [broken, JsonlSink(tmp_path)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            logger.log(step, {"reward/mean": 1.0})
    messages = [str(w.message) for w in caught]
    assert messages == ["metrics sink 'broken' failed; it is off for the rest of the run: OSError: disk full"]
    assert broken.closed and logger.sink_names == ["jsonl"]
    logger.close()
    assert len(read_records(tmp_path / "metrics.jsonl")) == 3


def test_bad_metrics_raise_for_the_caller(tmp_path):
    import torch

    logger = MetricsLogger(tmp_path, [])
    with pytest.raises(ValueError, match=r"metric 'train/kl' must be a number.*\.item\(\)"):
        logger.log(0, {"train/kl": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="metric 'spec/enabled' must be a number"):
        logger.log(0, {"spec/enabled": True})
    with pytest.raises(ValueError, match="disagrees with step=2"):
        logger.log(2, {"step": 3})
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        logger.log(-1, {})


def test_wandb_mode_comes_from_the_environment_first():
    assert resolve_wandb_mode("offline", {}) == "offline"
    assert resolve_wandb_mode("offline", {"WANDB_MODE": "dryrun"}) == "offline"
    with pytest.warns(UserWarning, match="metrics.wandb_mode=offline is ignored"):
        assert resolve_wandb_mode("offline", {"WANDB_MODE": "online"}) == "online"
    with pytest.raises(ValueError, match="WANDB_MODE='onlin'"):
        resolve_wandb_mode("offline", {"WANDB_MODE": "onlin"})


def test_metrics_config_rejects_bad_values():
    with pytest.raises(ValueError, match="metrics.wandb_mode.*must be one of"):
        from_dict(MetricsConfig, {"wandb_mode": "cloud"}, "metrics")
    with pytest.raises(ValueError, match="wandb_project must be a W&B project name"):
        from_dict(MetricsConfig, {"wandb_project": "my project"}, "metrics")


def test_console_prints_plain_lines_off_a_terminal():
    out = io.StringIO()
    sink = ConsoleSink(out)
    sink.write(7, {"reward/mean": 0.25, "spec/accept_len": 2.5}, None)
    assert out.getvalue() == "step 7  reward 0.250  accept 2.50\n"


def test_dashboard_renders_every_panel_from_a_run_folder(tmp_path, capsys):
    from PIL import Image

    write_run(tmp_path, 40, eval_every=10)
    fig = dashboard_figure(load_history(tmp_path), "t")
    assert not [t.get_text() for ax in fig.axes for t in ax.texts]  # no panel says "no ... logged"
    main([str(tmp_path)])
    png = tmp_path / "dashboard.png"
    assert capsys.readouterr().out == f"dashboard: {png}\nsummary: {tmp_path / 'summary.txt'}\n"
    assert png.stat().st_size < 200_000
    assert Image.open(png).size == (1800, 756)


def test_dashboard_panels_without_data_say_so(tmp_path):
    sink = JsonlSink(tmp_path)
    sink.write(0, {"reward/mean": 0.5}, None)  # a run that logged only its reward
    sink.close()
    fig = dashboard_figure(load_history(tmp_path), "t")
    notes = sorted(t.get_text() for ax in fig.axes for t in ax.texts)
    assert notes == ["no mem/rss_gb/rank<r> logged", "no response lengths (lengths.jsonl) logged",
                     "no rollout/response_length/p50, p90 or max logged", "no rollout/tokens_per_s logged",
                     "no spec/accept_len or spec/accept_rate logged",
                     "no timing/idle/rank<r> with timing/step logged", "no timing/step logged"]
    assert render_dashboard(tmp_path).exists()
    (tmp_path / "metrics.jsonl").unlink()
    assert render_dashboard(tmp_path).exists()  # no metrics at all: every panel says so


def test_summary_reports_rewards_accuracy_time_split_and_idle(tmp_path):
    write_run(tmp_path, 5, eval_every=2)
    lines = summary_lines(load_history(tmp_path))
    assert lines == [
        "steps: 5 (0..4)",
        "reward/mean: first 0.0000 (step 0), last 0.4000 (step 4)",
        "eval/accuracy: best 0.7000 (step 4), last 0.7000",
        "step time: mean 10.00 s = rollout 5.00 + idle 1.00 + logprob 1.00 + update 2.00 + sync 0.50 + other 0.50",
        "spec/accept_len: mean 3.00",
        "idle share: 10.0% (rank 0 0.0%, rank 1 20.0%)",
        "response length: median 22 tokens; a step's longest over its median: least 1.2x, median 1.4x, most 1.5x "
        "(>= 8x in 0 of 5 steps)",
    ]
    path = write_summary(tmp_path)
    assert path.read_text().splitlines()[1:] == lines


def test_summary_of_a_run_that_logged_little_says_na(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.5}) + "\n")
    assert summary_lines(load_history(tmp_path)) == [
        "steps: 1 (0..0)", "reward/mean: first 0.5000 (step 0), last 0.5000 (step 0)", "eval/accuracy: n/a",
        "step time: n/a", "spec/accept_len: n/a", "idle share: n/a", "response length: n/a"]


def test_close_writes_the_report_on_rank_0(tmp_path, capsys):
    config = MetricsConfig(wandb=False, console=False, dashboard=True)
    with MetricsLogger.from_config(tmp_path, config) as logger:
        logger.log(0, step_metrics(0), lengths=[3, 4])
    assert (tmp_path / "dashboard.png").exists() and (tmp_path / "summary.txt").exists()
    assert "dashboard: " in capsys.readouterr().out


def test_summary_counts_the_steps_whose_longest_response_is_8x_their_median(tmp_path):
    with MetricsLogger(tmp_path, [JsonlSink(tmp_path)]) as logger:
        logger.log(0, {"reward/mean": 0.5}, lengths=[10, 10, 10, 90])  # 9x
        logger.log(1, {"reward/mean": 0.5}, lengths=[10, 20, 30, 70])  # 2.8x
    assert summary_lines(load_history(tmp_path))[-1] == (
        "response length: median 15 tokens; a step's longest over its median: least 2.8x, median 5.9x, most 9.0x "
        "(>= 8x in 1 of 2 steps)")


def test_a_run_folder_logs_to_one_wandb_run_id_across_starts_with_system_stats_as_configured(tmp_path, monkeypatch):
    import wandb

    from pipeline.metrics.sinks import WandbSink, wandb_run_id

    calls = []
    monkeypatch.setattr(wandb, "init", lambda **kw: calls.append(kw) or SimpleNamespace(finish=lambda: None))
    first = WandbSink(tmp_path / "run", project="p", run_name="r", config=None, mode="offline")
    again = WandbSink(tmp_path / "run", project="p", run_name="r", config=None, mode="offline", system_stats=False)
    other = WandbSink(tmp_path / "other", project="p", run_name="r", config=None, mode="offline")
    assert first.run_id == again.run_id == wandb_run_id(tmp_path / "run") != other.run_id
    assert first.run_id.startswith("run-") and {c["resume"] for c in calls} == {"allow"}
    assert [c["settings"].x_disable_stats for c in calls] == [False, True, False]


def test_cuda_memory_is_logged_per_rank_and_as_the_largest_ranks(monkeypatch):
    import torch

    from pipeline.dist import Ranks
    from pipeline.metrics.device_memory import cuda_memory_metrics

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_memory_metrics(Ranks()) == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3_500_000_000)
    assert cuda_memory_metrics(Ranks()) == {"memory/cuda_max_allocated_gb": 3.5, "memory/cuda_max_allocated_gb/rank0": 3.5}
