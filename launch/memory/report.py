"""`python -m launch.memory --config C [--model-config PATH] [--ranks N] [overrides]`: does the run fit its devices?

Prints launch.memory.plan's plan as a table per rank role (each part's bytes, the phase that holds
it, the formula) and the node's host memory, and exits 1 when a role does not fit, naming the part
and the knob that would make it fit. It reads only the model's config.json, never the weights: on a
cluster's login node it runs before the download, with `--model-config` naming a config.json (the
reference architectures' are in launch/model_configs/, e.g. qwen2.5-7b-instruct.json) when
model.path is not set yet.

The device: a GPU of `cluster.gpu_memory_gb` GiB when the run's actor or engine is on cuda; else
this machine's memory, shared by the `--ranks` CPU ranks of a local run (torchrun
--nproc-per-node), each holding the runtime's measured baseline (`--runtime-mb`) besides its tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from engine.model_config import ModelConfig
from common.config import load_config, override_args
from launch.memory.actor import PHASES, GiB
from launch.memory.plan import CPU_MARGIN, CpuFacts, Device, MemoryPlan, RoleMemory, plan
from launch.run.config import TrainConfig

MODEL_CONFIGS = Path(__file__).resolve().parents[1] / "model_configs"  # launch/model_configs
# A CPU rank's resident memory after its imports (torch, transformers, the project, the CPU kernels) and
# before it builds anything: `python -m bench.memory --baseline` measures it (docs/BENCHMARKS.md).
CPU_RUNTIME_MB = 375


def model_config(cfg: TrainConfig, given: str | None) -> ModelConfig:
    """The model's shape from `given` (a config.json or a folder holding one) or model.path's config.json."""
    source = Path(given) if given else Path(cfg.model.path)
    path = source / "config.json" if source.is_dir() else source
    if not path.is_file():
        shipped = ", ".join(sorted(p.name for p in MODEL_CONFIGS.glob("*.json")))
        where = f"--model-config {given}" if given else f"model.path={cfg.model.path}"
        raise FileNotFoundError(f"{where}: no config.json there; the planner needs only the model's config.json: "
                                f"pass --model-config PATH (shipped: launch/model_configs/{{{shipped}}})")
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError, KeyError) as e:
        raise ValueError(f"{path} is not a model's config.json ({e}): expected a Hugging Face config with hidden_size, "
                         "num_hidden_layers, num_attention_heads, intermediate_size and vocab_size") from e


def on_gpu(cfg: TrainConfig) -> bool:
    return cfg.cluster.gpus_per_node > 0 or "cuda" in (cfg.actor.device.split(":")[0], cfg.engine.device.split(":")[0])


def cpu_facts(runtime_mb: float) -> CpuFacts:
    """This machine's: the runtime baseline given, and the CPU kernels' panel width where they serve."""
    from engine.kernels.library import available, library

    tile = library().skinny_tile_n() if available()[0] else None
    return CpuFacts(runtime_bytes=int(runtime_mb * 2**20), tile_n=tile)


def plan_for(cfg: TrainConfig, model: ModelConfig, *, ranks: int | None = None,
             runtime_mb: float = CPU_RUNTIME_MB) -> MemoryPlan:
    """The plan on the run's devices: cluster.world_size GPUs of cluster.gpu_memory_gb, or this machine's
    memory shared by `ranks` CPU ranks (default: cluster.world_size)."""
    world = ranks or cfg.cluster.world_size
    if on_gpu(cfg):
        return plan(cfg, model, world=world, device=Device("gpu", int(cfg.cluster.gpu_memory_gb * GiB)))
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return plan(cfg, model, world=world, device=Device("cpu", machine, margin=CPU_MARGIN), cpu=cpu_facts(runtime_mb))


def _role_table(r: RoleMemory, usable: int) -> list[str]:
    width = max(len(p.name) for p in r.parts)
    lines = [f"{r.role} rank ({r.ranks} in the job):", f"  {'part':<{width}}  {'when':<14}  {'GiB':>7}  how"]
    for p in r.parts:
        lines.append(f"  {p.name:<{width}}  {p.when:<14}  {p.bytes / GiB:7.2f}  {p.how}")
    phases = ", ".join(f"{x} {r.total(x) / GiB:.2f}" for x in PHASES)
    mark = "fits" if r.peak <= usable else "DOES NOT FIT"
    lines.append(f"  by phase (GiB): {phases}; peak {r.peak / GiB:.2f} ({r.peak_phase}) of {usable / GiB:.2f} usable: {mark}")
    return lines


def render(p: MemoryPlan, title: str) -> str:
    d = p.device
    if d.kind == "gpu":
        head = f"{title}: one GPU of {d.bytes / GiB:.0f} GiB, {d.usable / GiB:.1f} GiB usable ({d.margin:.0%} held back)"
        usable = d.usable
    else:
        head = (f"{title}: CPU ranks, the device is the process; {p.shared_by} rank(s) share "
                f"{d.bytes / GiB:.1f} GiB ({d.usable / GiB:.1f} usable, {d.margin:.0%} held back for glibc's heap)")
        usable = d.usable // max(1, p.shared_by)
    lines = [head]
    for r in p.roles:
        lines += _role_table(r, usable)
    if p.host:
        total = sum(x.bytes for x in p.host)
        cap = f" of cluster.mem {p.host_capacity / GiB:.0f} GiB" if p.host_capacity else ""
        lines.append(f"host memory per node: {total / GiB:.2f} GiB{cap}")
        lines += [f"  {x.name}: {x.bytes / GiB:.2f} GiB ({x.how})" for x in p.host]
    lines += [f"note: {n}" for n in p.notes if not n.startswith("does not fit")]
    fails = p.failures()
    lines += [f"DOES NOT FIT: {f}" for f in fails] or ["fits"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    overrides, rest = override_args(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m launch.memory", description=__doc__.splitlines()[0],
                                 epilog="Any section.key=value argument overrides the config file.")
    ap.add_argument("--config", required=True)
    ap.add_argument("--model-config", help="a config.json (or a folder with one) instead of model.path's")
    ap.add_argument("--ranks", type=int, help="ranks of the job (default: cluster.nodes x the ranks per node)")
    ap.add_argument("--runtime-mb", type=float, default=CPU_RUNTIME_MB, help="a CPU rank's baseline resident memory")
    args = ap.parse_args(rest)
    if args.ranks is not None and args.ranks < 1:
        print(f"error: --ranks must be >= 1, got {args.ranks}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(TrainConfig, args.config, overrides)
        model = model_config(cfg, args.model_config)
        p = plan_for(cfg, model, ranks=args.ranks, runtime_mb=args.runtime_mb)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(render(p, f"memory plan for {args.config}"), flush=True)
    return 1 if p.failures() else 0

