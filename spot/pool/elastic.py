"""The elastic spot pool: drafter training as its own torchrun-elastic job whose members come and go.

A *member* is one torchrun agent with one worker (`--nproc-per-node=1`): a GPU that went idle
joins, a preempted one leaves. The agents meet in a c10d rendezvous (`--nnodes=MIN:MAX`); after a
membership change torchelastic restarts every worker, which calls `run_pool` again: it resumes
from the newest checkpoint in `<out>/checkpoints` (spot.training.trainer) and attaches to its node's
DataBuffer. A member *trains* a micro-step when its node is idle (spot.buffer.gate: a separated run's
rollout ranks are in their tail window or waiting through the actor's update; an ungated buffer,
a colocated run's, is always trainable) and its buffer has rows: it samples rows from its own
node's buffer and runs one SpotTrainer micro-step. The others take the same micro-step with zero
weight: their gradients are zeros. After the backward pass one all-reduce sums the members'
gradients (gloo on CPU, NCCL on GPU) and every member divides by the number that trained, so the
average is exactly the training members' mean gradient, every member takes the same AdamW step
from the same state, and the replicas never diverge: any member's state is the pool's state.

Before each micro-step the members meet (one all-reduce of three counts): *preempted* (a member
got SIGTERM: torchelastic stopping workers for a join, or a spot notice), *finished*
(`micro_steps` reached, or the file `<out>/STOP` exists), and how many members can train. When
none can, each waits (sleeping between looks at its node's gate, so a waiting pool costs no core)
until its node turns idle or `poll_s` has passed, and they meet again. So a flip of a node to
generating stops its member at the next micro-step boundary, and which members train is decided
per micro-step by the gate alone: membership changes only through torchelastic's rendezvous. A
member that trained adds the micro-step's seconds to its node's gate, within the node's idle span
and past it (the run reports them).

A preempted or finished pool checkpoints first, so a join or a noticed preemption loses nothing.
A member killed without notice makes the others' next collective fail: the survivors hold the
state after the last micro-step every member completed (a failed all-reduce happens before the
optimiser step), one of them checkpoints it (`save_once`), and they exit for torchelastic to
restart them: the pool loses at most the micro-step in flight.

Rank 0 publishes the drafter every `publish_every` micro-steps and at the end, atomically and
versioned: `<out>/published/v<N>/` (EagleModel.save's layout, loadable by EagleModel.load and as
`engine.spec.drafter_path`, plus `manifest.json`: each file's size and SHA-256) then
`<out>/published/LATEST` naming it. N counts publications (1, 2, ...), so it only grows across
restarts; config.json records `spot_micro_steps`. Rollout ranks call `latest_published(out)` to
see whether there is a newer drafter, and load it with
`engine.load_drafter_weights(published_weights(path), version)`, which checks the bytes it read
against the manifest: a publication that is not whole is refused by name, never loaded. What a
writer killed mid-write leaves (`v<N>.tmp`, `ckpt-<n>.tmp`, `.ckpt-<n>.claim`, ...) the next
publication or checkpoint removes, so a pool preempted again and again does not fill its disk.

This module knows nothing of torchrun itself (launch/spot_pool.py is the entry point) or of who
fills the buffers and sets their gates (spot.buffer.sink, spot.pool.separated_follower).
"""

from __future__ import annotations

import hashlib
import json
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
from safetensors.torch import load

from common.atomic import atomic_folder, atomic_write
from engine.checkpoint import load_checkpoint
from engine.spec.eagle import EagleModel
from spot.buffer.ring import DataBuffer
from spot.buffer.segment import node_name, node_segment
from spot.training.step import DrafterOptim, Reduce
from spot.buffer.gate import NodeGate
from spot.training.records import HiddenStateRows
from spot.training.trainer import CKPT, SpotTrainer, checkpoint_path, latest_checkpoint

if TYPE_CHECKING:  # a pipeline.dist.Ranks (rank, world, main): spot never imports pipeline at run time
    from pipeline.dist import Ranks

PUBLISHED, LATEST, CHECKPOINTS, STOP = "published", "LATEST", "checkpoints", "STOP"
MANIFEST, WEIGHTS_FILE = "manifest.json", "model.safetensors"
VERSION = re.compile(r"v(\d+)")
LEFTOVER = re.compile(r"\.?(.+?)\.(?:tmp|old|claim)")  # a killed writer's temporaries (common.atomic, save_once)


