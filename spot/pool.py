"""The elastic spot pool: drafter training as its own torchrun-elastic job whose members come and go.

A *member* is one torchrun agent with one worker (`--nproc-per-node=1`): a GPU that went idle
joins, a preempted one leaves. The agents meet in a c10d rendezvous (`--nnodes=MIN:MAX`); after a
membership change torchelastic restarts every worker, which calls `run_pool` again: it resumes
from the newest checkpoint in `<out>/checkpoints` (spot.trainer) and attaches to its node's
DataBuffer. Each *micro-step* every member samples rows from its own node's buffer and runs one
SpotTrainer micro-step; gradients are averaged across members by an all-reduce inside the backward
pass (gloo on CPU, NCCL on GPU), so every member takes the same AdamW step from the same state and
the replicas never diverge: any member's state is the pool's state.

Before each micro-step the members agree (one all-reduce of three flags) on whether to stop:
*preempted* (a member got SIGTERM: torchelastic stopping workers for a join, or a spot notice),
*finished* (`micro_steps` reached, or the file `<out>/STOP` exists), or *waiting* (a buffer has no
rows yet). A preempted or finished pool checkpoints first, so a join or a noticed preemption loses
nothing. A member killed without notice makes the others' next collective fail: the survivors
hold the state after the last micro-step every member completed (a failed all-reduce happens
before the optimiser step), one of them checkpoints it (`save_once`), and they exit for
torchelastic to restart them: the pool loses at most the micro-step in flight.

Rank 0 publishes the drafter every `publish_every` micro-steps and at the end, atomically and
versioned: `<out>/published/v<N>/` (EagleModel.save's layout, loadable by EagleModel.load and as
`engine.spec.drafter_path`) then `<out>/published/LATEST` naming it. N counts publications (1, 2,
...), so it only grows across restarts; config.json records `spot_micro_steps`. Rollout ranks
call `latest_published(out)` to see whether there is a newer drafter, and load it with
`engine.load_drafter_weights(published_weights(path), version)`.

This module knows nothing of torchrun itself (launch/spot_pool.py is the entry point) or of who
fills the buffers (spot.sink).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from common.atomic import atomic_folder, atomic_write
from engine.checkpoint import load_checkpoint
from engine.spec.eagle import EagleModel
from spot.buffer import DataBuffer
from spot.drafter_training import DrafterOptim
from spot.records import HiddenStateRows
from spot.trainer import CKPT, SpotTrainer, checkpoint_path, latest_checkpoint

if TYPE_CHECKING:  # a pipeline.dist.Ranks (rank, world, main): spot never imports pipeline at run time
    from pipeline.dist import Ranks

PUBLISHED, LATEST, CHECKPOINTS, STOP = "published", "LATEST", "checkpoints", "STOP"
VERSION = re.compile(r"v(\d+)")


@dataclass(kw_only=True)
class PoolConfig:
    target: str  # the target model folder (its frozen embedding and LM head are the drafter's)
    drafter: str  # the warm-start drafter folder (EagleModel.save layout): the first member's start
    buffer: str  # the node's DataBuffer segment name (spot.buffer.segment_name)
    out: str  # checkpoints/, published/ and STOP live here: a folder every member sees (a shared file system)
    micro_steps: int | None = None  # stop after this many (over the pool's life); None: until <out>/STOP
    checkpoint_every: int = 50
    publish_every: int = 50
    keep_published: int = 3  # older versions are removed (a rollout rank loads within that many publications)
    keep_checkpoints: int = 2
    rows_per_step: int = 8
    window: int = 256
    offset_ratio: float = 0.25  # share of the previous RL step's long rows (DataBuffer.sample)
    # The drafter's optimiser: the keys of the rollout job's `spot:` section (spot.config), so a pool
    # and colocated spot training given the same values take the same steps.
    lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = DrafterOptim.weight_decay
    grad_clip: float = DrafterOptim.grad_clip
    ce_weight: float = DrafterOptim.ce_weight
    seed: int = 0
    poll_s: float = 0.5  # wait between looks at an empty buffer
    log_every: int = 10
    device: str = "cpu"

    def validate(self) -> None:
        for key in ("checkpoint_every", "publish_every", "keep_published", "keep_checkpoints", "rows_per_step",
                    "window", "log_every"):
            if getattr(self, key) < 1:
                raise ValueError(f"spot pool: {key} must be >= 1, got {getattr(self, key)}")
        if self.micro_steps is not None and self.micro_steps < 1:
            raise ValueError(f"spot pool: micro_steps must be >= 1 (or None: until {self.out}/{STOP}), got {self.micro_steps}")
        if not 0.0 <= self.offset_ratio <= 1.0:
            raise ValueError(f"spot pool: offset_ratio must be in [0, 1], got {self.offset_ratio}")
        if self.poll_s <= 0:
            raise ValueError(f"spot pool: poll_s must be > 0, got {self.poll_s}")
        self.optim()  # ValueError naming a bad optimiser key

    def optim(self) -> DrafterOptim:
        return DrafterOptim.from_config(self, "spot pool: ")


@dataclass(kw_only=True)
class PoolResult:
    outcome: str  # finished | preempted
    micro_steps: int  # the pool's total after this run
    ran: int  # micro-steps this run took
    published: int | None  # the latest version after this run


class MemberLost(RuntimeError):
    """A collective failed: another member is gone. The state was checkpointed; torchelastic restarts the pool."""


def log(r: Ranks, msg: str) -> None:
    print(f"[spot-pool {r.rank}/{r.world}] {msg}", file=sys.stderr, flush=True)


# -- publishing ------------------------------------------------------------------------------------

def latest_published(out: str | Path) -> tuple[int, Path] | None:
    """(version, folder) of the newest published drafter under out, or None before the first publication."""
    pub = Path(out) / PUBLISHED
    try:
        name = (pub / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    m = VERSION.fullmatch(name)
    if m is None or not (pub / name).is_dir():
        raise ValueError(f"{pub / LATEST} names {name!r}, which is not a published drafter folder under {pub}")
    return int(m[1]), pub / name


def published_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A published drafter's trainable weights, named for engine.load_drafter_weights (the draft
    vocabulary is not among them: it is fixed by the warm drafter the pool started from)."""
    state = load_file(str(Path(path) / "model.safetensors"))
    state.pop("draft_vocab", None)
    return state


