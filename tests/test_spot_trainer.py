"""The spot drafter trainer: it learns from cached target states, stops within one micro-step of a
preempt flag, and its checkpoints are never visible half-written and resume to the same weights."""

from __future__ import annotations

import os
import random
import select
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.spec.eagle import EagleConfig, EagleModel
from engine.spec.eagle_drafter import EagleDrafter
from spot.config import SpotConfig
from spot.training.step import DrafterOptim, evaluate
from spot.training.features import TokenSequence, capture_features
from spot.training.pairs import PackedPairs
from spot.training.records import HiddenStateRows
from spot.training.trainer import SpotTrainer, checkpoint_path, latest_checkpoint, prune_checkpoints
from spot.pool.elastic import PoolConfig
from spot.warmstart.train import WarmstartConfig

TOTAL, EVERY = 8, 2  # micro-steps of a preemption run, and its checkpoint interval
OPTIM = DrafterOptim(lr=3e-3, warmup_steps=3)


@pytest.fixture(scope="module")
def tiny(char_model_dir):
    """(target, cached rows, the drafter's initial state)."""
    target = load_checkpoint(char_model_dir)
    g = torch.Generator().manual_seed(0)
    V = target.config.vocab_size
    seqs = [TokenSequence(f"p{i}", 0, torch.randint(3, V, (int(torch.randint(8, 20, (1,), generator=g)),), generator=g).tolist(), 3)
            for i in range(12)]
    rows = capture_features(target, seqs)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        init = EagleModel(EagleConfig.for_target(target.config), target).state_dict()
    return target, rows, init


def fresh(tiny, draft_vocab: torch.Tensor | None = None) -> EagleModel:
    target, _, init = tiny
    with torch.random.fork_rng():
        model = EagleModel(EagleConfig.for_target(target.config), target, draft_vocab)
    if draft_vocab is None:
        model.load_state_dict(init)
    return model


def new_trainer(tiny) -> SpotTrainer:
    return SpotTrainer(fresh(tiny), OPTIM, window=16, rows_per_step=3, seed=7)


def rows_for(tiny):
    """next_rows: a function of the micro-step index, with more rows than a micro-step takes."""
    rows = tiny[1]
    return lambda i: [rows[(3 * i + j) % len(rows)] for j in range(5)]


def drive(trainer: SpotTrainer, folder: Path, next_rows, should_stop, save_on_stop: bool = False) -> None:
    """A spot job: micro-steps to TOTAL, a checkpoint every EVERY; a preempted job may save on its way out."""
    while trainer.micro_steps < TOTAL:
        if should_stop():
            if save_on_stop:
                trainer.save(checkpoint_path(folder, trainer.micro_steps))
            return
        trainer.train(next_rows, should_stop, max_micro_steps=min(EVERY - trainer.micro_steps % EVERY,
                                                                  TOTAL - trainer.micro_steps))
        if trainer.micro_steps % EVERY == 0:
            trainer.save(checkpoint_path(folder, trainer.micro_steps))


def finish(tiny, folder: Path) -> SpotTrainer:
    """Resumes from the newest complete checkpoint (or starts over) and runs to TOTAL."""
    ckpt = latest_checkpoint(folder)
    trainer = new_trainer(tiny) if ckpt is None else SpotTrainer.resume(ckpt, fresh(tiny), OPTIM)
    drive(trainer, folder, rows_for(tiny), lambda: False)
    return trainer


def same_weights(a: SpotTrainer, b: SpotTrainer) -> bool:
    wa, wb = a.named_weights(), b.named_weights()
    return [n for n, _ in wa] == [n for n, _ in wb] and all(torch.equal(x, y) for (_, x), (_, y) in zip(wa, wb))


def test_loss_falls_and_top1_agreement_rises_on_cached_states_of_the_tiny_target(tiny):
    rows = tiny[1]
    trainer = SpotTrainer(fresh(tiny), OPTIM, window=32, rows_per_step=6)
    packed = PackedPairs(rows, 32)
    before = evaluate(trainer.model, packed, OPTIM.ce_weight)
    first = trainer.train(lambda i: rows, lambda: False, max_micro_steps=5)
    trainer.train(lambda i: rows, lambda: False, max_micro_steps=20)
    last = trainer.train(lambda i: rows, lambda: False, max_micro_steps=5)
    after = evaluate(trainer.model, packed, OPTIM.ce_weight)
    assert trainer.micro_steps == 30 and last["spot/micro_steps"] == 5
    assert last["spot/drafter_loss"] < 0.8 * first["spot/drafter_loss"]
    assert last["spot/top1"] > first["spot/top1"] + 0.2
    assert after["loss"] < 0.8 * before["loss"] and after["top1_agreement"] > before["top1_agreement"] + 0.2


