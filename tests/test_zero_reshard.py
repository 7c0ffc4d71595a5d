"""ZeRO checkpoints resumed on another number of ranks (pipeline.actors.zero_reshard): re-sharded
states equal the states laid out for the new number of ranks directly, on hand-built layouts; a
rank the saving run did not have takes rank 0's RNG state; and, under torchrun with DeepSpeed on CPU, ZeRO-1 / 2 / 3 and DDP actor checkpoints saved on two
ranks resume on one (and on two from one) with the weights saved and the losses of the run that
went on, and a two-rank ZeRO-3 run resumes on one rank as it would have continued."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.actors.zero_reshard import (ALIGNMENT, BASE, BASE3, FLATS, MASTERS, PADDINGS, PARTITION_COUNT,
                                          SLICE_MAPPINGS, read_range, zero3_state, zero3_whole, zero12_state)
from tests.conftest import REPO, make_hf_model
from tests.test_actors import free_port

MOMENTS = ("exp_avg", "exp_avg_sq")


def padded(t: torch.Tensor, size: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(size - t.numel())])


def assert_same(a, b, where: str = "state") -> None:
    """Equal nested dicts / lists of tensors (bit for bit) and plain values."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a.keys(), b.keys() if isinstance(b, dict) else b)
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def zero12_layout(wholes: dict[str, list[torch.Tensor]], world: int, rank: int, *, stepped: bool = True) -> dict:
    """DeepSpeed's ZeRO-1 / 2 `optimizer.state_dict()` on `rank` of `world` (stage_1_and_2.py):
    wholes["masters"][g] is group g's whole (wholes[moment][g] its moment's); each whole is
    zero-padded to a multiple of 2 x world and cut into equal partitions; the masters leave their
    padding out, the moments keep it. `stepped` False: the optimizer has not stepped (no state)."""
    masters, paddings, state = [], [], {}
    for g, whole in enumerate(wholes["masters"]):
        total = math.ceil(whole.numel() / (2 * world)) * 2 * world
        size = total // world
        pad = min(size, max(0, (rank + 1) * size - whole.numel()))
        masters.append(padded(whole, total)[rank * size:(rank + 1) * size][:size - pad].clone())
        paddings.append(pad)
        if stepped:
            state[g] = {"step": torch.tensor(3.0),
                        **{m: padded(wholes[m][g], total)[rank * size:(rank + 1) * size].clone() for m in MOMENTS}}
    groups = [{"lr": 0.1 if stepped else 0.5, "weight_decay": wd, "params": [g]} for g, wd in enumerate((0.1, 0.0))]
    return {"loss_scaler": "the saved scaler" if stepped else "a new scaler", "zero_stage": 2,
            MASTERS: masters, PADDINGS: paddings, ALIGNMENT: [[0] * 3, [0]], PARTITION_COUNT: [world, world],
            SLICE_MAPPINGS: [{"world": world}], BASE: {"state": state, "param_groups": groups[:len(masters)]}}


def zero3_layout(params: dict[str, list[torch.Tensor]], world: int, rank: int, sub_groups: list[list[int]], *,
                 stepped: bool = True) -> dict:
    """DeepSpeed's ZeRO-3 `optimizer.state_dict()` on `rank` of `world` (stage3.py): parameter j of n
    elements (params["masters"][j], its moments params[moment][j]) zero-padded to world x ceil(n /
    world), this rank holding slice `rank`; sub_groups[g]: the number of parameters in each of
    param group g's sub-groups, whose slices end to end are a flat."""
    def flats(values: list[torch.Tensor]) -> list[torch.Tensor]:
        slices = [padded(v, math.ceil(v.numel() / world) * world).view(world, -1)[rank].clone() for v in values]
        counts = [n for group in sub_groups for n in group]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return [torch.cat(slices[s:s + n]) for s, n in zip(starts, counts)]

    masters = flats(params["masters"])
    moments = {m: flats(params[m]) for m in MOMENTS}
    ids = iter(range(len(masters)))
    groups = [{"lr": 0.1 if stepped else 0.5, "params": [next(ids) for _ in group]} for group in sub_groups]
    state = {k: {"step": torch.tensor(3.0), **{m: moments[m][k] for m in MOMENTS}} for k in range(len(masters))}
    return {"loss_scaler": "the saved scaler" if stepped else "a new scaler", "zero_stage": 3,
            PARTITION_COUNT: world, FLATS: masters, BASE3: {"state": state if stepped else {}, "param_groups": groups}}