def publish(model: EagleModel, out: str | Path, micro_steps: int, keep: int) -> tuple[int, Path]:
    """Writes v<N+1> whole, then points LATEST at it, then removes all but the newest `keep` versions."""
    pub = Path(out) / PUBLISHED
    latest = latest_published(out)
    version = (latest[0] if latest else 0) + 1
    folder = pub / f"v{version}"
    with atomic_folder(folder) as tmp:
        model.save(tmp, extra={"spot_micro_steps": micro_steps})
    atomic_write(pub / LATEST, lambda p: p.write_text(folder.name + "\n"))
    for old in pub.iterdir():
        if (m := VERSION.fullmatch(old.name)) and int(m[1]) <= version - keep:
            shutil.rmtree(old, ignore_errors=True)
    return version, folder


# -- checkpoints -----------------------------------------------------------------------------------

def save_once(trainer: SpotTrainer, folder: Path, keep: int) -> Path | None:
    """Writes ckpt-<micro_steps> unless it exists or another member is writing it (an O_EXCL claim file:
    after a member dies every survivor holds the same state and tries); prunes to the newest `keep`."""
    path = checkpoint_path(folder, trainer.micro_steps)
    folder.mkdir(parents=True, exist_ok=True)
    claim = folder / f".{path.name}.claim"
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return None
    try:
        os.close(fd)
        if latest_checkpoint(folder) == path:
            return None
        trainer.save(path)
    finally:
        claim.unlink()
    found = sorted((int(m[1]), p) for p in folder.iterdir() if (m := CKPT.fullmatch(p.name)))
    for _, old in found[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


# -- the members' collectives ----------------------------------------------------------------------

class Members:
    """The pool's collectives: the gradient average and the stop agreement. A collective that fails
    (a member vanished: gloo sees its sockets reset) is recorded in `failed` and re-raised."""

    def __init__(self, r: Ranks, device: str) -> None:
        self.r, self.device = r, device
        self.failed: RuntimeError | None = None

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        try:
            dist.all_reduce(t, op=op)
        except RuntimeError as e:
            self.failed = e
            raise

    def average_gradients(self, model: torch.nn.Module) -> list:
        """Hooks that all-reduce each gradient as backward accumulates it, then divide by the world: the
        optimiser (and its clipping) sees the members' mean gradient. -> the hook handles."""
        def hook(p: torch.Tensor) -> None:
            self.all_reduce(p.grad)
            p.grad.div_(self.r.world)

        return [p.register_post_accumulate_grad_hook(hook) for p in model.parameters() if p.requires_grad]

    def agree(self, flags: list[bool]) -> list[bool]:
        """Each flag is true on every member when it is true on any."""
        if self.r.world == 1:
            return flags
        t = torch.tensor([float(f) for f in flags], device=self.device)
        self.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]


