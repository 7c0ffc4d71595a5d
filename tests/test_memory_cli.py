"""`python -m launch.memory` and the preflight's memory check on the shipped cluster configs: they fit
their GPUs, and a config that does not is refused naming the part and the knob."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from launch.memory import report as memory
from common.config import load_config
from launch.slurm.preflight import submit_checks
from launch.run.config import TrainConfig
from tests.conftest import REPO

Q7 = str(REPO / "launch/model_configs/qwen2.5-7b-instruct.json")
Q32 = str(REPO / "launch/model_configs/qwen2.5-32b-instruct.json")


def test_the_7b_config_fits_80_gb_gpus_as_a_command():
    proc = subprocess.run([sys.executable, "-m", "launch.memory", "--config", "configs/7b.yaml", "--model-config", Q7],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "one GPU of 80 GiB" in proc.stdout and proc.stdout.rstrip().endswith("fits")


@pytest.mark.parametrize("config, model", [("32b.yaml", Q32), ("32b-h200.yaml", Q32)])
def test_the_32b_configs_fit_their_gpus(config, model, capsys):
    assert memory.main(["--config", str(REPO / "configs" / config), "--model-config", model]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" not in out
    gb = load_config(TrainConfig, REPO / "configs" / config).cluster.gpu_memory_gb
    assert f"one GPU of {gb:.0f} GiB" in out


def test_too_many_rows_are_refused_naming_the_kv_cache_and_its_knobs(capsys):
    assert memory.main(["--config", str(REPO / "configs/7b.yaml"), "--model-config", Q7, "engine.max_batch=64"]) == 1
    verdict = capsys.readouterr().out.split("DOES NOT FIT: ", 1)[1]
    assert "a colocated rank needs" in verdict and "engine KV cache" in verdict
    assert "engine.max_batch, engine.max_len" in verdict


def test_the_32b_colocated_on_80_gb_is_refused_naming_the_engines_weights_and_the_separated_placement(capsys):
    rc = memory.main(["--config", str(REPO / "configs/32b.yaml"), "--model-config", Q32, "pipeline.placement=colocated",
                      "pipeline.actor_ranks=0"])
    assert rc == 1
    verdict = capsys.readouterr().out.split("DOES NOT FIT: ", 1)[1]
    assert "engine weights 61.0 GiB" in verdict and "pipeline.placement=separated" in verdict


def test_a_model_length_past_the_models_positions_is_said_to_be_capped(capsys):
    memory.main(["--config", str(REPO / "configs/7b.yaml"), "--model-config", Q7, "engine.max_len=65536"])
    assert "engine.max_len=65536 is capped at the model's 32768 positions" in capsys.readouterr().out


def test_without_a_config_json_the_planner_names_the_flag_and_the_shipped_ones(capsys):
    assert memory.main(["--config", str(REPO / "configs/7b.yaml")]) == 1  # model.path is ??? in the shipped config
    err = capsys.readouterr().err
    assert "--model-config PATH" in err and "qwen2.5-7b-instruct.json" in err


def test_the_gpu_memory_key_is_validated_by_name():
    with pytest.raises(ValueError, match="cluster.gpu_memory_gb must be > 0"):
        load_config(TrainConfig, REPO / "configs/7b.yaml", ["cluster.gpu_memory_gb=0"])


def _model_folder(tmp_path, config_json: str):
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(config_json, folder / "config.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({}))
    return folder


@pytest.mark.parametrize("overrides, ok", [([], True), (["engine.max_batch=64"], False)])
def test_the_preflight_prints_the_plan_and_fails_a_config_that_does_not_fit(tmp_path, overrides, ok):
    folder = _model_folder(tmp_path, Q7)
    cfg = load_config(TrainConfig, REPO / "configs/7b.yaml",
                      [f"model.path={folder}", f"engine.spec.drafter_path={folder}", f"task.file={folder / 'config.json'}",
                       f"run.out_dir={tmp_path}", *overrides])
    check = next(c for c in submit_checks(cfg, REPO) if c.name == "memory")
    assert check.ok is ok and check.failed is not ok
    assert "memory plan: one GPU of 80 GiB" in check.table
    if not ok:
        assert "engine.max_batch, engine.max_len" in check.fix


def test_the_preflight_warns_when_there_is_no_config_json_to_size_by(tmp_path):
    cfg = load_config(TrainConfig, REPO / "configs/7b.yaml", [f"run.out_dir={tmp_path}"])
    check = next(c for c in submit_checks(cfg, REPO) if c.name == "memory")
    assert not check.ok and not check.failed  # a warning: the settings check already fails for model.path
    assert "--model-config launch/model_configs/" in check.fix


def test_a_dry_run_prints_the_memory_plan(tmp_path, capsys, monkeypatch):
    from launch.slurm import submit as slurm

    folder = _model_folder(tmp_path, Q7)
    monkeypatch.setenv("DRY_RUN", "1")
    rc = slurm.main(["--config", str(REPO / "configs/7b.yaml"), f"model.path={folder}", f"engine.spec.drafter_path={folder}",
                     f"task.file={folder / 'config.json'}", f"run.out_dir={tmp_path}"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "#          memory plan: one GPU of 80 GiB" in out and re.search(r"^#   ok   memory +peak ", out, re.M)


def test_vllms_share_beside_the_actor_is_refused_until_it_sleeps_through_the_update(capsys):
    args = ["--config", str(REPO / "configs/7b.yaml"), "--model-config", Q7, "engine.backend=vllm"]
    assert memory.main(args) == 1
    assert "engine.vllm.gpu_memory_utilization, engine.vllm.tensor_parallel_size" in capsys.readouterr().out
    assert memory.main([*args, "engine.vllm.sleep_level=1", "engine.vllm.gpu_memory_utilization=0.5"]) == 0
    out = capsys.readouterr().out
    assert "vLLM weights asleep (host)" in out and "freed while the actor trains" in out
    assert re.search(r"note: vLLM's KV cache: [\d.]+ GiB a GPU", out)


def test_a_spot_pool_member_is_planned_on_the_gpu_of_its_nodes_first_rollout_rank(capsys):
    assert memory.main(["--config", str(REPO / "configs/7b.yaml"), "--model-config", Q7, "pipeline.placement=separated",
                        "pipeline.actor_ranks=16", "spot.mode=pool", "spot.pool_dir=runs/pool"]) == 0
    out = capsys.readouterr().out
    member = out.split("rollout + pool member (the node's first GPU) rank (2 in the job):", 1)[1]
    assert re.search(r"pool: target weights \(float32\) +all +28\.37", member)  # spot.pool.elastic loads the target in float32
    assert "engine weights" in member  # beside the rollout rank's own engine
