"""bench/gpu_check.sh's driver, on a machine without CUDA: it stops after the device check with a
table that says why, and reads each bench's JSON result into the table's line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_check import Step, steps

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path; this machine has a GPU")
def test_without_cuda_the_check_stops_at_the_device_and_prints_why():
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--budget-s", "60"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    table = proc.stdout.split("\ncheck ")[1]
    assert "cuda device" in table and "no CUDA device" in table
    assert "bench.engine" not in table  # nothing else ran


def test_a_step_reads_the_benchs_json_last_line_and_pytest_totals():
    bench = Step("b", [], 1, summary="ratio,identical")
    out = "table\n" + json.dumps({"ratio": {"1": 2.5}, "identical": True, "cpu": "x"}) + "\n"
    assert bench.describe(out) == "ratio {'1': 2.5}; identical True"
    assert Step("t", [], 1, summary="pytest").describe("..s\n3 passed, 2 skipped in 4.0s\n") == "3 passed, 2 skipped in 4.0s"


def test_every_step_runs_a_module_of_this_checkout_within_the_eight_minute_budget():
    from bench.gpu_check import BUDGET_S

    assert BUDGET_S + 30 <= 8 * 60  # the steps share the budget; 30 s for start-up and the table
    for s in steps(sys.executable):
        if s.cmd[1] == "-m" and s.cmd[2] != "pytest":
            assert (REPO / (s.cmd[2].replace(".", "/") + ".py")).is_file(), s.cmd[2]
