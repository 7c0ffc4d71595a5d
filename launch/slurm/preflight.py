"""`python -m launch.slurm.preflight --config C [--in-job] [overrides]`: what is missing before a Slurm job runs.

Two moments, one table each:
- before submission (`launch.slurm` runs it on the login node): the required settings, `sbatch`,
  the model / drafter / dataset folders, the held-out file and the reward (loaded, and scoring a
  few rows of the data: launch.slurm.preflight_data), the interpreter, free disk for the checkpoints
  the run keeps (trainer.keep_checkpoints), W&B
  credentials or offline mode, that the config's devices and sizes fit cluster.*, and that every
  rank role fits its GPU's memory (launch.memory's plan from the model's config.json, printed under
  the line: a role that does not fit fails the preflight, naming the part and the knob);
- inside the job (`--in-job`, first step of the sbatch script, once per node): CUDA devices and
  NCCL where GPUs are asked for, the model readable and the run folder writable from the node.
A failed check names the key or thing and how to fix it; a warning does not stop the job.
"""

from __future__ import annotations

import argparse
import json
import netrc
import os
import shutil
import socket
import sys
from pathlib import Path

from common.config import load_config, missing_keys, override_args
from launch.run.config import TrainConfig
from launch.slurm.check import Check
from launch.slurm.preflight_data import data_checks
from spot.buffer.segment import node_name

GB = 1024**3


def _model_folder(path: str, what: str, key: str) -> Check:
    p = Path(path)
    if not (p / "config.json").is_file():
        return Check(what, False, f"{key}={path}: no config.json there",
                     f"set {key} to a Hugging Face folder (config.json, *.safetensors, tokenizer) on the shared file "
                     "system; TailSpec never downloads (fetch it once with `hf download` where there is network)")
    if key == "model.path" and not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return Check(what, False, f"{path} has no tokenizer", f"save the model's tokenizer into {path}")
    return Check(what, True, str(p.resolve()))


def weight_bytes(model: Path) -> int:
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in Path(model).glob(pattern))


def checkpoint_bytes(cfg: TrainConfig) -> int:
    """One checkpoint's size, estimated: weights in the actor's dtype plus AdamW's fp32 moments
    (and fp32 master weights under bf16), from the model folder's weight bytes."""
    stored = weight_bytes(Path(cfg.model.path))
    dtype = json.loads((Path(cfg.model.path) / "config.json").read_text()).get("torch_dtype", "float32")
    params = stored // (2 if dtype in ("bfloat16", "float16") else 4)
    per_param = 2 + 12 if cfg.actor.dtype == "bfloat16" else 4 + 8
    return params * per_param