def random_values(numels: list[int], seed: int = 0) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {k: [torch.randn(n, generator=g) for n in numels] for k in ("masters", *MOMENTS)}


def test_read_range_is_the_slice_of_the_concatenation():
    pieces = [torch.arange(0, 3.0), torch.arange(3, 3.0), torch.arange(3, 10.0), torch.arange(10, 12.0)]
    whole = torch.cat(pieces)
    for start in range(13):
        for stop in range(start, 14):
            assert torch.equal(read_range(pieces, start, stop), whole[start:stop]), (start, stop)


# groups of 37 and 5 elements: 5 elements on 4 ranks leaves whole ranks of padding
@pytest.mark.parametrize("saved, resumed", [(2, 1), (1, 2), (2, 3), (3, 2), (4, 3), (1, 4)])
def test_zero12_states_resharded_from_m_ranks_equal_the_states_laid_out_for_n(saved, resumed):
    wholes = random_values([37, 5])
    states = [zero12_layout(wholes, saved, r) for r in range(saved)]
    for rank in range(resumed):
        template = zero12_layout(wholes, resumed, rank, stepped=False)  # a new engine's: its layout, no moments yet
        got = zero12_state(states, template, rank)
        assert_same(got, zero12_layout(wholes, resumed, rank), f"{saved} -> {resumed} ranks, rank {rank}")


@pytest.mark.parametrize("saved, resumed", [(2, 1), (1, 2), (2, 3), (3, 2), (4, 3)])
def test_zero3_states_resharded_from_m_ranks_equal_the_states_laid_out_for_n_in_its_sub_groups(saved, resumed):
    numels = [12, 7, 1, 30, 5]  # a 1-element parameter is padding on every rank but one
    values = random_values(numels)
    # the new engine cuts its sub-groups elsewhere (their size counts partition elements)
    old_groups, new_groups = [[3], [2]], [[1, 2], [1, 1]]
    states = [zero3_layout(values, saved, r, old_groups) for r in range(saved)]
    for rank in range(resumed):
        template = zero3_layout(values, resumed, rank, new_groups, stepped=False)
        got = zero3_state(states, template, numels, rank, resumed)
        assert_same(got, zero3_layout(values, resumed, rank, new_groups), f"{saved} -> {resumed} ranks, rank {rank}")


def test_zero3_whole_joins_every_ranks_slices_into_the_parameters():
    values = random_values([12, 7, 1, 30])
    streams = [zero3_layout(values, 3, r, [[2, 2]])[FLATS] for r in range(3)]
    assert_same(zero3_whole(streams, [12, 7, 1, 30]), values["masters"])


def test_a_checkpoint_of_another_model_is_refused_naming_what_to_resume_with():
    states = [zero12_layout(random_values([37, 5]), 2, r) for r in range(2)]
    for other in ([36, 5], [38, 5], [37, 5, 1]):  # one rank sees a group's whole length
        with pytest.raises(ValueError, match="resume with the model it was saved with"):
            zero12_state(states, zero12_layout(random_values(other), 1, 0, stepped=False), 0)
    values = random_values([12, 7])
    states = [zero3_layout(values, 2, r, [[2]]) for r in range(2)]
    with pytest.raises(ValueError, match="resume with the model it was saved with"):
        zero3_state(states, zero3_layout(random_values([12, 9]), 1, 0, [[2]], stepped=False), [12, 9], 0, 1)


def test_a_rank_the_saving_run_did_not_have_restores_rank_0s_rng_state_and_the_others_their_own(tmp_path):
    from pipeline.actors.checkpoint import load_rng, save_rng

    with torch.random.fork_rng():  # the test process's own state is left as it was
        drawn = []
        for rank in range(2):
            torch.manual_seed(rank)
            save_rng(tmp_path, rank)
            drawn.append(torch.rand(4))
        for rank, want in ((0, drawn[0]), (1, drawn[1]), (2, drawn[0]), (3, drawn[0])):
            torch.manual_seed(99)
            load_rng(tmp_path, rank)
            assert torch.equal(torch.rand(4), want), rank