def resume_point(r: Ranks, folder: Path) -> Path | None:
    """The checkpoint rank 0 sees as newest, the same on every member."""
    name = [None]
    if r.main:
        path = latest_checkpoint(folder)
        name = [path.name if path else None]
    if r.world > 1:
        dist.broadcast_object_list(name, src=0)
    return folder / name[0] if name[0] else None


def weights_digest(trainer: SpotTrainer) -> str:
    """A short hash of the trainable weights: equal on every member while the replicas agree."""
    h = hashlib.sha256()
    for _, t in trainer.named_weights():
        h.update(t.float().cpu().numpy().tobytes())
    return h.hexdigest()[:12]


# -- rows ------------------------------------------------------------------------------------------

def sample_key(seed: int, rank: int, micro_step: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}/{rank}/{micro_step}".encode(), digest_size=8).digest(), "little")


def sample_rows(buf: DataBuffer, cfg: PoolConfig, rank: int, micro_step: int) -> list[HiddenStateRows]:
    """rows_per_step entries of the newest RL step in the buffer (mixed with the step before), keyed."""
    infos = buf.infos()
    if not infos:
        return []
    step = max(i.step for i in infos)
    g = torch.Generator().manual_seed(sample_key(cfg.seed, rank, micro_step))
    entries = buf.sample(cfg.rows_per_step, step=step, offset_ratio=cfg.offset_ratio, generator=g)
    return [e.to_row() for e in entries if e.length > e.prompt_len]


# -- a member's run --------------------------------------------------------------------------------

def open_inputs(cfg: PoolConfig) -> tuple[EagleModel, DataBuffer]:
    """The drafter (on its target) and the node's buffer; FileNotFoundError / ValueError naming what is wrong."""
    if not Path(cfg.target).is_dir():
        raise FileNotFoundError(f"spot pool: target model folder {cfg.target} does not exist (--target)")
    target = load_checkpoint(cfg.target, device=cfg.device)
    model = EagleModel.load(cfg.drafter, target).to(cfg.device)
    try:
        buf = DataBuffer.attach(cfg.buffer)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"spot pool: {e} (--buffer {cfg.buffer}: start the rollout job that creates it on "
                                "this node first, or pass the name it prints)") from None
    if buf.feature_size != model.config.feature_size:
        buf.close()
        raise ValueError(f"spot pool: buffer {cfg.buffer} holds features of size {buf.feature_size}, the drafter "
                         f"{cfg.drafter} reads {model.config.feature_size}: the buffer is another target's or kind's")
    return model, buf


