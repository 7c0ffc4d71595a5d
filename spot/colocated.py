"""Spot training on the rollout ranks: the pieces one rank needs, built from the config.

`build_spot_work` attaches a DataBufferSink to the rank's engine, creates the node's DataBuffer
(local rank 0; the others attach after a barrier; a crashed run's stale segments are reclaimed
first), and wraps a SpotTrainer around a *copy* of the engine's EAGLE drafter: the engine's own
drafter only ever changes through `load_drafter_weights`, so it never serves half-trained weights.
With `spot.mode: pool` the rank only fills the buffer and follows an
external pool's publications (spot.pool.follower). `SpotRun.close()` detaches, and the creator removes the segment (also at interpreter exit).

An engine that returns no hidden states (engine.backend=vllm: its drafter lives in vLLM's workers)
gets no sink: the buffer is filled from the actor's log-prob forward (`SpotRun.actor_features`,
spot.buffer.actor_features, which the loop calls), and the trained copy starts from the drafter folder
(engine.spec.drafter_path) over a HeadTarget that follows the policy's weight syncs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from engine.checkpoint import parse_dtype, read_config
from engine.spec.eagle import EagleModel
from spot.buffer.actor_features import ActorFeatures, HeadTarget
from spot.buffer.ring import DataBuffer
from spot.buffer.segment import node_segment, reclaim_stale, segment_name
from spot.config import SpotConfig
from common.idle import ControlPlane, IdleWork
from engine.backend import RolloutBackend
from spot.coordinator import SpotSettings, SpotWork
from spot.buffer.sink import DataBufferSink
from spot.training.trainer import SpotTrainer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class SpotRun:
    work: IdleWork  # a SpotWork, or a spot.pool.follower.PoolFollower (spot.mode: pool)
    engine: RolloutBackend
    buffer: DataBuffer
    owner: bool
    actor_features: ActorFeatures | None = None  # engines without hidden states: the loop fills the buffer
    group: object | None = None  # the window end's process group (SpotWork's average)
    before_close: Callable[[], None] | None = None  # the work's last word (a pool follower clears its gate slot)

    def close(self) -> None:
        if self.before_close is not None:
            self.before_close()
        self.engine.sink = None
        if self.group is not None:
            dist.destroy_process_group(self.group)
        self.buffer.close()
        if self.owner:
            self.buffer.unlink()


def drafter_copy(net: EagleModel) -> EagleModel:
    """A trainable copy of an engine drafter's network, sharing its (frozen) target."""
    vocab = net.draft_vocab.clone() if net.draft_vocab.numel() else None
    copy = EagleModel(net.config, net.target, vocab).to(net.fc.weight.device, net.fc.weight.dtype)
    copy.load_state_dict(net.state_dict())
    return copy


def build_spot_work(cfg: SpotConfig, engine: RolloutBackend, *, run_name: str, rank: int, local_rank: int, world: int,
                    seed: int, max_new_tokens: int, store=None, resume: Path | None = None) -> SpotRun:
    """`store`: the job's store (the control plane; None alone); `resume`: a checkpoint folder
    whose `spot/` the trainer continues from (the work's own state is loaded by the caller)."""
    from_actor = not engine.caps.returns_features  # no hidden states from the engine: from the actor's forward
    nets = [served_drafter(engine)] if from_actor else engine.drafter_nets()
    if len(nets) != 1 or not isinstance(nets[0], EagleModel):
        raise ValueError("spot.enabled needs a speculative engine with one EAGLE drafter (engine.spec.enabled: true, "
                         "engine.spec.drafter: eagle or eagle3, engine.spec.drafter_path: a warm-started drafter)")
    net = nets[0]
    owner = local_rank == 0
    buffer = node_buffer(cfg, net, segment_name(run_name), owner, dist.barrier if world > 1 else None)
    features = None
    if from_actor:
        features = sink = ActorFeatures(buffer, max_new_tokens=max_new_tokens, feature_layers=net.config.aux_layers,
                                        num_layers=net.target.config.num_hidden_layers, head=net.target)
    else:
        sink = DataBufferSink(buffer, max_new_tokens=max_new_tokens, feature_layers=net.config.aux_layers)
        engine.sink = sink
    if cfg.mode == "pool":
        from spot.pool.follower import PoolFollower

        return SpotRun(work=PoolFollower(engine, buffer, sink, cfg.pool_dir, store, rank), engine=engine, buffer=buffer,
                       owner=owner, actor_features=features)
    model = net if from_actor else drafter_copy(net)  # the served one lives in vLLM: this is a copy already
    trainer = spot_trainer(cfg, model, seed * 1000 + rank, resume)
    control = ControlPlane(store, rank, world) if store is not None else None
    settings = SpotSettings(rows_per_step=cfg.rows_per_step, offset_ratio=cfg.offset_ratio,
                            max_micro_steps=cfg.max_micro_steps, seed=seed)
    group = dist.new_group() if world > 1 else None  # the window end's average runs beside the actor's collectives
    work = SpotWork(engine, trainer, buffer, sink, control, settings, group)
    return SpotRun(work=work, engine=engine, buffer=buffer, owner=owner, actor_features=features, group=group)


def node_buffer(cfg: SpotConfig, net: EagleModel, default_name: str, owner: bool, barrier,
                gate_ranks: int = 0) -> DataBuffer:
    """The node's DataBuffer (this node's segment of spot.buffer_name, else `default_name`): the owner reclaims a crashed
    run's segments and creates it, the other ranks of the node attach after `barrier()` (a
    collective of every rank that builds it; None alone). `gate_ranks`: the node's ranks that
    gate a spot pool's members (spot.buffer.gate; 0: ungated)."""
    name = node_segment(cfg.buffer_name) if cfg.buffer_name else default_name
    if owner:
        reclaim_stale()
        buffer = DataBuffer.create(name, capacity_bytes=cfg.buffer_mb * 2**20, feature_size=net.config.feature_size,
                                   dtype=DTYPES[cfg.feature_dtype], max_entries=cfg.buffer_entries,
                                   gate_ranks=gate_ranks)
    if barrier is not None:
        barrier()
    return buffer if owner else DataBuffer.attach(name)


def spot_trainer(cfg: SpotConfig, model: EagleModel, seed: int, resume: Path | None) -> SpotTrainer:
    """A SpotTrainer of `model` (the rank's own copy), continued from a checkpoint's `spot/` when there is one."""
    kw = dict(window=cfg.window, rows_per_step=cfg.rows_per_step, seed=seed, chunk_windows=cfg.chunk_windows)
    if resume is not None and (resume / "spot").is_dir():
        return SpotTrainer.resume(resume / "spot", model, cfg.optim(), **kw)
    return SpotTrainer(model, cfg.optim(), **kw)


def served_drafter(engine) -> EagleModel | None:
    """The drafter an engine without in-process drafter networks serves, loaded from its folder
    (engine.spec.drafter_path) over a HeadTarget; None when it serves no EAGLE drafter."""
    spec = engine.cfg.spec
    if not (spec.enabled and spec.drafter_spec.learned is not None and spec.drafter_path):
        return None
    head = HeadTarget(read_config(engine.path), device=engine.cfg.device, dtype=parse_dtype(engine.cfg.dtype))
    return EagleModel.load(spec.drafter_path, head)