def test_train_stops_when_the_rows_run_out_or_at_max_micro_steps(tiny):
    trainer = new_trainer(tiny)
    m = trainer.train(lambda i: tiny[1] if i < 3 else [], lambda: False)
    assert m["spot/micro_steps"] == 3 and trainer.micro_steps == 3
    m = trainer.train(lambda i: [], lambda: False)
    assert m["spot/micro_steps"] == 0 and "spot/drafter_loss" not in m
    assert trainer.train(rows_for(tiny), lambda: False, max_micro_steps=2)["spot/micro_steps"] == 2
    r = tiny[1][0]
    with pytest.raises(ValueError, match="no row has a response token"):
        trainer.micro_step([HiddenStateRows(prompt_id="x", tokens=r.tokens, features=r.features, prompt_len=r.length)])


@pytest.mark.parametrize("seed", range(5))
def test_a_flag_raised_at_a_random_moment_stops_training_within_one_micro_step(tiny, seed):
    trainer = new_trainer(tiny)
    stop = threading.Event()
    started_after_flag = []
    rows = rows_for(tiny)

    def next_rows(i):
        started_after_flag.append(stop.is_set())
        return rows(i)

    done_at_flag = []

    def raise_flag():
        done_at_flag.append(trainer.micro_steps)
        stop.set()

    timer = threading.Timer(random.Random(seed).uniform(0, 0.03), raise_flag)
    timer.start()
    trainer.train(next_rows, stop.is_set, max_micro_steps=10_000)
    timer.join()
    # At most the micro-step in flight when the flag rose runs on.
    assert sum(started_after_flag) <= 1 and trainer.micro_steps - done_at_flag[0] <= 1


def test_a_chunked_micro_step_is_the_one_batch_step(tiny):
    """Chunks accumulate gradients weighted by their pairs: the step's gradient is the whole
    batch's, up to float rounding (compared before AdamW, whose update of a near-zero gradient
    amplifies rounding; the step leaves the clipped gradient in .grad)."""
    rows = tiny[1][:6]
    packed = PackedPairs(rows, 16)
    assert len(packed) >= 3
    steps = {}
    for chunk in (None, 1, 2):
        trainer = SpotTrainer(fresh(tiny), OPTIM, window=16, rows_per_step=6, chunk_windows=chunk)
        loss, metrics = trainer.step_fn.step(packed, torch.arange(len(packed)), 3e-3, chunk=chunk)
        assert metrics["spot/step_pairs"] == packed.num_pairs and metrics["spot/cut"] == 0.0
        steps[chunk] = (loss, [p.grad.clone() for p in trainer.step_fn.params])
    for chunk in (1, 2):
        assert abs(steps[chunk][0] - steps[None][0]) < 1e-5
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(steps[chunk][1], steps[None][1]))


def cut_at(asks_before_stop: int):
    """should_stop: false before the micro-step, true at the asks_before_stop-th check inside it."""
    asked = []

    def should_stop():
        asked.append(1)
        return len(asked) > asks_before_stop

    return should_stop, asked


@pytest.mark.parametrize("asks_before_stop", [1, 2, 3])  # after chunk 1's forward, its backward, chunk 2's forward
def test_a_flag_raised_inside_a_micro_step_drops_it_whole(tiny, asks_before_stop):
    trainer = new_trainer(tiny)
    trainer.train(rows_for(tiny), lambda: False, max_micro_steps=2)
    weights = trainer.named_weights()
    moments = {k: v.clone() for k, v in trainer.step_fn.opt.state[trainer.step_fn.params[0]].items()}
    should_stop, asked = cut_at(asks_before_stop)
    m = trainer.train(rows_for(tiny), should_stop)
    assert m["spot/micro_steps"] == 0 and m["spot/aborted"] == 1 and "spot/drafter_loss" not in m
    assert 0 < m["spot/dropped_s"] <= m["spot/train_s"]  # its time is told apart
    assert trainer.micro_steps == 2 and len(asked) == asks_before_stop + 1
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(weights, trainer.named_weights()))
    state = trainer.step_fn.opt.state[trainer.step_fn.params[0]]
    assert all(torch.equal(moments[k], state[k]) for k in moments)
    resumed = trainer.train(rows_for(tiny), lambda: False, max_micro_steps=1)  # and training goes on from there
    assert resumed["spot/micro_steps"] == 1 and trainer.micro_steps == 3 and resumed["spot/dropped_s"] == 0.0


