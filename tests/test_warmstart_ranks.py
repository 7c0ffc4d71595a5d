"""The warm start over torchrun's ranks is the 1-rank warm start: the step over segments spread
across ranks is the step over the windows, and 2 ranks write the 1-rank drafter (float32 tolerance)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from engine.checkpoint import load_checkpoint
from engine.spec.eagle import EagleConfig, EagleModel
from spot.training.step import batch_loss, chain_expectation
from spot.training.features import TokenSequence, capture_features
from spot.training.pairs import PackedPairs
from spot.warmstart.ranks import Ranks, rank_device, shard
from tests.conftest import REPO


def test_chain_expectation_multiplies_acceptances_along_a_segment_and_stops_at_its_end():
    p = torch.tensor([[0.5, 0.5, 0.5, 0.8, 0.9, 0.0]])
    seg = torch.tensor([[0, 0, 0, 1, 1, -1]])
    got = chain_expectation(p, seg, depth=2)
    # pair 0: .5 + .5 * .5; pair 2: its segment ends after it; pair 3: .8 + .8 * .9; pair 5: padding
    assert got[0].tolist() == pytest.approx([0.75, 0.75, 0.5, 0.8 + 0.72, 0.9, 0.0])
    assert chain_expectation(torch.ones(1, 4), torch.zeros(1, 4, dtype=torch.long), depth=6).tolist() == [[4, 3, 2, 1]]


def test_a_step_over_segments_split_between_ranks_is_the_step_over_the_windows(char_model_dir):
    """What ShardedPairs computes, without the collectives: each 'rank' repacks its segments of the
    step's windows; the pair-weighted sum of their gradients is the windows' mean gradient."""
    target = load_checkpoint(char_model_dir)
    g = torch.Generator().manual_seed(0)
    seqs = [TokenSequence(f"p{i}", 0, torch.randint(3, 20, (5 + 3 * i,), generator=g).tolist(), 3) for i in range(8)]
    rows = capture_features(target, seqs)
    packed = PackedPairs(rows, 16)
    assert len(packed) >= 3
    idx = torch.tensor([2, 0])
    torch.manual_seed(0)
    model = EagleModel(EagleConfig.for_target(target.config), target)

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    whole = grads(batch_loss(model, packed, idx, 0.1)[0])
    segs = [packed.segments[i] for w in idx.tolist() for i in packed.bins[w]]
    total = int(packed.loss[idx].sum())
    summed = [torch.zeros_like(p) for p in model.parameters()]
    for part in (segs[0::2], segs[1::2]):  # rank 0's and rank 1's share of the segments
        view = packed.repacked(part)
        loss, _, pred, _ = batch_loss(model, view, torch.arange(len(view)), 0.1)
        for s, g_ in zip(summed, grads(loss * pred.shape[0]), strict=True):
            s += g_
    assert sum(int(packed.repacked(p).loss.sum()) for p in (segs[0::2], segs[1::2])) == total
    for a, b in zip(whole, summed, strict=True):
        torch.testing.assert_close(b / total, a, rtol=1e-4, atol=1e-6)


def test_ranks_need_a_prompt_each_and_a_plain_cuda_device():
    r = Ranks(rank=1, world=3, local_rank=1)
    assert [p["id"] for p in shard([{"id": i} for i in range(7)], r)] == [1, 4]
    with pytest.raises(ValueError, match="2 prompts for 3 ranks"):
        shard([{"id": 0}, {"id": 1}], r)
    assert rank_device("cuda", r) == "cuda:1" and rank_device("cpu", r) == "cpu"
    with pytest.raises(ValueError, match="pass --device cuda"):
        rank_device("cuda:0", r)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ARGS = ["--samples", "2", "--max-new-tokens", "24", "--steps", "30", "--window", "64", "--batch-windows", "3",
        "--holdout", "0.2", "--threads", "1", "--log-every", "10"]


def run(procs: int, model_dir, prompts, out, extra=()) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}", "--master-addr=127.0.0.1",
                 f"--master-port={free_port()}"] if procs > 1 else [sys.executable])
    cmd = [*launcher, "-m", "spot.warmstart", "--target", str(model_dir), "--prompts", str(prompts), "--out", str(out),
           *ARGS, *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_warm_start_on_two_ranks_writes_the_one_rank_drafter(char_model_dir, tmp_path, kind):
    prompts = tmp_path / "p.jsonl"  # 13 prompts: rank 0 generates 7, rank 1 6
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"{i * 37 % 900}+{i * 53 % 97}\n"}) + "\n" for i in range(13)))
    one = run(1, char_model_dir, prompts, tmp_path / "one", ["--kind", kind])
    two = run(2, char_model_dir, prompts, tmp_path / "two", ["--kind", kind])
    a, b = (json.loads((tmp_path / d / "warmstart_summary.json").read_text()) for d in ("one", "two"))
    assert (a["ranks"], b["ranks"]) == (1, 2)
    for key in ("sequences", "tokens", "response_tokens", "train_sequences", "heldout_sequences", "train_pairs",
                "draft_vocab_size", "steps"):
        assert a[key] == b[key], key  # the same data: the same tokens generated, split and packed alike
    for key in ("train_loss_start", "train_loss_end"):
        assert b[key] == pytest.approx(a[key], abs=2e-4), key
    for when in ("heldout_before", "heldout"):
        assert b[when]["pairs"] == a[when]["pairs"]
        for key, value in a[when].items():
            assert b[when][key] == pytest.approx(value, abs=2e-4), (when, key)
    wa, wb = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("one", "two"))
    assert set(wa) == set(wb)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=k)
    assert a["heldout"]["loss"] < a["heldout_before"]["loss"]  # it trained: the equality is not of untouched weights
    assert "expected accept length" in one.stdout and "expected accept length" in two.stdout
    assert two.stderr.count("held out: top-1 agreement") == 1  # rank 0's log only