# -- DeepSpeed under torchrun ----------------------------------------------------------------------

def torchrun(procs: int, model: Path, out: Path, *args: str) -> tuple[dict, str]:
    """tests/mp/reshard_worker.py on `procs` ranks: rank 0's report and stderr."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(REPO / "tests/mp/reshard_worker.py"), "--model", str(model),
           "--out", str(out), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ddp_and_zero1_2_3_checkpoints_resume_on_one_rank_from_two_and_on_two_from_one_with_the_same_next_losses(
        tmp_path):
    from launch.export import zero3_state_dict

    model = tmp_path / "model"
    make_hf_model("llama").save_pretrained(model)
    one, _ = torchrun(1, model, tmp_path / "one.json", "--save", str(tmp_path / "saved-by-1"))
    two, up = torchrun(2, model, tmp_path / "two.json", "--resume", str(tmp_path / "saved-by-1"),
                       "--save", str(tmp_path / "saved-by-2"))
    down, stderr = torchrun(1, model, tmp_path / "down.json", "--resume", str(tmp_path / "saved-by-2"))
    for backend, went_on in two["saved"].items():
        # One rank and two sum the gradients in other orders: float rounding only (measured relative
        # deviations up to 3e-7). Adam's moments move the second loss: zeroed at the resume, it moves
        # by 7% (its step count zeroed: 12%); the first loss alone would not see them.
        for resumed, uninterrupted in ((down, went_on), (two, one["saved"][backend])):
            r = resumed["resumed"][backend]
            assert r["loaded_equal"], backend  # the weights the saving run had, bit for bit
            assert r["losses"] == pytest.approx(uninterrupted, rel=1e-5, abs=1e-8), backend
            assert len(r["losses"]) == 2
        if backend != "torch":
            stage = backend[-1]
            assert (f"saved-by-2/{backend} was saved by 2 data-parallel ranks and is resumed on 1: its ZeRO-{stage} "
                    "partitions are re-sharded") in stderr
            assert f"saved by 1 data-parallel ranks and is resumed on 2: its ZeRO-{stage}" in up
    assert "was saved under ZeRO-2, this actor runs ZeRO-3: resume with actor.zero_stage=2" in down["other_stage"]
    # launch.export joins a two-rank ZeRO-3 checkpoint into the weights the run had
    folder = tmp_path / "saved-by-2"
    exported, saved = zero3_state_dict(folder / "zero3"), torch.load(folder / "weights-zero3.pt")
    assert exported.keys() <= saved.keys() and all(torch.equal(exported[k], saved[k]) for k in exported)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_two_rank_zero3_run_resumed_on_one_rank_makes_the_rollouts_rewards_and_losses_it_would_have_made(
        char_model_dir, tmp_path):
    from tests.test_separated import LENGTH_REWARD, SPEC, rollouts, step_rows
    from tests.test_separated import torchrun as train

    # train_shares=tokens forms each mini-batch from the same groups on any number of ranks (pipeline.shares);
    # under shard, rank r's mini-batches hold its loader shard's groups, so two ranks update on other mixes
    extra = [f"model.path={char_model_dir}", "trainer.steps=3", "trainer.save_every=1", *SPEC["off"], *LENGTH_REWARD,
             "actor.backend=deepspeed", "actor.zero_stage=3", "trainer.train_shares=tokens"]
    train(2, tmp_path / "two", *extra)
    shutil.copytree(tmp_path / "two", tmp_path / "one")
    resumed = train(1, tmp_path / "one", *extra, f"trainer.resume={tmp_path / 'one' / 'checkpoints' / 'step-1'}")
    assert "step-1/actor was saved by 2 data-parallel ranks and is resumed on 1" in resumed.stderr
    two, one = step_rows(tmp_path / "two"), step_rows(tmp_path / "one")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(two[1:], one[1:]):  # the same data, rollouts keyed by seed, step, prompt and sample
        assert b["train/reward_mean"] == pytest.approx(a["train/reward_mean"], rel=1e-6), a["step"]
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-8), a["step"]
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5), a["step"]
    assert rollouts(tmp_path / "two", by_rank=False) == rollouts(tmp_path / "one", by_rank=False)
