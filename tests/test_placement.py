"""The separated placement's parts: roles from the config, what it refuses, the generation split,
the data path (every field of a shipment arrives) and the versioned, bucketed weight push."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from common.buckets import buckets_of
from common.config import load_config
from launch.run.config import TrainConfig
from pipeline.config import PipelineSection
from pipeline.rollout.stage import ScoredRollouts
from pipeline.shares import generation_shares, shard_shares
from pipeline.separated.shipment import RolloutShipment, pack_shipments, unpack
from tests.mp import free_port
from tests.mp.sync_tensors import tensors

REPO = Path(__file__).resolve().parent.parent
SEPARATED = ["pipeline.placement=separated", "pipeline.actor_ranks=1", "trainer.train_shares=shard"]


def test_separated_ranks_are_actors_first_then_rollouts_and_a_bad_count_names_the_key():
    assert PipelineSection(placement="separated", actor_ranks=2).roles(4) == (2, 2)
    assert PipelineSection(placement="separated", actor_ranks=1).roles(3) == (1, 2)
    assert PipelineSection().roles(2) == (2, 2)  # colocated: every rank both
    with pytest.raises(ValueError, match="pipeline.actor_ranks=2 leaves no rollout rank"):
        PipelineSection(placement="separated", actor_ranks=2).roles(2)
    with pytest.raises(ValueError, match="pipeline.actor_ranks >= 1"):
        load_config(TrainConfig, REPO / "configs" / "tiny.yaml", ["pipeline.placement=separated", "trainer.train_shares=shard"])
    with pytest.raises(ValueError, match="pipeline.actor_ranks=2 is for pipeline.placement=separated"):
        load_config(TrainConfig, REPO / "configs" / "tiny.yaml", ["pipeline.actor_ranks=2"])


@pytest.mark.parametrize("overrides, key", [(["engine.backend=vllm"], ": spot.enabled trains from the rollout engine's features"),
                                            (["algorithm.name=dapo"], ": algorithm.dynamic_sampling"),
                                            (["actor.backend=megatron", "actor.device=cuda"],
                                             " .* the capability subgroup that actor.backend=megatron lacks"),
                                            (["rollout.work_stealing=true", "rollout.split_groups=false"], ": rollout.work_stealing"),
                                            (["rollout.long_first=true"], ": rollout.long_first")])
def test_what_separated_does_not_run_is_a_config_error_naming_the_key(overrides, key):
    with pytest.raises(ValueError, match=f"pipeline.placement=separated{key}"):
        load_config(TrainConfig, REPO / "configs" / "tiny.yaml",
                    [*SEPARATED, "spot.enabled=true", "spot.pool_dir=pool", *overrides])


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_separated_trains_with_ddp_or_deepspeed_zero(backend):
    cfg = load_config(TrainConfig, REPO / "configs" / "tiny.yaml",
                      [*SEPARATED, f"actor.backend={backend}", "actor.zero_stage=3"])
    assert (cfg.pipeline.placement, cfg.actor.backend) == ("separated", backend)


def test_a_separated_run_takes_an_elastic_pool_that_names_its_folder():
    base = [*SEPARATED, "spot.enabled=true", "spot.mode=pool"]
    cfg = load_config(TrainConfig, REPO / "configs" / "tiny.yaml", [*base, "spot.pool_dir=pool"])
    assert (cfg.pipeline.placement, cfg.spot.mode, cfg.spot.pool_dir) == ("separated", "pool", "pool")
    with pytest.raises(ValueError, match="spot.pool_dir"):
        load_config(TrainConfig, REPO / "configs" / "tiny.yaml", base)


def test_generation_shares_are_contiguous_cover_every_group_and_differ_by_at_most_one():
    assert generation_shares(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert generation_shares(2, 3) == [[0], [1], []]
    for groups, ranks in [(16, 3), (5, 5), (9, 2)]:
        shares = generation_shares(groups, ranks)
        assert [g for s in shares for g in s] == list(range(groups))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def _scored(ship: RolloutShipment) -> ScoredRollouts:
    from engine.types import RolloutBatch

    return ScoredRollouts(problems=ship.problems, prompts=ship.prompts, n=ship.n, rewards=ship.rewards,
                          batch=RolloutBatch(rollouts=ship.rollouts, steps=[], prefill_s=0.0, wall_s=0.0, policy_version=4))


def test_actor_ranks_get_exactly_their_shard_in_global_order_from_any_generation_split():
    # two rollout ranks generated groups [0, 1, 2] and [3, 4, 5]; two actor ranks train [0, 1, 2] / [3, 4, 5]
    # under shard_shares, and a 4-way split of the actor side crosses the generation boundary.
    made = [RolloutShipment.make_dummy(step=5, source=s, groups=g, n=3) for s, g in ((2, (0, 1, 2)), (3, (3, 4, 5)))]
    for actors in (2, 3):
        shares = shard_shares(6, actors)
        sent = [pack_shipments(_scored(m), m.groups, shares, 5, m.source, m.report) for m in made]
        for k, share in enumerate(shares):
            got = unpack([per_rank[k] for per_rank in sent], share, step=5, n=3)
            want = [(m, i) for m in made for i, g in enumerate(m.groups) if g in share]
            assert got.problems == [m.problems[i] for m, i in want]
            assert got.prompts == [m.prompts[i] for m, i in want]
            assert got.batch.rollouts == [ro for m, i in want for ro in m.rollouts[i * 3:(i + 1) * 3]]
            assert torch.equal(got.rewards, torch.cat([m.rewards[i * 3:(i + 1) * 3] for m, i in want]))
            assert got.n == 3 and all(s.report == m.report for s, m in zip([p[k] for p in sent], made))
    with pytest.raises(ValueError, match="another step's"):
        unpack([p[0] for p in sent], shard_shares(6, 3)[0], step=6, n=3)
    with pytest.raises(ValueError, match="this actor rank trains"):
        unpack([p[0] for p in sent], [0, 1, 2], step=5, n=3)


def test_an_actor_rank_joins_the_parts_of_split_groups_in_sample_order():
    # two rollout ranks each made half of every group (samples 0-1 on rank 2, 2-3 on rank 3)
    whole = RolloutShipment.make_dummy(step=1, source=2, groups=(0, 1, 2, 3), n=4)
    halves = []
    for source, first in ((2, 0), (3, 2)):
        rows = [g * 4 + s for g in range(4) for s in (first, first + 1)]
        half = RolloutShipment(step=1, source=source, groups=list(whole.groups), problems=whole.problems,
                               prompts=whole.prompts, rollouts=[whole.rollouts[i] for i in rows],
                               rewards=whole.rewards[rows].clone(), n=2, report=whole.report)
        halves.append(pack_shipments(_scored(half), half.groups, shard_shares(4, 2), 1, source, half.report))
    for k, share in enumerate(shard_shares(4, 2)):
        got = unpack([halves[1][k], halves[0][k]], share, step=1, n=4)  # the order of arrival does not matter
        assert got.n == 4 and got.problems == [whole.problems[g] for g in share]
        assert got.batch.rollouts == [whole.rollouts[g * 4 + s] for g in share for s in range(4)]
        assert torch.equal(got.rewards, torch.cat([whole.rewards[g * 4:(g + 1) * 4] for g in share]))
    with pytest.raises(ValueError, match=r"group 0 arrived with samples \[0, 1\], not 0..3"):
        unpack([halves[0][0]], shard_shares(4, 2)[0], step=1, n=4)  # rank 3's halves never came


def test_buckets_hold_one_dtype_and_at_most_the_byte_budget_unless_one_tensor_is_larger():
    named = tensors()
    buckets = list(buckets_of(named, bucket_bytes=2048))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]  # order kept, nothing lost
    for b in buckets:
        assert len({t.dtype for _, t in b}) == 1
        assert len(b) == 1 or sum(t.numel() * t.element_size() for _, t in b) <= 2048
    assert any(len(b) == 1 and b[0][1].numel() * 4 > 2048 for b in buckets)  # embed.weight: 3200 bytes


@pytest.mark.timeout(120)
def test_three_ranks_ship_every_field_and_push_weights_bit_identical_refusing_a_stale_version(tmp_path):
    from tests.mp.separated_worker import BUCKET, worker

    mp.start_processes(worker, args=(3, free_port(), str(tmp_path)), nprocs=3, join=True, start_method="spawn")
    actor, r1, r2 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(3))
    assert (actor["role"], r1["role"], r2["role"]) == ("actor", "rollout", "rollout")
    assert actor["actors"] == (0,) and actor["rollouts"] == (1, 2)
    assert (r1["group_rank"], r2["group_rank"], r2["group_world"], actor["group_world"]) == (0, 1, 2, 1)
    assert actor["role_sum"] == 0 and r1["role_sum"] == r2["role_sum"] == 3  # each role's group, alone
    # the data path: every field of each rollout rank's shipment, as sent
    for got, src in zip(actor["shipments"], (1, 2)):
        want = RolloutShipment.make_dummy(step=3, source=src, groups=(2 * src, 2 * src + 1))
        for field in RolloutShipment.__dataclass_fields__:
            a, b = getattr(got, field), getattr(want, field)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, field
    # the push: bit-identical tensors in fewer broadcasts than tensors, served as the pushed version
    n, buckets = len(tensors()), len(list(buckets_of(tensors(), BUCKET)))
    for r in (r1, r2):
        assert list(r["got"]) == [name for name, _ in tensors()] and r["loaded_version"] == 1
        assert all(r["got"][k].dtype == v.dtype and torch.equal(r["got"][k], v) for k, v in tensors())
        assert r["push"]["sync/buckets"] == buckets < n and r["push"]["sync/tensors"] == n
        assert r["push"]["sync/bytes"] == sum(t.numel() * t.element_size() for _, t in tensors())
    assert actor["broadcasts"] == 2 * buckets  # two pushes, one flat broadcast per bucket
    # rank 2 expected version 2 and refused version 1, after draining the stream (nobody hung)
    assert r1["stale_error"] == "" and "expects policy version 2" in r2["stale_error"] and "version 1" in r2["stale_error"]


@pytest.mark.parametrize("mode, expected", [("sync", [3, 4, 5]), ("async", [3, 3, 4])])
def test_a_rollout_rank_rolls_out_only_with_the_steps_expected_policy_version(mode, expected, tmp_path):
    from types import SimpleNamespace

    from pipeline.data import PromptLoader
    from pipeline.dist import Ranks
    from pipeline.separated.placement import Placement
    from pipeline.separated.rollout import SeparatedRollout
    from pipeline.tasks import TASKS
    from pipeline.tasks.reward_scoring import build_rewards

    cfg = load_config(TrainConfig, REPO / "configs" / "tiny.yaml",
                      [*SEPARATED,
                       "trainer.prompts_per_step=4",
                       f"trainer.async_steps={int(mode == 'async')}"])
    # in one process: no job store, nothing sent (the check comes before any transfer)
    placement = Placement(kind="separated", job=Ranks(), actor_ranks=(1,), rollout_ranks=(0,), actors=None, rollouts=Ranks())
    engine = SimpleNamespace(version=2)  # a resumed run at step 3 serves version 3: this one is stale
    task = TASKS["mult"]
    side = SeparatedRollout(cfg.trainer, cfg.rollout, cfg.task, placement, engine, None, build_rewards(cfg.task, task),
                            PromptLoader(task.make_problems("train", 8, 0), 4, 0), [], None, tmp_path, start_step=3,
                            scope="tailspec/test/0")
    assert [side.expected_version(s) for s in (3, 4, 5)] == expected
    with pytest.raises(ValueError, match="policy version 3, the engine serves version 2; refusing a stale policy"):
        side._generate_and_send(3)


def test_a_failed_transfer_names_what_was_moving_and_keeps_the_cause():
    from pipeline.dist import PeerLost, transfer

    with pytest.raises(PeerLost, match="sending step 3's rollouts: .*Connection reset by peer") as caught:
        with transfer("sending step 3's rollouts"):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer.\nmore")
    assert isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(ValueError):  # not a transport failure: left as it is
        with transfer("anything"):
            raise ValueError("a bad config")
