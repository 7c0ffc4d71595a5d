"""Spot training in the RL loop: the engine's sink fills the DataBuffer with the target's true
features, the coordinator trains in idle windows only and averages replicas by micro-steps, and a
tiny two-rank run trains its drafter online."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch
import torch.multiprocessing as mp

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.features import target_features
from engine.sampling import SamplingParams
from engine.spec.config import SpecConfig
from engine.spec.eagle import EagleConfig, EagleModel
from engine.spec.eagle_drafter import EagleDrafter
from engine.types import Request
from spot.buffer.ring import DataBuffer
from common.idle import RankState
from spot.training.features import TokenSequence, capture_features
from spot.buffer.sink import DataBufferSink
from tests.conftest import REPO
from tests.test_trainer import step_rows
from tests.mp.spot_worker import worker
from tests.mp import free_port


@pytest.fixture
def buffer_name():
    name = f"tailspec-test-{uuid.uuid4().hex[:8]}"
    yield name
    path = f"/dev/shm/{name}"
    for p in (path, path + ".lock"):
        if os.path.exists(p):
            os.unlink(p)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_sink_entries_hold_the_rollouts_tokens_and_their_teacher_forced_features(hf_folders, buffer_name, kind):
    target = load_checkpoint(hf_folders["llama"])
    torch.manual_seed(0)
    net = EagleModel(EagleConfig.for_target(target.config, kind), target)
    layers = tuple(net.config.aux_layers)
    with DataBuffer.create(buffer_name, capacity_bytes=8 * 2**20, feature_size=net.config.feature_size) as buf:
        sink = DataBufferSink(buf, max_new_tokens=20, feature_layers=layers)
        spec = SpecConfig(depth=3, topk=1, verify_tokens=3)
        engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=96, spec=spec), EagleDrafter(net), sink=sink)
        reqs = [Request(prompt_id=f"p{i}", prompt=[5 + i, 9, 17, 3 + i], n=3) for i in range(2)]  # 6 rows > 4 slots
        batch = engine.generate(reqs, SamplingParams(max_new_tokens=20, temperature=1.0, seed=3, stop_token_ids=(2,)))
        assert sink.flush(batch.rollouts, step=7) == len(batch.rollouts)
        infos = buf.infos()
        assert len(infos) == len(batch.rollouts)
        for ro in batch:
            (info,) = [i for i in infos if i.key == f"{ro.prompt_id}/{ro.sample}"]
            e = buf.read(info)
            prompt = next(r.prompt for r in reqs if r.prompt_id == ro.prompt_id)
            assert e.tokens.tolist() == prompt + ro.tokens[:-1] and e.prompt_len == len(prompt) and e.step == 7
            assert e.finished == (ro.finish_reason.value == "stop")
            with torch.no_grad():
                out = target(e.tokens[None], torch.arange(e.tokens.numel())[None], hidden_layers=layers)
            torch.testing.assert_close(e.features, target_features(out, layers)[0], atol=1e-4, rtol=0)
        # The next generate starts empty: nothing of this call is put twice.
        assert sink.flush([], step=8) == 0


def test_the_last_rank_holds_two_stashes_and_puts_them_with_their_own_steps(hf_folders, buffer_name):
    target = load_checkpoint(hf_folders["llama"])
    with DataBuffer.create(buffer_name, capacity_bytes=8 * 2**20, feature_size=target.config.hidden_size) as buf:
        sink = DataBufferSink(buf, max_new_tokens=12)
        engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64), sink=sink)
        params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
        for step in (1, 2, 3):  # the last rank of three steps in a row
            sink.stash(engine.generate([Request(prompt_id=f"s{step}", prompt=[5, 9, 17], n=2)], params).rollouts, step)
            assert sink.put_stashed(hold=2) == (2 if step == 3 else 0)
        # Step 1's stash went in at step 3's window, under its own step; steps 2 and 3 are held.
        assert sorted((i.key, i.step) for i in buf.infos()) == [("s1/0", 1), ("s1/1", 1)]
        assert [s.step for s in sink.stashed] == [2, 3]
        # The blocks circulate: a put stash's block serves the next generate call.
        assert len(sink.spare) == 1
        # An early rank's window puts them all, oldest first.
        assert sink.put_stashed() == 4 and sorted(i.step for i in buf.infos()) == [1, 1, 2, 2, 3, 3] and not sink.stashed


def fill(buf: DataBuffer, target, count: int, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    seqs = [TokenSequence(f"q{i}", 0, torch.randint(3, target.config.vocab_size, (12 + i % 5,), generator=g).tolist(), 4)
            for i in range(count)]
    from spot.buffer.ring import BufferEntry

    for s, row in zip(seqs, capture_features(target, seqs)):
        buf.put(BufferEntry(key=f"{s.prompt_id}/0", step=step, policy_version=0, finished=True, prompt_len=4,
                            tokens=row.tokens, features=row.features))


@pytest.mark.slow
def test_early_ranks_train_until_the_last_is_done_and_every_rank_serves_the_weighted_average(char_model_dir, buffer_name,
                                                                                            tmp_path):
    target = load_checkpoint(char_model_dir)
    F = target.config.hidden_size
    with DataBuffer.create(buffer_name, capacity_bytes=4 * 2**20, feature_size=F) as buf:
        fill(buf, target, 16, step=1)
        mp.start_processes(worker, args=(3, free_port(), str(tmp_path), str(char_model_dir), buffer_name), nprocs=3,
                           join=True, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    n = [r["micro_steps"] for r in ranks]
    assert n[0] > n[1] > 0 and n[2] == 0, n  # the longer a rank's idle window, the more it trained; the last none
    seen = ranks[2]["seen"]  # while rank 2 still generated
    assert seen[2] == (1, RankState.GENERATING.value) and all(s == (1, RankState.TRAINING.value) for s in seen[:2]), seen
    # Every rank serves the same drafter: the replicas averaged with weights n_r / sum(n).
    names = sorted(ranks[0]["served"])
    for r in ranks[1:]:
        assert all(torch.equal(r["served"][k], ranks[0]["served"][k]) for k in names)
    for k in names:
        expect = sum(n[r] * ranks[r]["before"][k].double() for r in range(3)) / sum(n)
        torch.testing.assert_close(ranks[0]["served"][k].double(), expect, atol=1e-6, rtol=0)
    assert not torch.equal(ranks[0]["before"][names[0]], ranks[1]["before"][names[0]])  # the replicas did differ
    assert all(r["served_version"] == 1 for r in ranks)
    # The early ranks put their rollouts' features as their windows opened; the last rank holds
    # its own for its next window, off the step's critical path.
    assert [r["put"] for r in ranks[:2]] == [["r0/0", "r0/1"], ["r1/0", "r1/1"]] and ranks[2]["put"] == []
    assert [r["held"] for r in ranks] == [[], [], [1]]
    m = ranks[0]["metrics"]
    assert m["spot/micro_steps"] == sum(n)
    per_step = m["spot/train_s"] / sum(n)
    assert m["spot/overrun_s"] <= 2 * per_step + 0.3, m  # all stop within about one micro-step of the window's end
    assert m["spot/utilisation"] > 0.5, m


def two_rank_run(char_model_dir, out, *overrides: str, module: str = "launch.train"):
    """A 3-step run of configs/tiny.yaml on the char model under torchrun (2 ranks, a random
    drafter saved next to it) by `module` (launch.train, or tests.mp.slow_rank_train); returns the run folder."""
    target = load_checkpoint(char_model_dir)
    torch.manual_seed(0)
    drafter = out / "drafter"
    EagleModel(EagleConfig.for_target(target.config), target).save(drafter)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", module,
           "--config", str(REPO / "configs" / "tiny.yaml"), f"model.path={char_model_dir}", f"run.out_dir={out / 'runs'}",
           "task.train_problems=64", "task.eval_problems=2", "rollout.n=4", "rollout.max_new_tokens=24",
           "engine.max_batch=16", "engine.max_len=96", f"engine.spec.drafter_path={drafter}", "engine.spec.depth=4",
           "engine.spec.verify_tokens=4", "trainer.steps=3", "trainer.prompts_per_step=4", "trainer.eval_every=0",
           "actor.micro_batch_tokens=256", "metrics.wandb=false", "metrics.dashboard=false", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = list((out / "runs").iterdir())
    return run_dir


@pytest.mark.slow
def test_a_two_rank_run_with_spot_training_trains_its_drafter_online(char_model_dir, tmp_path):
    # Rank 1 rolls out 0.3 s longer every step: rank 0 has a window to train in (tests.mp.slow_rank_train).
    run_dir = two_rank_run(char_model_dir, tmp_path, "spot.enabled=true", "spot.rows_per_step=4", "spot.window=64",
                           module="tests.mp.slow_rank_train")
    drafter = tmp_path / "drafter"
    rows = step_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all({"spot/micro_steps", "spot/idle_s", "buffer/entries", "buffer/bytes", "buffer/fill"} <= r.keys() for r in rows)
    assert all(r["buffer/entries"] > 0 for r in rows)
    trained = [r for r in rows if r["spot/micro_steps"] > 0]
    assert len(trained) == len(rows), rows  # every step had rank 0 idle for 0.3 s
    assert trained[-1]["spot/drafter_version"] >= 1
    # The checkpointed drafter is the trained one, not the warm start.
    from safetensors.torch import load_file

    saved = load_file(str(run_dir / "checkpoints" / "step-3" / "drafter" / "model.safetensors"))
    start = load_file(str(drafter / "model.safetensors"))
    assert not torch.equal(saved["fc.weight"], start["fc.weight"])
    assert (run_dir / "checkpoints" / "step-3" / "spot").is_dir()
    assert not [p for p in os.listdir("/dev/shm") if run_dir.name in p]  # the node's segment is gone


def test_pool_mode_ranks_load_the_pools_newest_publication_once_and_skip_one_pruned_as_it_is_read(
        hf_folders, buffer_name, tmp_path, monkeypatch):
    from common.idle import IdleWindow
    import spot.pool.follower as follower_module
    from spot.pool.follower import PoolFollower
    from spot.pool.elastic import publish, retire

    target = load_checkpoint(hf_folders["llama"])
    torch.manual_seed(0)
    net = EagleModel(EagleConfig.for_target(target.config), target)
    engine = RolloutEngine(target, EngineConfig(max_batch=2, max_len=64, spec=SpecConfig(depth=2, verify_tokens=2)),
                           EagleDrafter(net))
    window = IdleWindow(step=1, rank=0, world=1, started=0.0, others_done=lambda: True, all_done_at=lambda: 0.0,
                        opened_last=True)
    with DataBuffer.create(buffer_name, capacity_bytes=2**20, feature_size=net.config.feature_size) as buf:
        follower = PoolFollower(engine, buf, DataBufferSink(buf, max_new_tokens=8), str(tmp_path / "pool"), None, 0)
        assert follower.work(window)["spot/drafter_version"] == 0  # nothing published yet: the warm drafter stays
        trained = EagleModel(EagleConfig.for_target(target.config), target)  # another init: "what the pool trained"
        publish(trained, tmp_path / "pool", micro_steps=10, keep=3)
        assert follower.work(window)["spot/drafter_version"] == 1
        served = dict(engine.drafter_nets()[0].named_parameters())
        assert all(torch.equal(served[n], p) for n, p in trained.named_parameters())
        assert engine.drafter.version == 1
        loads = []
        engine.load_drafter_weights = lambda *a, **k: loads.append(a)
        follower.work(window)  # the same publication: not loaded again
        assert loads == []
        publish(trained, tmp_path / "pool", micro_steps=20, keep=3)
        folder = tmp_path / "pool" / "published" / "v2"
        checked = follower_module.published_weights
        monkeypatch.setattr(follower_module, "published_weights", lambda path: (retire(folder), checked(path))[1])
        assert follower.work(window)["spot/drafter_version"] == 1 and loads == []  # pruned as it was read: skipped


def test_pool_mode_without_a_pool_folder_is_refused():
    from common.config import load_config
    from launch.run.config import TrainConfig

    with pytest.raises(ValueError, match="spot.pool_dir"):
        load_config(TrainConfig, REPO / "configs" / "tiny.yaml", ["spot.enabled=true", "spot.mode=pool"])