def _disk(cfg: TrainConfig) -> Check:
    out = Path(cfg.run.out_dir)
    probe = next((p for p in (out, *out.resolve().parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free
    if cfg.cluster.min_free_disk_gb:
        need, how = cfg.cluster.min_free_disk_gb * GB, "cluster.min_free_disk_gb"
    elif (Path(cfg.model.path) / "config.json").is_file():
        kept, why = checkpoints_kept(cfg)
        need, how = kept * checkpoint_bytes(cfg), f"{kept} checkpoints of this model and optimizer: {why}"
    else:
        return Check("disk", True, f"{free / GB:.0f} GB free at {probe} (no model folder to size checkpoints by)", fatal=False)
    ok = free >= need
    return Check("disk", ok, f"{free / GB:.0f} GB free at {probe}, {need / GB:.0f} GB wanted ({how})",
                 "" if ok else "lower trainer.keep_checkpoints (or raise trainer.save_every), free space, point "
                               "run.out_dir at a larger file system, or set cluster.min_free_disk_gb")


def checkpoints_kept(cfg: TrainConfig) -> tuple[int, str]:
    """(the most checkpoints the run holds at once, why): trainer.keep_checkpoints K, the K latest and
    the best held-out one, each written before the oldest goes; with K = 0 every save of the run."""
    t = cfg.trainer
    saves = (t.steps // t.save_every if t.save_every else 0) + (not t.save_every or t.steps % t.save_every != 0)
    if t.keep_checkpoints and t.keep_checkpoints + 2 < saves:
        return t.keep_checkpoints + 2, (f"trainer.keep_checkpoints={t.keep_checkpoints}, + the best held-out, + the "
                                        "next one before the oldest is removed")
    return saves, (f"every one of the run's saves (trainer.save_every={t.save_every} over trainer.steps={t.steps}; "
                   f"trainer.keep_checkpoints={t.keep_checkpoints})")


def _wandb(cfg: TrainConfig) -> Check:
    mode = os.environ.get("WANDB_MODE") or cfg.metrics.wandb_mode
    if not cfg.metrics.wandb or mode in ("offline", "disabled", "dryrun"):
        return Check("wandb", True, f"mode {mode if cfg.metrics.wandb else 'disabled'} (no credentials needed; "
                     "`wandb sync runs/<run>/wandb/offline-run-*` uploads an offline run)")
    if os.environ.get("WANDB_API_KEY"):
        return Check("wandb", True, "online, WANDB_API_KEY set")
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return Check("wandb", True, "online, credentials in ~/.netrc (wandb login)")
    except (FileNotFoundError, netrc.NetrcParseError):
        pass
    return Check("wandb", False, f"metrics.wandb_mode={mode} but no W&B credentials",
                 "run `wandb login` on the login node, export WANDB_API_KEY, or set metrics.wandb_mode=offline")


def _devices(cfg: TrainConfig) -> Check:
    c, want = cfg.cluster, "cuda" if cfg.cluster.gpus_per_node else "cpu"
    wrong = [k for k, v in (("actor.device", cfg.actor.device), ("engine.device", cfg.engine.device))
             if v.split(":")[0] != want]
    if wrong:
        return Check("devices", False, f"cluster.gpus_per_node={c.gpus_per_node} but {', '.join(wrong)} is not {want}",
                     f"set {' '.join(f'{k}={want}' for k in wrong)}")
    model_parallel = cfg.actor.tensor_parallel * cfg.actor.pipeline_parallel
    if c.world_size % model_parallel:
        return Check("devices", False, f"{c.world_size} ranks do not split into actor.tensor_parallel x "
                     f"actor.pipeline_parallel = {model_parallel}", "make the world size a multiple of TP x PP")
    if cfg.trainer.prompts_per_step % c.world_size:
        return Check("devices", False, f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} is not divisible by "
                     f"the {c.world_size} ranks", "every rank rolls out as many prompts: change one or the other")
    return Check("devices", True, f"{c.nodes} node(s) x {c.ranks_per_node} rank(s) on {want}")


def submit_checks(cfg: TrainConfig, repo: Path) -> list[Check]:
    missing = missing_keys(cfg)
    checks = [Check("settings", not missing, ", ".join(missing) + " not set" if missing else "all required keys set",
                    " ".join(f"{k}=..." for k in missing) + " on the command line" if missing else "")]
    checks.append(Check("sbatch", shutil.which("sbatch") is not None, shutil.which("sbatch") or "not on PATH",
                        "submit from a Slurm login node (or `DRY_RUN=1` to only print the script)"))
    checks += _node_checks(cfg, missing)
    checks += data_checks(cfg, missing)
    py = Path(cfg.cluster.python)
    py = py if py.is_absolute() else repo / py
    checks.append(Check("python", os.access(py, os.X_OK), str(py),
                        "run `make setup` in the checkout on the shared file system, or set cluster.python"))
    checks += [_devices(cfg), _wandb(cfg)]
    if "model.path" not in missing:
        checks.append(_disk(cfg))
    checks.append(_memory(cfg, missing))
    return checks


def _memory(cfg: TrainConfig, missing: list[str]) -> Check:
    """The memory plan (launch.memory) from the model's config.json: every rank role must fit its device."""
    from engine.model_config import ModelConfig
    from launch.memory.report import MODEL_CONFIGS, on_gpu, plan_for, render
    from launch.memory.actor import GiB

    config = Path(cfg.model.path) / "config.json"
    if "model.path" in missing or not config.is_file():
        return Check("memory", False, "not sized: model.path has no config.json yet",
                     f"size it before the download: python -m launch.memory --config <this config> --model-config "
                     f"{MODEL_CONFIGS.relative_to(MODEL_CONFIGS.parent.parent)}/<model>.json", fatal=False)
    try:
        p = plan_for(cfg, ModelConfig.from_hf(json.loads(config.read_text())))
    except ValueError as e:
        return Check("memory", False, f"not sized: {e}", "python -m launch.memory --config <this config> says more",
                     fatal=False)
    fails = p.failures()
    worst = max(p.roles, key=lambda r: r.peak)
    where = f"GPU of {cfg.cluster.gpu_memory_gb:g} GiB" if on_gpu(cfg) else "CPU machine"
    detail = (f"peak {worst.peak / GiB:.1f} GiB ({worst.role} rank, {worst.peak_phase}) of {p.device.usable / GiB:.1f} "
              f"usable on a {where}")
    return Check("memory", not fails, detail, "; ".join(fails), table=render(p, "memory plan"))


def _node_checks(cfg: TrainConfig, missing: list[str]) -> list[Check]:
    """The files every node reads."""
    checks = []
    if "model.path" not in missing:
        checks.append(_model_folder(cfg.model.path, "model", "model.path"))
    spec = cfg.engine.spec
    if spec.enabled and spec.drafter_spec.learned is not None and "engine.spec.drafter_path" not in missing:
        checks.append(_model_folder(spec.drafter_path, "drafter", "engine.spec.drafter_path"))
    if cfg.task.file and "task.file" not in missing:
        ok = Path(cfg.task.file).is_file()
        checks.append(Check("dataset", ok, cfg.task.file if ok else f"task.file={cfg.task.file} does not exist",
                            "set task.file to a JSONL / parquet of problems (task.prompt_field / task.answer_field)"))
    return checks


def port_free(port: int) -> bool:
    """Whether this host can listen on `port` (on every address, as the rendezvous's store does). With
    SO_REUSEADDR, as the store binds: a requeued job's port whose last connections are in TIME_WAIT is
    free; one a process listens on is not."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _rdzv_port(port: int) -> Check:
    """On the first node: the rendezvous port is free. A port another process listens on makes
    torchrun's agents connect to that process and wait forever, so it is refused here."""
    free = port_free(port)
    return Check("rendezvous port", free, f"{port} free on {node_name()}" if free else
                 f"{port} is taken on {node_name()} (the first node), where the c10d rendezvous listens",
                 "another job or process listens there: set cluster.rdzv_port to another port (the job adds "
                 "SLURM_JOB_ID % 1000 to it)")


def job_checks(cfg: TrainConfig, rdzv_port: int | None = None) -> list[Check]:
    """A compute node's checks; `rdzv_port`: the job's rendezvous port, checked on the first node
    (SLURM_NODEID 0) only."""
    import torch
    import torch.distributed as dist

    c, host = cfg.cluster, node_name()
    checks = _node_checks(cfg, missing_keys(cfg))
    if rdzv_port is not None and os.environ.get("SLURM_NODEID", "0") == "0":
        checks.append(_rdzv_port(rdzv_port))
    if c.gpus_per_node:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        checks.append(Check("cuda", n >= c.ranks_per_node, f"{n} CUDA device(s) on {host} (CUDA_VISIBLE_DEVICES={visible}), "
                            f"{c.ranks_per_node} rank(s) here", "ask for GPUs (cluster.gpus_per_node) on a GPU partition; "
                            "check the CUDA build of torch with `python -c 'import torch; print(torch.version.cuda)'`"))
        nccl = dist.is_nccl_available() and n > 0
        version = ".".join(map(str, torch.cuda.nccl.version())) if nccl else "none"
        checks.append(Check("nccl", nccl, f"NCCL {version}", "install a CUDA build of torch (it ships NCCL)"))
    else:
        cores = len(os.sched_getaffinity(0))
        checks.append(Check("cpus", cores >= c.ranks_per_node, f"{cores} core(s) on {host} for {c.ranks_per_node} rank(s)",
                            "set cluster.cpus_per_task to at least cluster.procs_per_node", fatal=False))
    out = Path(cfg.run.out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        writable = os.access(out, os.W_OK)
    except OSError:
        writable = False
    checks.append(Check("run folder", writable, f"{out.resolve()} {'writable' if writable else 'not writable'} from {host}",
                        "run.out_dir must be on a file system every node shares and can write"))
    return checks


def report(checks: list[Check], title: str) -> str:
    width = max(len(c.name) for c in checks)
    lines = [title]
    for c in checks:
        mark = "ok  " if c.ok else ("FAIL" if c.fatal else "warn")
        lines.append(f"  {mark} {c.name:<{width}}  {c.detail}" + (f"\n         {'':<{width}}  fix: {c.fix}" if not c.ok and c.fix else ""))
        lines += [f"         {line}" for line in c.table.splitlines()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    overrides, rest = override_args(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m launch.slurm.preflight", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--in-job", action="store_true", help="the checks of a compute node, inside the Slurm job")
    p.add_argument("--rdzv-port", type=int, default=None,
                   help="with --in-job: the job's rendezvous port, checked free on the first node")
    args = p.parse_args(rest)
    try:
        cfg = load_config(TrainConfig, args.config, overrides)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    repo = Path.cwd()
    checks = job_checks(cfg, args.rdzv_port) if args.in_job else submit_checks(cfg, repo)
    print(report(checks, f"preflight ({'in the job, ' + node_name() if args.in_job else 'before submission'}):"),
          flush=True)
    return 1 if any(c.failed for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