@dataclass(kw_only=True)
class PoolConfig:
    target: str  # the target model folder (its frozen embedding and LM head are the drafter's)
    drafter: str  # the warm-start drafter folder (EagleModel.save layout): the first member's start
    buffer: str  # the job's DataBuffer name (spot.buffer_name): this node's segment is spot.buffer.segment.node_segment(buffer)
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
    poll_s: float = 0.5  # the longest wait before the members meet again when none can train
    gate_poll_s: float = 0.01  # between looks at the node's gate while waiting (a load from shared memory)
    buffer_wait_s: float = 0.0  # how long to wait for the run to create the buffer (0: it must exist at start)
    log_every: int = 10
    device: str = "cpu"

    def validate(self) -> None:
        counts = {"checkpoint_every": self.checkpoint_every, "publish_every": self.publish_every,
                  "keep_published": self.keep_published, "keep_checkpoints": self.keep_checkpoints,
                  "rows_per_step": self.rows_per_step, "window": self.window, "log_every": self.log_every}
        for key, value in counts.items():
            if value < 1:
                raise ValueError(f"spot pool: {key} must be >= 1, got {value}")
        if self.micro_steps is not None and self.micro_steps < 1:
            raise ValueError(f"spot pool: micro_steps must be >= 1 (or None: until {self.out}/{STOP}), got {self.micro_steps}")
        if not 0.0 <= self.offset_ratio <= 1.0:
            raise ValueError(f"spot pool: offset_ratio must be in [0, 1], got {self.offset_ratio}")
        if self.buffer_wait_s < 0:
            raise ValueError(f"spot pool: buffer_wait_s must be >= 0, got {self.buffer_wait_s}")
        for key, value in {"poll_s": self.poll_s, "gate_poll_s": self.gate_poll_s}.items():
            if value <= 0:
                raise ValueError(f"spot pool: {key} must be > 0, got {value}")
        self.optim()  # ValueError naming a bad optimiser key

    def optim(self) -> DrafterOptim:
        return DrafterOptim.from_config(self, "spot pool: ")


