"""`python -m bench.memory [--configs tiny,smollm2] [--json]`: the memory planner against measured peaks.

For each config (tiny, SmolLM2), placement (colocated, separated: one actor rank, one rollout rank)
and micro-batch size (actor.micro_batch_tokens), runs two RL steps on 2 CPU ranks under torchrun
(the second step's update is the first with AdamW's moments allocated: the steady state the plan counts),
reads each rank's peak resident memory (pipeline.metrics.phase_peaks' over the run, written by the rank itself), and
prints it beside launch.memory's plan for that rank's role: planned / measured. The runtime
baseline the plan counts (a rank's interpreter after its imports) is measured first, in a fresh
process (`--baseline` prints only it), and is the same for every row.

Runs are made to exercise the update: the step's every row goes through the actor
(trainer.skip_zero_advantage=false: a random model's rewards are often all equal), one held-out
problem, no W&B or dashboard. The tiny config runs on folders of make pretrain-tiny's config.json
shape with random weights, made under --out, whose responses run to rollout.max_new_tokens: that
fills the micro-batches up to their budget (a trained model's end early). SmolLM2 needs `make models`.
Heavy (SmolLM2 runs take minutes and ~10 GB each): run it under `flock /tmp/tailspec-heavy.lock`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = REPO / "checkpoints/smollm2-135m-instruct"
TINY, TINY_DRAFTER = REPO / "checkpoints/tiny-reason", REPO / "checkpoints/tiny-reason-drafter"  # --device cuda
BUDGETS = {"tiny": [1024, 4096, 16384], "smollm2": [512, 1024, 1536]}
RUN = ["trainer.steps=2", "trainer.eval_every=0", "trainer.save_every=0", "task.eval_problems=1",
       "trainer.skip_zero_advantage=false", "metrics.wandb=false", "metrics.console=false", "metrics.dashboard=false"]
SEPARATED = ["pipeline.placement=separated", "pipeline.actor_ranks=1", "trainer.train_shares=shard", "bubble.enabled=false"]
OVERRIDES = {"colocated": [], "separated": SEPARATED}  # by --placements name
# glibc's malloc as it comes, and with a fixed mmap threshold: every freed block over 64 KiB goes back to
# the OS at once, so the resident peak is the live tensors' (the plan's count) without the heap's holes.
# The default's dynamic threshold rises to 32 MiB, keeping freed activations of up to that size in the
# heap, where later allocations only partly reuse them.
ALLOCATORS = {"glibc": {}, "mmap64k": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
# What a rank imports and loads before it builds anything: the run, both actor backends' modules, the
# decoder classes transformers builds, and the CPU kernels' library.
BASELINE = """
import launch.train, launch.run.separated, pipeline.actors.torch_actor
from transformers import LlamaForCausalLM, Qwen2ForCausalLM
from engine.kernels.library import available
available()
for line in open("/proc/self/status"):
    if line.startswith("VmRSS:"):
        print(int(line.split()[1]) * 1024)
"""


def baseline_bytes() -> int:
    """A fresh rank's resident memory after its imports (BASELINE), in a process of its own."""
    out = subprocess.run([sys.executable, "-c", BASELINE], capture_output=True, text=True, cwd=REPO, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def tiny_folders(out: Path) -> tuple[Path, Path, str]:
    """The tiny config's model and drafter for the measurement: random weights in make pretrain-tiny's
    shape (the trained model's responses end early and would leave the larger micro-batches half full)."""
    import torch
    from safetensors.torch import load_file, save_file

    model, drafter = out / "tiny-reason-shape", out / "tiny-reason-shape-drafter"
    if not (model / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "pipeline.pretrain", "--out", str(model), "--task", "mult",
                        "--max-position-embeddings", "1024", "--steps", "1", "--eval-problems", "1",
                        "--eval-max-new-tokens", "8"], cwd=REPO, check=True, capture_output=True)
        # The end-of-sequence row of the (tied) embedding zeroed and the final norm's scale raised: its
        # logit is 0 where the others spread over tens, so responses run to rollout.max_new_tokens and the
        # update's micro-batches fill up to their token budget, as a long-tailed step's do.
        eos = json.loads((model / "config.json").read_text())["eos_token_id"]
        state = load_file(model / "model.safetensors")
        with torch.no_grad():
            state["model.norm.weight"].mul_(20.0)
            state["model.embed_tokens.weight"][eos] = 0.0
        save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    if not (drafter / "config.json").is_file():
        from engine.checkpoint import load_checkpoint
        from engine.spec.eagle import EagleConfig, EagleModel

        target = load_checkpoint(model)
        torch.manual_seed(0)
        EagleModel(EagleConfig.for_target(target.config), target).save(drafter)
    return model, drafter, "random weights in make pretrain-tiny's shape, responses to max_new_tokens"


