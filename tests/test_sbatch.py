"""Slurm jobs without a Slurm: `DRY_RUN=1 make train-7b / train-32b` print valid sbatch scripts whose
torchrun and launch.train command lines parse to the config; the preflight names what is missing;
`???` settings and trainer.resume=auto behave as documented. (`make test-slurm` runs a real job.)"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common.config import load_config, missing_keys, override_args, to_dict
from launch.slurm.check import Check
from launch.slurm.preflight import checkpoint_bytes, report, submit_checks
from launch.run.config import TrainConfig
from launch.slurm.sbatch import ARGS_SEPARATOR
from launch.slurm.submit import render
from pipeline.checkpoint.state import latest_checkpoint

REPO = Path(__file__).resolve().parent.parent
# sbatch's long options the renderer may write (sbatch(1), Slurm 22.05+), with whether they take a value.
SBATCH_OPTIONS = {"job-name": True, "nodes": True, "ntasks-per-node": True, "gpus-per-node": True, "cpus-per-task": True,
                  "mem": True, "time": True, "partition": True, "account": True, "qos": True, "constraint": True,
                  "exclusive": False, "output": True, "open-mode": True, "requeue": False, "no-requeue": False,
                  "signal": True}
ENV = {"SLURM_JOB_ID": "1234", "SLURM_JOB_NUM_NODES": "4", "HEAD_NODE": "node001", "HEAD_ADDR": "10.0.0.1", "PORT": "29734",
       "RUN_DIR": "runs/x-1234", "PY": "python"}


def dry_run(target: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    proc = subprocess.run(["make", "-s", target, f"ARGS={' '.join(args)}"], cwd=REPO, env={**env, "DRY_RUN": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def directives(script: str) -> dict[str, str | None]:
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            m = re.fullmatch(r"#SBATCH --([a-z-]+)(?:=(.+))?", line)
            assert m, f"not a long sbatch option: {line!r}"
            name, value = m.groups()
            assert name in SBATCH_OPTIONS, f"unknown sbatch option --{name}"
            assert (value is not None) == SBATCH_OPTIONS[name], f"--{name}: value {value!r}"
            out[name] = value
    return out


def run_command(script: str) -> list[str]:
    """The torchrun srun line after the separator, continuations joined, variables substituted."""
    body = script.split(ARGS_SEPARATOR, 1)[1].replace("\\\n", " ").splitlines()[1]
    body = re.sub(r"\$\{?(\w+)\}?", lambda m: ENV[m.group(1)], body).rstrip(" &")
    return shlex.split(body)


@pytest.mark.parametrize("target,config,nodes", [("train-7b", "configs/7b.yaml", 4), ("train-32b", "configs/32b.yaml", 16)])
def test_dry_run_prints_a_valid_sbatch_script_whose_commands_parse_to_the_config(target, config, nodes, tmp_path):
    out = dry_run(target, "actor.lr=2e-6")
    script = out.split("# --- the resolved config")[0]
    syntax = subprocess.run(["bash", "-n"], input=out, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr  # the whole output, config and preflight included, is one bash file
    assert script.startswith("#!/bin/bash\n")
    d = directives(script)
    assert d["nodes"] == str(nodes) and d["ntasks-per-node"] == "1" and d["gpus-per-node"] == "8"
    assert re.fullmatch(r"(\d+-)?\d+:\d\d:\d\d", d["time"]) and "requeue" in d and d["signal"] == "B:USR1@600"
    assert d["output"].endswith("runs/slurm/%x-%j.out")

    cmd = run_command(script)
    srun_end = cmd.index("-m")  # srun [options] python -m torch.distributed.run ...
    assert cmd[0] == "srun" and "--kill-on-bad-exit=1" in cmd[:srun_end] and cmd[srun_end - 1] == "python"
    from torch.distributed.run import get_args_parser

    torchrun = get_args_parser().parse_args(cmd[srun_end + 2:])
    assert (torchrun.nnodes, torchrun.nproc_per_node, torchrun.rdzv_backend) == ("4", "8", "c10d")
    assert torchrun.rdzv_endpoint == "10.0.0.1:29734" and torchrun.rdzv_id == "1234" and torchrun.max_restarts == 0
    assert torchrun.module and torchrun.training_script == "launch.train"

    overrides, rest = override_args(torchrun.training_script_args)
    assert rest == ["--config", config]
    assert overrides[-2:] == ["run.dir=runs/x-1234", "trainer.resume=auto"]
    job_cfg = load_config(TrainConfig, REPO / config, overrides)
    assert job_cfg.actor.lr == 2e-6 and job_cfg.cluster.nodes == nodes and job_cfg.actor.zero_stage == 3
    assert job_cfg.cluster.world_size == nodes * 8 and job_cfg.trainer.prompts_per_step % job_cfg.cluster.world_size == 0

    printed = yaml.safe_load("\n".join(line[2:] for line in out.split("(DRY_RUN: nothing was submitted) ---\n")[1]
                                       .split("# preflight")[0].splitlines()))
    assert printed == to_dict(load_config(TrainConfig, REPO / config, ["actor.lr=2e-6"]))
    assert "# preflight (before submission):" in out and "model.path" in out.split("# preflight")[1]


def test_the_cluster_configs_leave_exactly_the_model_drafter_and_dataset_to_the_user():
    for config in ("configs/7b.yaml", "configs/32b.yaml"):
        cfg = load_config(TrainConfig, REPO / config)
        assert sorted(missing_keys(cfg)) == ["engine.spec.drafter_path", "model.path", "task.file"], config


def test_launch_train_refuses_a_config_with_unset_keys_and_names_them(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launch.train", "--config", "configs/7b.yaml"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "model.path" in proc.stderr and "task.file" in proc.stderr and "=..." in proc.stderr


def test_a_slurm_job_refuses_an_explicit_resume_checkpoint_and_says_to_use_run_dir():
    cfg = load_config(TrainConfig, REPO / "configs/tiny.yaml", ["trainer.resume=runs/x/checkpoints/step-3"])
    with pytest.raises(ValueError, match="run.dir"):
        render(cfg, "configs/tiny.yaml", [])


def test_a_cpu_job_has_no_gpu_option_and_pins_threads_per_rank():
    cfg = load_config(TrainConfig, REPO / "configs/tiny.yaml", ["cluster.procs_per_node=2", "cluster.cpus_per_task=8"])
    script = render(cfg, "configs/tiny.yaml", [])
    assert "gpus-per-node" not in directives(script) and "export OMP_NUM_THREADS=4" in script
    assert "--nproc-per-node=2" in script


@pytest.mark.parametrize("override,key", [("cluster.time=tomorrow", "cluster.time"), ("cluster.nodes=0", "cluster.nodes"),
                                          ("cluster.env=[NCCL]", "cluster.env"), ("cluster.sbatch_args=[-p]", "cluster.sbatch_args"),
                                          ("cluster.rdzv_port=80", "cluster.rdzv_port")])
def test_cluster_settings_errors_name_the_key(override, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        load_config(TrainConfig, REPO / "configs/tiny.yaml", [override])


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_preflight_names_missing_folders_credentials_and_device_mismatches(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    cfg = load_config(TrainConfig, REPO / "configs/7b.yaml", [f"model.path={tmp_path / 'nope'}", f"task.file={tmp_path / 'x.jsonl'}",
                                                              f"engine.spec.drafter_path={tmp_path}", "engine.device=cpu",
                                                              "metrics.wandb_mode=online"])
    checks = by_name(submit_checks(cfg, REPO))
    assert checks["settings"].ok
    assert checks["model"].failed and "no config.json" in checks["model"].detail and "never downloads" in checks["model"].fix
    assert checks["dataset"].failed and checks["drafter"].failed
    assert checks["wandb"].failed and "wandb login" in checks["wandb"].fix
    assert checks["devices"].failed and "engine.device=cuda" in checks["devices"].fix
    assert "FAIL" in report(list(checks.values()), "t")

    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert by_name(submit_checks(cfg, REPO))["wandb"].ok
    offline = load_config(TrainConfig, REPO / "configs/7b.yaml", ["metrics.wandb_mode=offline"])
    assert by_name(submit_checks(offline, REPO))["settings"].failed  # the ??? keys, named
    monkeypatch.delenv("WANDB_API_KEY")
    assert by_name(submit_checks(offline, REPO))["wandb"].ok


def test_preflight_sizes_the_checkpoint_disk_from_the_model(char_model_dir, tmp_path):
    cfg = load_config(TrainConfig, REPO / "configs/tiny.yaml", [f"model.path={char_model_dir}", f"run.out_dir={tmp_path}"])
    weights = sum(f.stat().st_size for f in Path(char_model_dir).glob("*.safetensors"))
    assert checkpoint_bytes(cfg) == weights // 4 * 12  # fp32 weights + two fp32 AdamW moments
    assert by_name(submit_checks(cfg, REPO))["disk"].ok
    huge = load_config(TrainConfig, REPO / "configs/tiny.yaml", [f"model.path={char_model_dir}", f"run.out_dir={tmp_path}",
                                                                  "cluster.min_free_disk_gb=1e9"])
    assert by_name(submit_checks(huge, REPO))["disk"].failed


def test_resume_auto_takes_the_latest_complete_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for step, complete in ((2, True), (10, True), (12, False)):
        folder = tmp_path / "checkpoints" / f"step-{step}"
        folder.mkdir(parents=True)
        if complete:
            (folder / "state.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-10"  # step-12 has no state.json: incomplete
    with pytest.raises(ValueError, match="run.dir"):
        load_config(TrainConfig, REPO / "configs/tiny.yaml", ["trainer.resume=auto"])


def test_a_separated_placement_renders_one_torchrun_whose_config_gives_the_roles_by_node():
    overrides = ["pipeline.placement=separated", "pipeline.actor_ranks=12"]  # the 7B config's DeepSpeed ZeRO-3 actor
    cfg = load_config(TrainConfig, REPO / "configs/7b.yaml", overrides)
    assert (cfg.actor.backend, cfg.actor.zero_stage) == ("deepspeed", 3)
    script = render(cfg, "configs/7b.yaml", overrides)
    assert script.count("-m torch.distributed.run") == 1 and script.count("#SBATCH --nodes=4") == 1
    assert "# placement: separated: ranks 0-11 train (pipeline.actor_ranks=12), ranks 12-31 roll out (20 ranks)" in script
    assert [line for line in script.splitlines() if line.startswith("#   node")] == [
        "#   node 0: ranks 0-7 train", "#   node 1: ranks 8-11 train, ranks 12-15 roll out",
        "#   node 2: ranks 16-23 roll out", "#   node 3: ranks 24-31 roll out"]
    from torch.distributed.run import get_args_parser

    cmd = run_command(script)
    torchrun = get_args_parser().parse_args(cmd[cmd.index("-m") + 2:])
    job_overrides, _ = override_args(torchrun.training_script_args)
    job_cfg = load_config(TrainConfig, REPO / "configs/7b.yaml", job_overrides)
    world = int(torchrun.nnodes) * int(torchrun.nproc_per_node)
    assert job_cfg.pipeline.roles(world) == (12, 20)


def test_a_colocated_placement_says_every_rank_rolls_out_and_trains():
    cfg = load_config(TrainConfig, REPO / "configs/7b.yaml")
    script = render(cfg, "configs/7b.yaml", [])
    assert "# placement: colocated: all 32 ranks roll out, then train" in script and "#   node" not in script


def test_a_separated_job_without_a_rollout_rank_is_refused_naming_the_key():
    overrides = ["pipeline.placement=separated", "pipeline.actor_ranks=32"]
    cfg = load_config(TrainConfig, REPO / "configs/7b.yaml", overrides)
    with pytest.raises(ValueError, match=r"pipeline.actor_ranks=32 leaves no rollout rank"):
        render(cfg, "configs/7b.yaml", overrides)


def test_a_separated_job_with_an_elastic_pool_starts_one_pool_agent_per_rollout_node():
    overrides = ["pipeline.placement=separated", "pipeline.actor_ranks=12", "actor.backend=torch", "engine.backend=native",
                 "spot.mode=pool", "spot.pool_dir=runs/pool", "engine.spec.drafter_path=/shared/drafter",
                 "model.path=/shared/model"]
    cfg = load_config(TrainConfig, REPO / "configs/7b.yaml", overrides)
    out = dry_run("train-7b", *overrides)
    syntax = subprocess.run(["bash", "-n"], input=out, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr
    script = render(cfg, "configs/7b.yaml", overrides)
    assert script.strip() == out.split("# --- the resolved config")[0].strip()  # what make prints
    # the run's torchrun names the node buffer the pool attaches to
    run = run_command(script.replace('"$POOL_BUFFER"', "tailspec-1234"))
    assert run[-1] == "spot.buffer_name=tailspec-1234"
    assert 'POOL_BUFFER=tailspec-"$SLURM_JOB_ID"' in script
    # node 1 has rollout ranks 12-15 as well: the pool's agents are on nodes 1-3, one member each
    assert 'POOL_NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tail -n +2 | paste -sd, -)' in script
    assert 'POOL_ADDR=$(node_addr "$SLURMD_NODENAME")' in script  # the batch host, which holds the pool's store
    store, pool = script.split("STEP=$!\n", 1)[1].split("POOL=$!")[0].split("POOL_STORE=$!\n")
    assert store == '"$PY" -m launch.pool_job store --port $(( PORT + 1 )) &\n'
    env = {**ENV, "POOL_NODES": "node002,node003,node004", "POOL_ADDR": "10.0.0.1", "POOL_BUFFER": "tailspec-1234",
           "POOL_DIR": "runs/pool"}
    body = re.sub(r"\$\(\( PORT \+ 1 \)\)", str(int(ENV["PORT"]) + 1), pool.replace("\\\n", " "))
    cmd = shlex.split(re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], body).strip().rstrip(" &"))
    assert cmd[:2] == ["srun", "--overlap"] and "--nodes=3" in cmd and "--nodelist=node002,node003,node004" in cmd
    env_at = cmd.index("env")  # each node's agent under launch.pool_job, which starts it again when a signal kills it
    assert cmd[env_at - 7:env_at] == ["python", "-m", "launch.pool_job", "agent", "--stop", "runs/pool/STOP", "--"]
    assert cmd[env_at + 1] == "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" and cmd[env_at + 2:env_at + 4] == ["python", "-m"]
    from torch.distributed.run import get_args_parser

    torchrun = get_args_parser().parse_args(cmd[env_at + 4 + 1:])
    assert (torchrun.nnodes, torchrun.nproc_per_node, torchrun.rdzv_backend) == ("1:3", "1", "c10d")
    assert torchrun.rdzv_endpoint == "10.0.0.1:29735" and torchrun.rdzv_id == "1234-pool"
    assert torchrun.rdzv_conf == "is_host=false"  # no agent hosts the store: any of them may die
    assert torchrun.training_script == "launch.spot_pool"
    from launch.spot_pool import parse

    pool_cfg, _ = parse(torchrun.training_script_args)
    assert (pool_cfg.target, pool_cfg.drafter, pool_cfg.buffer, pool_cfg.out, pool_cfg.device) == (
        "/shared/model", "/shared/drafter", "tailspec-1234", "runs/pool", "cuda")
    assert (pool_cfg.lr, pool_cfg.rows_per_step, pool_cfg.window) == (cfg.spot.lr, cfg.spot.rows_per_step, cfg.spot.window)
    assert pool_cfg.buffer_wait_s == cfg.pipeline.timeout_s
    tail = script.split("the run exited with status $rc\"\n", 1)[1]
    assert tail.startswith('touch "$POOL_DIR/STOP"') and tail.rstrip().endswith('exit "$rc"')
    assert tail.index('wait "$POOL"') < tail.index('kill "$POOL_STORE"')  # the store outlives every agent
    assert 'rm -f "$POOL_DIR/STOP"' in script.split("STEP=$!")[0]  # a requeued job's pool runs again
    colocated = render(load_config(TrainConfig, REPO / "configs/7b.yaml"), "configs/7b.yaml", [])
    assert "launch.spot_pool" not in colocated and "POOL" not in colocated