@dataclass(kw_only=True)
class PoolResult:
    outcome: str  # finished | preempted
    micro_steps: int  # the pool's total after this run
    ran: int  # micro-steps this run took
    trained: int  # of those, the ones this member trained on its own rows (the others: zero weight)
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
    vocabulary is not among them: it is fixed by the warm drafter the pool started from), from bytes
    checked against its manifest (ValueError naming the folder when they differ)."""
    state = load(checked_bytes(Path(path), WEIGHTS_FILE))
    state.pop("draft_vocab", None)
    return state


def write_manifest(folder: Path) -> None:
    """folder/manifest.json: the size and SHA-256 of every other file in folder."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def checked_bytes(folder: Path, name: str) -> bytes:
    """The bytes of folder/name, read once, as folder/manifest.json describes them; ValueError otherwise.
    A missing file (a publication pruned while it is read) raises FileNotFoundError."""
    try:
        want = json.loads((folder / MANIFEST).read_text())["files"][name]
    except FileNotFoundError:
        if not folder.is_dir():
            raise  # pruned while read
        raise ValueError(f"published drafter {folder} has no {MANIFEST}: it is not a whole publication; load another "
                         "version or let the pool publish again") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"published drafter {folder}: {MANIFEST} does not describe {name} ({type(e).__name__}: {e}); "
                         "it is not a whole publication: load another version or let the pool publish again") from None
    data = (folder / name).read_bytes()
    if len(data) != want["bytes"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
        raise ValueError(f"published drafter {folder}: {name} is corrupt ({len(data)} bytes, {MANIFEST} says "
                         f"{want['bytes']}, or its SHA-256 differs); load another version or let the pool publish again")
    return data


def publish(model: EagleModel, out: str | Path, micro_steps: int, keep: int) -> tuple[int, Path]:
    """Writes v<N+1> whole, then points LATEST at it, then removes all but the newest `keep` versions."""
    pub = Path(out) / PUBLISHED
    latest = latest_published(out)
    version = (latest[0] if latest else 0) + 1
    folder = pub / f"v{version}"
    with atomic_folder(folder) as tmp:
        model.save(tmp, extra={"spot_micro_steps": micro_steps})
        write_manifest(tmp)
    atomic_write(pub / LATEST, lambda p: p.write_text(folder.name + "\n"))
    for old in pub.iterdir():
        if (m := VERSION.fullmatch(old.name)) and int(m[1]) <= version - keep:
            retire(old)
    remove_leftovers(pub, VERSION, version)
    return version, folder


def retire(folder: Path) -> None:
    """Deletes a publication so that a reader finds it whole or not at all: renamed aside (atomic), then
    removed. A reader mid-way through it gets FileNotFoundError (pruned), never a folder without its manifest."""
    aside = folder.with_name(folder.name + ".old")
    shutil.rmtree(aside, ignore_errors=True)
    try:
        os.replace(folder, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def remove_leftovers(folder: Path, names: re.Pattern, below: int) -> None:
    """Removes what a writer killed mid-write left beside the versions `names` matches: common.atomic's
    `<name>.tmp` / `<name>.old` and save_once's `.<name>.claim` of versions below `below` (members all
    write the same version at a time, so an older one is nobody's write in flight)."""
    for p in folder.iterdir():
        m = LEFTOVER.fullmatch(p.name)
        if m and (v := names.fullmatch(m[1])) and int(v[1]) < below:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


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
    remove_leftovers(folder, CKPT, trainer.micro_steps)
    return path


# -- the members' collectives ----------------------------------------------------------------------

@dataclass(frozen=True)
class Meeting:
    """What the members agreed before a micro-step."""

    stop: bool  # a member was preempted
    finish: bool  # a member saw the end (micro_steps reached, or <out>/STOP)
    trainers: int  # members that can train it (their node idle, their buffer with rows)


class Members:
    """The pool's collectives: the meeting before each micro-step and the gradient average. A
    collective that fails (a member vanished: gloo sees its sockets reset) is recorded in `failed`
    and re-raised."""

    def __init__(self, r: Ranks, device: str) -> None:
        self.r, self.device = r, device
        self.failed: RuntimeError | None = None

    def all_reduce(self, t: torch.Tensor) -> None:
        try:
            dist.all_reduce(t)
        except RuntimeError as e:
            self.failed = e
            raise

    def meet(self, preempted: bool, finish: bool, trains: bool) -> Meeting:
        """One all-reduce (a sum) of the three: a flag holds when any member sets it."""
        counts = torch.tensor([float(preempted), float(finish), float(trains)], device=self.device)
        if self.r.world > 1:
            self.all_reduce(counts)
        stop, done, trainers = counts.tolist()
        return Meeting(stop=stop > 0, finish=done > 0, trainers=round(trainers))

    def gradient_average(self, trainers: int) -> Reduce | None:
        """The members' mean gradient over the `trainers` that trained (those that did not give
        zeros), for DrafterTrainer: one all-reduce of the flattened gradients; None alone."""
        if self.r.world == 1:
            return None
        assert trainers >= 1, "a micro-step nobody trains is not taken"

        def reduce(params: list[torch.nn.Parameter]) -> None:
            params = [p for p in params if p.requires_grad]
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            self.all_reduce(flat)
            flat.div_(trainers)
            for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
                p.grad = g.view_as(p)

        return reduce


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
    buf = attach_buffer(cfg)
    if buf.feature_size != model.config.feature_size:
        buf.close()
        raise ValueError(f"spot pool: buffer {cfg.buffer} holds features of size {buf.feature_size}, the drafter "
                         f"{cfg.drafter} reads {model.config.feature_size}: the buffer is another target's or kind's")
    return model, buf


def attach_buffer(cfg: PoolConfig) -> DataBuffer:
    """The node's buffer, waited for up to `buffer_wait_s` (the run creates it as it starts),
    looking every `poll_s`."""
    deadline = time.monotonic() + cfg.buffer_wait_s
    while True:
        try:
            return DataBuffer.attach(node_segment(cfg.buffer))
        except FileNotFoundError as e:
            if time.monotonic() >= deadline:
                raise FileNotFoundError(f"spot pool: {e} (--buffer {cfg.buffer} on node {node_name()}, waited {cfg.buffer_wait_s:g}s: start "
                                        "the rollout job that creates it on this node first, pass the name it prints, "
                                        "or wait longer with --buffer-wait-s)") from None
        time.sleep(cfg.poll_s)


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
        return train_members(cfg, Members(r, cfg.device), trainer, buf, preempted)
    finally:
        buf.close()


def wait_for_work(cfg: PoolConfig, gate: NodeGate, out: Path, preempted: Callable[[], bool]) -> None:
    """No member could train: waits until this member's node turns trainable (when it was not),
    the member is preempted, <out>/STOP appears, or `poll_s` has passed, sleeping `gate_poll_s`
    between looks (a load from shared memory and a stat)."""
    was = gate.trainable()
    deadline = time.monotonic() + cfg.poll_s
    while time.monotonic() < deadline:
        if preempted() or (out / STOP).exists() or (not was and gate.trainable()):
            return
        time.sleep(cfg.gate_poll_s)


def train_members(cfg: PoolConfig, members: Members, trainer: SpotTrainer, buf: DataBuffer,
                  preempted: Callable[[], bool]) -> PoolResult:
    r = members.r
    out, start, t0 = Path(cfg.out), trainer.micro_steps, time.perf_counter()
    ckpts, gate = out / CHECKPOINTS, NodeGate(buf)
    gated = f"gated by {gate.ranks} rollout rank(s)" if gate.ranks else "not gated: trains whenever it has rows"
    log(r, f"members {r.world}, micro-step {start}, buffer {buf.name} ({int(buf.stats()['buffer/entries'])} entries, "
           f"{gated})")
    waiting, losses, top1, trained = None, [], [], 0
    published, published_at = (latest_published(out) if r.main else None), None
    try:
        while True:
            finish = (cfg.micro_steps is not None and trainer.micro_steps >= cfg.micro_steps) or (out / STOP).exists()
            trainable = not finish and gate.trainable()
            rows = sample_rows(buf, cfg, r.rank, trainer.micro_steps) if trainable else []
            meeting = members.meet(preempted(), finish, bool(rows))
            if meeting.stop or meeting.finish:
                break
            if meeting.trainers == 0:
                why = f"for rows in buffer {buf.name}" if trainable else "while the node's rollout ranks generate"
                if waiting != why:
                    log(r, f"waiting {why}")
                    waiting = why
                wait_for_work(cfg, gate, out, preempted)
                continue
            waiting = None
            reduce = members.gradient_average(meeting.trainers)
            if rows:
                t = time.time()
                m = trainer.micro_step(rows, reduce=reduce)
                gate.add_training(t, time.time())
                trained += 1
                losses.append(m["spot/drafter_loss"])
                top1.append(m["spot/top1"])
            else:
                trainer.zero_micro_step(reduce)
            n = trainer.micro_steps
            if r.main and n % cfg.checkpoint_every == 0:
                save_once(trainer, ckpts, cfg.keep_checkpoints)
            if r.main and n % cfg.publish_every == 0:
                published, published_at = publish(trainer.model, out, n, cfg.keep_published), n
            if r.main and (n % cfg.log_every == 0 or n == start + 1):
                k = min(len(losses), cfg.log_every)
                rate = (n - start) / (time.perf_counter() - t0)
                mean = f"loss {sum(losses[-k:]) / k:.4f} top1 {sum(top1[-k:]) / k:.3f}" if k else "loss - top1 -"
                log(r, f"micro-step {n} {mean} members {r.world} trainers {meeting.trainers} rows {len(rows)} "
                       f"{rate:.1f} micro-steps/s" + (f" published v{published[0]}" if published else ""))
    except RuntimeError as e:
        if members.failed is None:
            raise
        path = save_once(trainer, ckpts, cfg.keep_checkpoints)
        raise MemberLost(f"a member left during micro-step {trainer.micro_steps + 1} ({type(e).__name__}); "
                         f"{'saved ' + path.name if path else 'its state is checkpointed by another member'}; "
                         "torchelastic restarts the pool") from e
    n = trainer.micro_steps
    outcome = "preempted" if meeting.stop else "finished"
    if r.main:
        save_once(trainer, ckpts, cfg.keep_checkpoints)
        if outcome == "finished" and published_at != n:
            published = publish(trainer.model, out, n, cfg.keep_published)
    log(r, f"{outcome} at micro-step {n} ({n - start} this run, {trained} on its own rows, "
           f"{time.perf_counter() - t0:.1f}s), weights {weights_digest(trainer)}")
    return PoolResult(outcome=outcome, micro_steps=n, ran=n - start, trained=trained,
                      published=published[0] if published else None)