def cases(configs: list[str], placements: list[str], out: Path) -> list[dict]:
    """Every (config, placement, micro-batch) to measure, with its overrides."""
    rows = []
    for name in configs:
        if name == "tiny":
            model, drafter, what = tiny_folders(out)
            base = ["configs/tiny.yaml", f"model.path={model}", f"engine.spec.drafter_path={drafter}"]
        elif name == "smollm2":
            if not (SMOLLM2 / "config.json").is_file():
                raise FileNotFoundError(f"{SMOLLM2} is missing: run `make models` first")
            base, what = ["configs/smollm2.yaml"], "checkpoints/smollm2-135m-instruct"
        else:
            raise ValueError(f"--configs: unknown config {name!r} (tiny, smollm2)")
        for placement in placements:
            if placement not in OVERRIDES:
                raise ValueError(f"--placements: unknown placement {placement!r} ({', '.join(OVERRIDES)})")
            for budget in BUDGETS[name]:
                extra = [*RUN, f"actor.micro_batch_tokens={budget}", *OVERRIDES[placement]]
                rows.append({"config": name, "model": what, "placement": placement, "micro_batch_tokens": budget,
                             "path": base[0], "overrides": [*base[1:], *extra]})
    return rows


def measure(case: dict, out: Path, timeout_s: float, malloc: str, *, ranks: int = 2, key: str = "max_rss") -> dict[int, int]:
    """Runs the case on `ranks` ranks under glibc's `malloc` setting (ALLOCATORS); -> {rank: its peak},
    the peak resident bytes or (key cuda_max_allocated) torch.cuda.max_memory_allocated."""
    folder = Path(tempfile.mkdtemp(prefix=f"{case['config']}-{case['placement']}-", dir=out))
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc-per-node={ranks}", "-m", "bench.memory",
           "--rank-run", str(folder), "--config", case["path"], f"run.out_dir={folder}", *case["overrides"]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled",
           **ALLOCATORS[malloc]}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {int(p.stem[4:]): json.loads(p.read_text())[key] for p in folder.glob("peak*.json")}


def planned(case: dict, runtime: int, ranks: int = 2) -> dict[str, int]:
    """Role -> the plan's peak bytes for this case's config on `ranks` ranks (CPU, or its GPU's)."""
    from common.config import load_config
    from launch.memory.report import model_config, plan_for
    from launch.run.config import TrainConfig

    cfg = load_config(TrainConfig, REPO / case["path"], case["overrides"])
    p = plan_for(cfg, model_config(cfg, None), ranks=ranks, runtime_mb=runtime / 2**20)
    return {r.role: r.peak for r in p.roles}


def gpu_cases(model: Path | None) -> list[dict]:
    """The tiny config on one GPU (colocated, 1 rank) at two micro-batch sizes: make train's model and
    drafter, or `model` (a Hugging Face folder) drafting with n-grams."""
    if model is None:
        if not (TINY / "config.json").is_file() or not (TINY_DRAFTER / "config.json").is_file():
            raise FileNotFoundError(f"{TINY} and {TINY_DRAFTER} are missing: run `make train` first or pass --model")
        base, what = [f"model.path={TINY}", f"engine.spec.drafter_path={TINY_DRAFTER}"], "checkpoints/tiny-reason"
    else:
        base, what = [f"model.path={model}", "engine.spec.drafter=ngram", "engine.spec.max_active_batch=null"], str(model)
    on_gpu = ["engine.device=cuda", "actor.device=cuda", "spot.enabled=false", "bubble.enabled=false",
              "rollout.split_groups=false"]
    return [{"config": "tiny", "model": what, "placement": "colocated", "micro_batch_tokens": budget,
             "path": "configs/tiny.yaml", "overrides": [*base, *RUN, *on_gpu, f"actor.micro_batch_tokens={budget}"]}
            for budget in (1024, 4096)]


