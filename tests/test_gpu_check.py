"""bench/gpu_check.sh's driver, on a machine without CUDA: it stops after the device check with a
table that says why; its test steps collect every gpu-marked test; a step that runs out of time is
reported with its own output and the next step still runs; each bench's JSON result becomes the
table's line."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import bench.gpu_check as gpu_check
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


def test_every_bench_step_runs_a_module_of_this_checkout():
    for s in steps(sys.executable):
        if s.cmd[1] == "-m" and s.cmd[2] != "pytest":
            assert (REPO / (s.cmd[2].replace(".", "/") + ".py")).is_file(), s.cmd[2]


def test_the_tiny_benches_run_on_the_model_and_drafter_make_train_builds():
    """A fresh GPU machine has what `make train` built (Makefile's TINY_READY) and nothing else: the
    tiny steps must name those folders, or they are skipped as missing, and the headline's config
    must be the one whose model that is."""
    ready = re.search(r"^TINY_READY := (.*)$", (REPO / "Makefile").read_text(), re.M).group(1).split()
    assert {str((p / "config.json").relative_to(REPO)) for p in (gpu_check.TINY, gpu_check.TINY_DRAFTER)} == set(ready)
    config = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    assert REPO / config["model"]["path"] == gpu_check.TINY
    assert REPO / config["engine"]["spec"]["drafter_path"] == gpu_check.TINY_DRAFTER
    by_name = {s.name: s for s in steps(sys.executable)}
    assert by_name["bench.e2e tiny mult, 1 rank"].cmd[3:5] == ["--config", "configs/tiny.yaml"]
    assert str(gpu_check.TINY) in by_name["bench.longtail tiny mult"].cmd


def _is_gpu_mark(node: ast.expr) -> bool:
    """`pytest.mark.gpu`, or a list / tuple holding it (a module's `pytestmark`)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_gpu_mark(e) for e in node.elts)
    return ast.unparse(node) == "pytest.mark.gpu"


def gpu_marked_tests() -> dict[str, set[str]]:
    """Every test function under tests/ marked gpu (itself or its module), by file, read from the source."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_gpu = any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)
                         and _is_gpu_mark(n.value) for n in tree.body)
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
                 and (module_gpu or any(_is_gpu_mark(d) for d in n.decorator_list))}
        if names:
            found[str(path.relative_to(REPO))] = names
    return found


@pytest.mark.slow
def test_the_gpu_test_steps_collect_every_gpu_marked_test():
    """The main step's own pytest command, collecting only, finds every gpu-marked test outside
    tests/vllm (whose modules need vllm, absent here); the vllm step covers those."""
    by_name = {s.name: s for s in steps(sys.executable)}
    main, vllm = by_name["gpu-marked tests"], by_name["gpu-marked vllm tests"]
    proc = subprocess.run([*main.cmd, "--collect-only"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    collected: dict[str, set[str]] = {}
    for line in proc.stdout.splitlines():
        if "::" in line:
            path, *_, name = line.split("::")
            collected.setdefault(path, set()).add(name.split("[")[0])
    marked = gpu_marked_tests()
    assert {"tests/test_gpu.py", "tests/test_graphs.py"} <= set(marked)  # the scan sees both kinds of mark
    assert collected == {f: names for f, names in marked.items() if not f.startswith("tests/vllm/")}
    assert vllm.cmd[1:] == [*main.cmd[1:-1], "tests/vllm"] and any(f.startswith("tests/vllm/") for f in marked)


def test_a_step_out_of_time_is_reported_with_its_own_output_and_the_next_step_runs(monkeypatch, capsys):
    py = sys.executable
    monkeypatch.setattr(gpu_check, "steps", lambda _: [
        Step("cuda device", [py, "-c", "print('a device')"], 60),
        Step("slow", [py, "-c", "import time; print('begun', flush=True); time.sleep(60)"], 3),
        Step("after", [py, "-c", "print('ran after')"], 60),
    ])
    assert gpu_check.main(["--budget-s", "120"]) == 1
    table = capsys.readouterr().out.split("\ncheck ")[1].splitlines()
    assert [line.split()[:2] for line in table[1:]] == [["cuda", "device"], ["slow", "timeout"], ["after", "ok"]]
    assert table[2].endswith("begun") and table[3].endswith("ran after")