def make_trainer(cfg: PoolConfig, r: Ranks, model: EagleModel) -> SpotTrainer:
    optim = cfg.optim()
    ckpt = resume_point(r, Path(cfg.out) / CHECKPOINTS)
    # One backward a micro-step (chunk_windows None): the members' gradient hooks all-reduce per backward,
    # and members whose windows differ in number must still meet in the same collectives.
    kw = dict(window=cfg.window, rows_per_step=cfg.rows_per_step, seed=cfg.seed, chunk_windows=None)
    if ckpt is None:
        log(r, f"starting from the warm drafter {cfg.drafter}")
        return SpotTrainer(model, optim, **kw)
    trainer = SpotTrainer.resume(ckpt, model, optim, **kw)
    log(r, f"resumed from {ckpt.name} at micro-step {trainer.micro_steps}")
    return trainer


def run_pool(cfg: PoolConfig, r: Ranks, preempted: Callable[[], bool]) -> PoolResult:
    """One member's life between two membership changes (see the module docstring)."""
    cfg.validate()
    model, buf = open_inputs(cfg)
    try:
        trainer = make_trainer(cfg, r, model)
        members = Members(r, cfg.device)
        hooks = members.average_gradients(model) if r.world > 1 else []
        try:
            return train_members(cfg, members, trainer, buf, preempted)
        finally:
            for h in hooks:
                h.remove()
    finally:
        buf.close()


def train_members(cfg: PoolConfig, members: Members, trainer: SpotTrainer, buf: DataBuffer,
                  preempted: Callable[[], bool]) -> PoolResult:
    r = members.r
    out, start, t0 = Path(cfg.out), trainer.micro_steps, time.perf_counter()
    ckpts = out / CHECKPOINTS
    log(r, f"members {r.world}, micro-step {start}, buffer {buf.name} ({int(buf.stats()['buffer/entries'])} entries)")
    waiting_logged, losses, top1 = False, [], []
    published, published_at = (latest_published(out) if r.main else None), None
    try:
        while True:
            done = cfg.micro_steps is not None and trainer.micro_steps >= cfg.micro_steps
            rows = [] if done else sample_rows(buf, cfg, r.rank, trainer.micro_steps)
            stop, finish, wait = members.agree([preempted(), done or (out / STOP).exists(), not rows])
            if stop or finish:
                break
            if wait:
                if not waiting_logged:
                    log(r, f"waiting for rows in buffer {buf.name}")
                    waiting_logged = True
                time.sleep(cfg.poll_s)
                continue
            m = trainer.micro_step(rows)
            losses.append(m["spot/drafter_loss"])
            top1.append(m["spot/top1"])
            n = trainer.micro_steps
            if r.main and n % cfg.checkpoint_every == 0:
                save_once(trainer, ckpts, cfg.keep_checkpoints)
            if r.main and n % cfg.publish_every == 0:
                published, published_at = publish(trainer.model, out, n, cfg.keep_published), n
            if r.main and (n % cfg.log_every == 0 or n == start + 1):
                k = min(len(losses), cfg.log_every)
                rate = (n - start) / (time.perf_counter() - t0)
                log(r, f"micro-step {n} loss {sum(losses[-k:]) / k:.4f} top1 {sum(top1[-k:]) / k:.3f} "
                       f"members {r.world} rows {len(rows)} {rate:.1f} micro-steps/s"
                       + (f" published v{published[0]}" if published else ""))
    except RuntimeError as e:
        if members.failed is None:
            raise
        path = save_once(trainer, ckpts, cfg.keep_checkpoints)
        raise MemberLost(f"a member left during micro-step {trainer.micro_steps + 1} ({type(e).__name__}); "
                         f"{'saved ' + path.name if path else 'its state is checkpointed by another member'}; "
                         "torchelastic restarts the pool") from e
    n = trainer.micro_steps
    outcome = "preempted" if stop else "finished"
    if r.main:
        save_once(trainer, ckpts, cfg.keep_checkpoints)
        if outcome == "finished" and published_at != n:
            published = publish(trainer.model, out, n, cfg.keep_published)
    log(r, f"{outcome} at micro-step {n} ({n - start} this run, {time.perf_counter() - t0:.1f}s), "
           f"weights {weights_digest(trainer)}")
    return PoolResult(outcome=outcome, micro_steps=n, ran=n - start, published=published[0] if published else None)