def gpu_main(args, out: Path) -> int:
    """Planned against torch.cuda.max_memory_allocated on one GPU (bench/gpu_check.sh's step)."""
    import torch

    from launch.memory.actor import GiB

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to compare (bench/gpu_check.sh runs this step where a GPU is lent)")
        return 1
    rows = []
    print(f"{torch.cuda.get_device_name(0)}; planned vs torch.cuda.max_memory_allocated, colocated, 1 rank")
    for case in gpu_cases(args.model):
        got = measure(case, out, args.timeout_s, "glibc", ranks=1, key="cuda_max_allocated")[0]
        want = planned(case, 0, ranks=1)["colocated"]
        rows.append({"micro_batch_tokens": case["micro_batch_tokens"], "planned_gib": round(want / GiB, 3),
                     "measured_gib": round(got / GiB, 3), "ratio": round(want / got, 3)})
        print(f"  micro {case['micro_batch_tokens']:>6}: planned {want / GiB:.3f} GiB, measured {got / GiB:.3f} GiB, "
              f"ratio {want / got:.2f}", flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows,
                      "worst": round(max(abs(r["ratio"] - 1) for r in rows), 3)}))
    return 0


def rank_run(folder: Path, argv: list[str]) -> int:
    """One rank of a measured run: launch.train, then its peak resident memory into folder/peak<rank>.json."""
    from launch.train import main

    import torch

    rc = main(argv)
    rank = int(os.environ.get("RANK", "0"))
    from pipeline.metrics.phase_peaks import peak_bytes

    peak = {"rank": rank, "max_rss": peak_bytes()}  # over every phase (the loop resets the kernel's mark per phase)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    (folder / f"peak{rank}.json").write_text(json.dumps(peak))
    return rc


def main(argv: list[str] | None = None) -> int:
    from common.config import override_args

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-run"]:
        return rank_run(Path(argv[1]), argv[2:])
    overrides, rest = override_args(argv)
    ap = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny,smollm2")
    ap.add_argument("--placements", default="colocated,separated")
    ap.add_argument("--malloc", default="mmap64k,glibc", help="glibc settings to measure under (ALLOCATORS)")
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="per run")
    ap.add_argument("--baseline", action="store_true", help="print the runtime baseline only")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: the tiny config on one GPU against torch.cuda.max_memory_allocated")
    ap.add_argument("--model", type=Path, default=None, help="--device cuda: a model folder instead of make train's")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(rest)
    if overrides:
        ap.error(f"bench.memory takes no config overrides (got {overrides[0]}): it measures the shipped configs")
    mallocs = args.malloc.split(",")
    if bad := [m for m in mallocs if m not in ALLOCATORS]:
        ap.error(f"--malloc: unknown {bad[0]!r} (known: {', '.join(ALLOCATORS)})")
    from bench.common import cpu_model
    from launch.memory.actor import GiB

    out = args.out or Path(tempfile.mkdtemp(prefix="tailspec-bench-memory-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        return gpu_main(args, out)
    runtime = baseline_bytes()
    print(f"{cpu_model()}; runtime baseline (a rank after its imports): {runtime / 2**20:.0f} MiB", flush=True)
    if args.baseline:
        return 0
    results = []
    heads = "".join(f" {m:>8} {'ratio':>6}" for m in mallocs)
    print(f"{'config':<8} {'placement':<10} {'micro':>6} {'rank':>4} {'role':<10} {'planned':>8}{heads}   (GiB)")
    for case in cases(args.configs.split(","), args.placements.split(","), out):
        peaks = {m: measure(case, out, args.timeout_s, m) for m in mallocs}
        plan = planned(case, runtime)
        for rank in sorted(peaks[mallocs[0]]):
            role = "colocated" if case["placement"] == "colocated" else ("actor" if rank == 0 else "rollout")
            want = plan[role]
            row = {**{k: case[k] for k in ("config", "model", "placement", "micro_batch_tokens")}, "rank": rank,
                   "role": role, "planned_gib": round(want / GiB, 3),
                   **{f"measured_gib_{m}": round(peaks[m][rank] / GiB, 3) for m in mallocs},
                   **{f"ratio_{m}": round(want / peaks[m][rank], 3) for m in mallocs}}
            results.append(row)
            cells = "".join(f" {row[f'measured_gib_{m}']:>8.2f} {row[f'ratio_{m}']:>6.2f}" for m in mallocs)
            print(f"{row['config']:<8} {row['placement']:<10} {row['micro_batch_tokens']:>6} {rank:>4} {role:<10} "
                  f"{row['planned_gib']:>8.2f}{cells}", flush=True)
    for m in mallocs:
        worst = max(abs(r[f"ratio_{m}"] - 1) for r in results)
        print(f"{m}: largest |planned / measured - 1| {worst:.1%} (issue 51 asks for 15%)")
    if args.json:
        print(json.dumps({"cpu": cpu_model(), "runtime_baseline_mib": runtime / 2**20, "rows": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