@pytest.mark.parametrize("asks_before_stop", [1, 2])  # after the first chunk's backward / the second chunk's forward
def test_keep_cut_takes_a_micro_step_cut_short_on_the_chunks_done(tiny, asks_before_stop):
    trainer, twin = new_trainer(tiny), new_trainer(tiny)
    for t in (trainer, twin):  # the same weights, moments and micro-step count
        t.train(rows_for(tiny), lambda: False, max_micro_steps=2)
    rows = trainer.choose_rows(rows_for(tiny)(trainer.micro_steps))
    packed = PackedPairs(rows, trainer.window)
    assert len(packed) >= 2, "the test needs a micro-step of two chunks or more"
    order = torch.randperm(len(packed), generator=trainer._generator())
    should_stop, asked = cut_at(asks_before_stop)
    m = trainer.micro_step(rows_for(tiny)(trainer.micro_steps), should_stop, keep_cut=True)
    assert m["spot/cut"] == 1 and trainer.micro_steps == 3 and len(asked) == asks_before_stop + 1
    assert (m["spot/dropped_s"] > 0) == (asks_before_stop == 2)  # a chunk stopped after its forward is dropped
    assert m["spot/pairs"] == int(packed.loss[order[:1]].sum()) < m["spot/rows_pairs"] == packed.num_pairs
    # The step taken is the one on the first chunk's pairs alone (its gradient, as clipped, is left in .grad).
    twin.step_fn.step(packed, order[:1], twin.optim.lr_at(twin.micro_steps, 0.0))
    assert all(torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-8) for a, b in zip(trainer.step_fn.params, twin.step_fn.params))
    assert all(torch.allclose(a, b, atol=1e-4) for (_, a), (_, b) in zip(trainer.named_weights(), twin.named_weights()))


@pytest.mark.parametrize("asks_before_stop, taken", [(1, 0), (2, 1)])  # after chunk 1's forward / its backward
def test_train_with_keep_cut_counts_a_cut_micro_step_only_when_a_chunk_was_done(tiny, asks_before_stop, taken):
    trainer = new_trainer(tiny)
    should_stop, _ = cut_at(asks_before_stop)  # the first call is before the micro-step
    m = trainer.train(rows_for(tiny), should_stop, keep_cut=True)
    assert m["spot/micro_steps"] == taken == trainer.micro_steps and m["spot/aborted"] == 1
    assert ("spot/drafter_loss" in m) == bool(taken) and (m["spot/dropped_s"] > 0) == (not taken)


def test_named_weights_are_the_trainable_ones_and_reload_into_a_separate_engine_drafter(tiny, tmp_path):
    trainer = new_trainer(tiny)
    served = EagleDrafter(fresh(tiny))  # the engine's drafter: never trained in place
    names = [n for n, _ in trainer.named_weights()]
    assert names == [n for n, _ in trainer.model.named_parameters()]
    assert not any("embed" in n or "lm_head" in n or "draft_vocab" in n for n in names)
    trainer.train(rows_for(tiny), lambda: False, max_micro_steps=2)
    assert not torch.equal(served.net.fc.weight, trainer.model.fc.weight)
    served.load_weights(trainer.named_weights(), version=1)
    assert torch.equal(served.net.fc.weight, trainer.model.fc.weight)
    trainer.save(tmp_path / "ckpt-2")
    assert sorted(p.name for p in (tmp_path / "ckpt-2").iterdir()) == ["drafter.safetensors", "optimizer.pt", "trainer.json"]
    with pytest.raises(ValueError, match="does not exist"):
        trainer.load_weights([("embed.weight", torch.zeros(1))])


def preempt_in_process(tiny, folder: Path, rng: random.Random) -> None:
    trainer = new_trainer(tiny)
    if rng.random() < 0.5:
        at = rng.randint(0, TOTAL - 1)
        should_stop = lambda: trainer.micro_steps >= at  # noqa: E731
        drive(trainer, folder, rows_for(tiny), should_stop, save_on_stop=rng.random() < 0.5)
        assert trainer.micro_steps == at  # the flag is checked before every micro-step
        return
    stop = threading.Event()
    timer = threading.Timer(rng.uniform(0, 0.06), stop.set)
    timer.start()
    drive(trainer, folder, rows_for(tiny), stop.is_set, save_on_stop=rng.random() < 0.5)
    timer.cancel()


