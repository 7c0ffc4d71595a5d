"""What a user sees of a run: response-length percentiles (logged once, shown on the console line
and the dashboard), and a speedup only when one was measured against a reference run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from pipeline.metrics import MetricsLogger
from pipeline.metrics.comparison import COMPARISON_FILE, compare_runs, read_comparison, record_comparison
from pipeline.metrics.dashboard import dashboard_figure, main
from pipeline.metrics.history import load_history
from pipeline.metrics.jsonl import read_records
from pipeline.metrics.lengths import length_stats
from pipeline.metrics.sinks import ConsoleSink, JsonlSink
from pipeline.metrics.summary import summary_lines

PANELS = ["Reward and held-out accuracy", "Response length percentiles", "Response lengths", "Rollout throughput",
          "Step time split", "Speculation", "Idle share per rank", "Live memory per rank"]
RATIO_PANEL = "Step-time ratio: reference / this run"


def write_run(run_dir: Path, step_s: list[float], lengths: list[list[int]] | None = None) -> Path:
    """A run as launch.run.build logs it: the eval of step 0, then trained steps 1..N with their times."""
    with MetricsLogger(run_dir, [JsonlSink(run_dir)]) as logger:
        logger.log(0, {"eval/accuracy": 0.25})
        for step, seconds in enumerate(step_s, 1):
            step_lengths = lengths[step - 1] if lengths else [10, 20, 30 + step]
            logger.log(step, {"reward/mean": 0.1 * step, "timing/step": seconds, "timing/rollout": seconds / 2},
                       lengths=step_lengths)
    return run_dir


def titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes if ax.get_title()]  # twin axes carry no title


def test_length_stats_interpolate_percentiles_between_sorted_lengths():
    assert length_stats(list(range(10, 0, -1))) == {  # 1..10, in any order
        "rollout/response_length/mean": 5.5, "rollout/response_length/p50": 5.5,
        "rollout/response_length/p90": pytest.approx(9.1), "rollout/response_length/max": 10.0}
    tail = length_stats([100] * 9 + [10_000])  # one long rollout of ten
    assert tail["rollout/response_length/p50"] == 100.0
    assert tail["rollout/response_length/p90"] == pytest.approx(100 + 0.1 * 9_900)  # 10% of the way to the 10th
    assert tail["rollout/response_length/max"] == 10_000.0
    assert set(length_stats([7]).values()) == {7.0}
    assert length_stats([]) == {}


def test_the_logger_logs_every_ranks_length_stats_over_the_callers(tmp_path):
    with MetricsLogger(tmp_path, [JsonlSink(tmp_path)]) as logger:
        # the caller's mean and max are one rank's; `lengths` are every rank's
        logger.log(1, {"rollout/response_length/mean": 15.0, "rollout/response_length/max": 20.0},
                   lengths=[10, 20, 30, 400])
        logger.log(2, {"rollout/response_length/max": 20.0})  # no lengths: the caller's value stands
    first, second = read_records(tmp_path / "metrics.jsonl")
    assert first == {"step": 1, **length_stats([10, 20, 30, 400])} and first["rollout/response_length/max"] == 400
    assert second == {"step": 2, "rollout/response_length/max": 20.0}


def test_the_console_line_shows_the_steps_p50_and_max_length():
    out = io.StringIO()
    with MetricsLogger("unused", [ConsoleSink(out)]) as logger:
        logger.log(3, {"reward/mean": 0.5}, lengths=[12, 40, 7, 900, 25])
    assert out.getvalue() == "step 3  reward 0.500  len p50 25  max 900\n"


def test_the_dashboard_has_no_ratio_panel_without_a_comparison(tmp_path):
    write_run(tmp_path, [3.0, 1.0, 1.0])
    fig = dashboard_figure(load_history(tmp_path), "t")
    assert titles(fig) == PANELS


def test_the_length_panel_turns_logarithmic_when_the_tail_is_ten_times_the_median(tmp_path):
    def yscale(run_dir: Path, lengths: list[list[int]]) -> str:
        write_run(run_dir, [1.0] * len(lengths), lengths)
        fig = dashboard_figure(load_history(run_dir), "t")
        return next(ax for ax in fig.axes if ax.get_title() == "Response length percentiles").get_yscale()

    assert yscale(tmp_path / "narrow", [[100, 120, 150], [110, 200, 300]]) == "linear"
    assert yscale(tmp_path / "tail", [[100, 120, 150], [110, 200, 3000]]) == "log"


def test_the_comparison_is_the_ratio_of_mean_step_times_after_the_first_step(tmp_path):
    run = write_run(tmp_path / "on", [30.0, 10.0, 20.0, 10.0])
    ref = write_run(tmp_path / "off", [40.0, 20.0, 20.0, 20.0, 99.0])  # a step more: left out
    c = compare_runs(run, ref)
    assert c.steps == [1, 2, 3, 4] and c.timed_steps == [2, 3, 4]
    assert c.step_ratios == pytest.approx([4 / 3, 2.0, 1.0, 2.0])
    assert c.step_ratio == pytest.approx(60 / 40)  # not the mean of the ratios (5/3): the run's time saved
    assert c.identical is None


def test_the_dashboard_shows_the_ratio_panel_with_a_comparison(tmp_path, capsys):
    run = write_run(tmp_path / "on", [30.0, 10.0, 20.0, 10.0])
    ref = write_run(tmp_path / "off", [40.0, 20.0, 20.0, 20.0])
    fig = dashboard_figure(load_history(run), "t", compare_runs(run, ref))
    assert titles(fig) == [*PANELS[:5], RATIO_PANEL, *PANELS[5:]]
    ratio_ax = next(ax for ax in fig.axes if ax.get_title() == RATIO_PANEL)
    labels = ratio_ax.get_legend_handles_labels()[1]
    assert labels == ["vs off", "mean step time, steps 2..4: 1.50x"]
    main([str(run), "--compare", str(ref)])
    assert (run / "dashboard.png").exists() and not (run / COMPARISON_FILE).exists()  # shown, not recorded
    assert "measured speedup: 1.50x" in (run / "summary.txt").read_text()
    assert capsys.readouterr().out.startswith("dashboard: ")


def test_the_summary_states_a_speedup_only_from_a_comparison_record(tmp_path):
    run = write_run(tmp_path / "on", [30.0, 10.0, 20.0, 10.0])
    ref = write_run(tmp_path / "off", [40.0, 20.0, 20.0, 20.0])
    main([str(run)])
    assert "speedup" not in (run / "summary.txt").read_text()
    assert not any("speed" in line for line in summary_lines(load_history(run)))

    recorded = record_comparison(run, ref, identical=True)
    record = json.loads((run / COMPARISON_FILE).read_text())
    assert record == {"reference_run": str(ref), "steps": [1, 2, 3, 4], "step_s": [30.0, 10.0, 20.0, 10.0],
                      "reference_step_s": [40.0, 20.0, 20.0, 20.0], "step_ratio": 1.5, "identical": True}
    assert read_comparison(run) == recorded
    main([str(run)])  # a rebuild reads the record
    assert (run / "summary.txt").read_text().splitlines()[-1] == (
        f"measured speedup: 1.50x vs {ref} (mean step time, reference / this run, steps 2..4; identical runs: yes)")
    assert titles(dashboard_figure(load_history(run), "t", read_comparison(run)))[5] == RATIO_PANEL


def test_a_comparison_needs_two_steps_timed_by_both_runs(tmp_path):
    run = write_run(tmp_path / "on", [30.0, 10.0])
    ref = write_run(tmp_path / "off", [40.0])
    with pytest.raises(ValueError, match="at least 2 steps timed by both runs"):
        compare_runs(run, ref)
    with pytest.raises(SystemExit, match="error: .*at least 2 steps"):
        main([str(run), "--compare", str(ref)])
    with pytest.raises(SystemExit, match="error: run folder not found"):
        main([str(run), "--compare", str(tmp_path / "missing")])


def test_a_bad_comparison_record_is_an_error_naming_the_file(tmp_path):
    run = write_run(tmp_path / "on", [30.0, 10.0])
    (run / COMPARISON_FILE).write_text(json.dumps({"reference_run": "x", "steps": [1, 2], "step_s": [1.0, 1.0],
                                                   "reference_step_s": [2.0, 2.0], "speedup": 2.0}))
    with pytest.raises(ValueError, match=r"comparison.json: comparison record has unknown keys \['speedup'\]"):
        read_comparison(run)
    (run / COMPARISON_FILE).write_text("{not json")
    with pytest.raises(SystemExit, match="comparison.json: .*delete it"):
        main([str(run)])