def hold_at(nth: int, partial: bool, notify: int) -> None:
    """In a forked child: the nth checkpoint file write (half written if `partial`) tells the parent and waits to be killed."""
    calls = [0]
    real = Path.write_bytes

    def write_bytes(self, data):
        calls[0] += 1
        if calls[0] < nth:
            return real(self, data)
        real(self, data[: len(data) // 2] if partial else data)
        os.write(notify, b"h")
        threading.Event().wait()

    Path.write_bytes = write_bytes


def read_byte(fd: int, timeout: float = 30.0) -> bytes:
    ready, _, _ = select.select([fd], [], [], timeout)
    assert ready, f"the child sent nothing within {timeout} s"
    return os.read(fd, 1)


def sigkill_a_child(tiny, folder: Path, rng: random.Random) -> bool:
    """Forks a spot job and SIGKILLs it, either held mid-save or at a random moment; -> whether it was mid-save."""
    mid_save = rng.random() < 0.6
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, exit without cleanup
        code = 1
        try:
            os.close(r)
            if mid_save:
                hold_at(rng.randint(1, 2 * TOTAL // EVERY), partial=rng.random() < 0.5, notify=w)
            trainer = new_trainer(tiny)
            os.write(w, b"s")
            drive(trainer, folder, rows_for(tiny), lambda: False)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        assert read_byte(r) == b"s"
        if mid_save:
            assert read_byte(r) == b"h"
        else:
            time.sleep(rng.uniform(0, 0.08))  # not synchronisation: a random moment to kill at
    finally:
        os.kill(pid, signal.SIGKILL)  # a child that already exited is a zombie until waitpid: no error
        _, status = os.waitpid(pid, 0)
        os.close(r)
    assert os.WIFSIGNALED(status) or os.WEXITSTATUS(status) == 0
    return mid_save


@pytest.mark.slow
def test_preemption_at_50_random_points_never_leaves_a_corrupt_checkpoint_and_resume_gives_the_same_weights(tiny, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the forked children run single-threaded; the same reductions everywhere
    try:
        reference = new_trainer(tiny)
        drive(reference, tmp_path / "reference", rows_for(tiny), lambda: False)
        rng = random.Random(0)
        kinds = {"in-process": 0, "killed": 0, "killed mid-save": 0}
        for case in range(50):
            folder = tmp_path / f"case{case}"
            if case % 2 == 0:
                preempt_in_process(tiny, folder, rng)
                kinds["in-process"] += 1
            elif sigkill_a_child(tiny, folder, rng):
                kinds["killed mid-save"] += 1
                assert any(p.name.endswith(".tmp") for p in folder.iterdir())  # the kill did land mid-save
            else:
                kinds["killed"] += 1
            ckpt = latest_checkpoint(folder)
            if ckpt is not None:
                SpotTrainer.resume(ckpt, fresh(tiny), OPTIM)  # whatever latest_checkpoint shows loads
            resumed = finish(tiny, folder)
            assert resumed.micro_steps == TOTAL
            assert same_weights(resumed, reference), (case, ckpt)
        assert min(kinds.values()) >= 5, kinds
    finally:
        torch.set_num_threads(threads)


def test_resume_restores_the_optimiser_and_micro_steps_exactly(tiny, tmp_path):
    a = new_trainer(tiny)
    a.train(rows_for(tiny), lambda: False, max_micro_steps=3)
    a.save(tmp_path / "ckpt-3")
    b = SpotTrainer.resume(tmp_path / "ckpt-3", fresh(tiny), OPTIM)
    assert b.micro_steps == 3 and (b.window, b.rows_per_step, b.seed) == (16, 3, 7)
    for t in (a, b):
        t.train(rows_for(tiny), lambda: False, max_micro_steps=3)
    assert same_weights(a, b)


def corrupt(path: Path, how: str) -> None:
    if how == "truncated optimizer":
        f = path / "optimizer.pt"
        f.write_bytes(f.read_bytes()[:-10])
    elif how == "flipped byte":
        f = path / "drafter.safetensors"
        b = bytearray(f.read_bytes())
        b[-1] ^= 0xFF
        f.write_bytes(bytes(b))
    elif how == "no trainer.json":
        (path / "trainer.json").unlink()
    elif how == "garbage trainer.json":
        (path / "trainer.json").write_text("{not json")
    elif how == "no weights":
        (path / "drafter.safetensors").unlink()


@pytest.mark.parametrize("how", ["truncated optimizer", "flipped byte", "no trainer.json", "garbage trainer.json", "no weights"])
def test_a_corrupt_checkpoint_raises_a_value_error_naming_it_and_latest_skips_an_incomplete_one(tiny, tmp_path, how):
    trainer = new_trainer(tiny)
    trainer.train(rows_for(tiny), lambda: False, max_micro_steps=1)
    trainer.save(checkpoint_path(tmp_path, 1))
    trainer.train(rows_for(tiny), lambda: False, max_micro_steps=1)
    bad = checkpoint_path(tmp_path, 2)
    trainer.save(bad)
    (tmp_path / "ckpt-3.tmp").mkdir()  # what a kill mid-save leaves
    assert latest_checkpoint(tmp_path) == bad
    corrupt(bad, how)
    with pytest.raises(ValueError, match=str(bad)):
        SpotTrainer.resume(bad, fresh(tiny), OPTIM)
    if how != "flipped byte":  # a size-preserving corruption is caught by the digest, on resume
        assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)


def test_a_checkpoint_for_another_draft_vocabulary_is_refused(tiny, tmp_path):
    trainer = SpotTrainer(fresh(tiny, torch.arange(8)), OPTIM, window=16)
    trainer.save(tmp_path / "ckpt-0")
    with pytest.raises(ValueError, match="was written for a drafter"):
        SpotTrainer.resume(tmp_path / "ckpt-0", fresh(tiny, torch.arange(1, 9)), OPTIM)
    assert SpotTrainer.resume(tmp_path / "ckpt-0", fresh(tiny, torch.arange(8)), OPTIM).micro_steps == 0
    assert latest_checkpoint(tmp_path / "missing") is None


def test_pruning_keeps_the_newest_complete_checkpoints_and_drops_older_ones(tiny, tmp_path):
    trainer = new_trainer(tiny)
    for _ in range(4):
        trainer.train(rows_for(tiny), lambda: False, max_micro_steps=1)
        trainer.save(checkpoint_path(tmp_path, trainer.micro_steps))
    (checkpoint_path(tmp_path, 4) / "trainer.json").unlink()  # the newest is incomplete: it does not count
    (checkpoint_path(tmp_path, 5)).mkdir()
    removed = prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["ckpt-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-2", "ckpt-3", "ckpt-4", "ckpt-5"]
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 3)
    assert prune_checkpoints(tmp_path, keep=3) == []  # only two complete ones: nothing goes
    with pytest.raises(ValueError, match="keep must be >= 1"):
        prune_checkpoints(tmp_path, keep=0)


def test_an_mtp_head_learns_from_the_same_rows(tiny):
    """The spot trainer is the drafter's kind-agnostic: an mtp head (vLLM's mtp method) trains on the same rows."""
    target, rows, _ = tiny
    torch.manual_seed(0)
    trainer = SpotTrainer(EagleModel(EagleConfig.for_target(target.config, "mtp"), target), OPTIM, window=32, rows_per_step=6)
    packed = PackedPairs(rows, 32)
    before = evaluate(trainer.model, packed, OPTIM.ce_weight)
    trainer.train(lambda i: rows, lambda: False, max_micro_steps=30)
    after = evaluate(trainer.model, packed, OPTIM.ce_weight)
    assert after["loss"] < 0.8 * before["loss"] and after["top1_agreement"] > before["top1_agreement"] + 0.2, (before, after)


def test_every_config_section_builds_the_drafter_optimiser_from_keys_of_the_same_names():
    keys = dict(lr=2e-4, warmup_steps=5, weight_decay=0.02, grad_clip=0.5, ce_weight=0.3)
    spot = SpotConfig(**keys).optim()
    assert spot == PoolConfig(target="t", drafter="d", buffer="b", out="o", **keys).optim()
    assert (spot.lr, spot.warmup_steps, spot.weight_decay, spot.grad_clip, spot.ce_weight) == tuple(keys.values())
    assert WarmstartConfig().optim() == DrafterOptim()  # warm start's defaults are the record's
    with pytest.raises(ValueError, match="spot.weight_decay must be >= 0"):
        SpotConfig(weight_decay=-1).validate()
    with pytest.raises(ValueError, match="spot pool: lr must be > 0"):
        PoolConfig(target="t", drafter="d", buffer="b", out="o", lr=0).validate()
    with pytest.raises(ValueError, match="^min_lr_ratio must be in"):
        WarmstartConfig(min_lr_ratio=2).validate()
