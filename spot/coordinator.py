"""The rank coordinator: spot training in each rank's idle window, one drafter for all ranks.

Per rank and step, a state machine kept in the job's TCPStore (common.idle.states, the control
plane: no Redis, ZMQ or Ray):

    GENERATING --rollouts done--> IDLE --spot work--> TRAINING --last rank done--> BARRIER

`SpotWork` is the loop's idle-window hook (common.idle.IdleWork), the last part of a window
(common.idle.ScheduledIdle: after any bubble pre-generation). While a rank generates, its
engine's feature sink collects the target's features (stashed when its rollouts are done,
`rollouts_done`) and the rank puts them into the node's DataBuffer as its window opens, except on
the rank that finished last (common.idle.rules). In the window the rank trains its copy of the
drafter on buffer samples (the current step's finished responses mixed with the previous step's
long ones) and checks before each micro-step and after each chunk's forward and backward inside
it (spot.training.trainer) whether every rank is done, so it stops within about half a chunk of the
window's end; the micro-step in flight is kept on its chunks done (the chunk in flight is
dropped). Then the replicas are averaged, each weighted by the micro-steps it ran (one
all-reduce: gloo on CPU, NCCL on GPU; a rank that ran none counts zero), and every rank loads the
average into its engine as a new drafter version before the next step. Each rank keeps its own
AdamW moments (local-SGD style): only weights are averaged. The all-reduce, which also gathers
every rank's window statistics, is posted as the window ends and not waited for (`post_average`,
on a process group of its own): it runs while the step goes on through the actor's update, and
the loop calls `settle()` after the update to load the average and report the window's metrics.

Time is accounted honestly: a rank's idle time is from its rollouts' end to the last rank's
(`IdleWindow.all_done_at`); training within it counts towards `spot/utilisation`; training past
it is `spot/overrun_s`, time the step pays for spot training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.idle import ControlPlane, IdleWindow, IdleWork, RankState
from spot.buffer.ring import DataBuffer
from spot.buffer.sink import put_as_window_opens
from spot.training.trainer import SpotTrainer


STATS = ("micro_steps", "train_s", "idle_s", "loss_sum", "top1_sum", "aborted", "dropped_s", "overrun_s")  # per rank


@dataclass
class PendingAverage:
    """The window end's one collective, posted and not yet waited for: one float32 buffer
    [sum_r w_r theta_r (N), sum_r w_r, every rank's K statistics in its own slot (world x K)]."""

    named: list[tuple[str, torch.Tensor]]
    buf: torch.Tensor
    work: object | None  # the async all-reduce's handle (None: a single process)
    world: int
    k: int = len(STATS)  # statistics per rank

    def result(self) -> tuple[list[tuple[str, torch.Tensor]] | None, torch.Tensor]:
        """Waits; -> (the weighted average, or None when every weight was 0; every rank's statistics [world, K])."""
        if self.work is not None:
            self.work.wait()
        sizes = [t.numel() for _, t in self.named]
        N = sum(sizes)
        stats = self.buf[N + 1 :].view(self.world, self.k).double()
        total = float(self.buf[N])
        if total <= 0:
            return None, stats
        avg = self.buf[:N].div_(total)
        return [(name, a.view(t.shape).to(t.dtype)) for (name, t), a in zip(self.named, avg.split(sizes))], stats


def post_average(named: list[tuple[str, torch.Tensor]], weight: float, stats: list[float] | None = None,
                 group=None, k: int = len(STATS)) -> PendingAverage:
    """Starts sum_r w_r * theta_r / sum_r w_r over the process group (`group`; None: the default
    one) in one all-reduce that does not block, with this rank's `stats` (k values: STATS by
    default) gathered in the same buffer; `PendingAverage.result()` waits. Identical on every
    rank: an all-reduce hands every rank the same sum. A rank of weight 0 sends zeros without
    reading its weights. float32: the drafter's dtype (float64 would double the bytes on the
    critical path of nothing but cost)."""
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if distributed else (1, 0)
    N = sum(t.numel() for _, t in named)
    buf = torch.zeros(N + 1 + world * k, dtype=torch.float32, device=named[0][1].device)
    if weight:
        buf[:N].copy_(torch.cat([t.detach().reshape(-1) for _, t in named])).mul_(weight)
        buf[N] = weight
    if stats is not None:
        if len(stats) != k:
            raise ValueError(f"post_average: {len(stats)} statistics given, the buffer holds {k} per rank")
        buf[N + 1 + rank * k : N + 1 + (rank + 1) * k] = torch.tensor(stats, dtype=torch.float32)
    work = dist.all_reduce(buf, group=group, async_op=True) if distributed else None
    return PendingAverage(named, buf, work, world, k)


@dataclass(frozen=True)
class FilledTime:
    """How training from t0 to t1 filled an idle span from `started` to `end` (one clock)."""

    useful_s: float  # training within the idle span: what spot/utilisation counts
    idle_s: float  # the idle span
    overrun_s: float  # training past the span's end: time the step paid for spot training

    @classmethod
    def of(cls, t0: float, t1: float, started: float, end: float) -> FilledTime:
        return cls(useful_s=max(0.0, min(t1, end) - t0), idle_s=max(0.0, end - started),
                   overrun_s=max(0.0, t1 - max(end, t0)))


@dataclass(kw_only=True)
class SpotSettings:
    rows_per_step: int = 8  # buffer entries per micro-step
    offset_ratio: float = 0.25  # share of the previous step's long responses in a sample
    max_micro_steps: int | None = None  # per window; None: until the window ends
    seed: int = 0


class ServedDrafterState:
    """Checkpoint methods of a spot work whose `trainer` (a SpotTrainer) trains the drafter that its
    `engine` serves as `drafter_version`: the trainer's folder and the served version go into the
    run's checkpoint, and a resumed run serves the checkpoint's drafter as that version again."""

    def checkpoint_files(self):
        return {"spot": self.trainer.save}

    def state_dict(self) -> dict:
        return {"drafter_version": self.drafter_version}

    def load_state_dict(self, state: dict) -> None:
        """A resumed run's: the engine serves the checkpoint's drafter (the trainer's copy, loaded
        from the checkpoint's spot/ folder) as the version the stopped run served."""
        self.drafter_version = int(state["drafter_version"])
        self.engine.load_drafter_weights(self.trainer.named_weights(), version=self.drafter_version)


class SpotWork(ServedDrafterState, IdleWork):
    """Spot training in the idle window, on one rank (common.idle.IdleWork)."""

    name = "spot"

    def __init__(self, engine, trainer: SpotTrainer, buffer: DataBuffer, sink, control: ControlPlane | None,
                 settings: SpotSettings, group=None) -> None:
        self.engine, self.trainer, self.buffer, self.sink = engine, trainer, buffer, sink
        self.control, self.settings = control, settings
        self.group = group  # the window end's collective (None: the default group; spot.colocated makes one of its own)
        self.pending: PendingAverage | None = None  # the last window's average, posted, not yet settled
        self.drafter_version = 0
        self.generator = torch.Generator().manual_seed(settings.seed * 1000 + (control.rank if control else 0))

    # -- checkpoints: ServedDrafterState (rank 0 writes them, every rank resumes from them) ------
    def drafter(self):
        return self.trainer.model

    def _state(self, step: int, state: RankState) -> None:
        if self.control is not None:
            self.control.set(step, state)

    def begin(self, step: int) -> None:
        if self.pending is not None:  # a caller that never settled: the engine serves the average before rolling out
            self.settle()
        self._state(step, RankState.GENERATING)

    def rollouts_done(self, step: int, batch) -> None:
        self.sink.stash(batch.rollouts, step)

    def _rows(self, step: int):
        s = self.settings
        # The newest step the producer has put: this one (the engine's sink, put as the ranks'
        # windows open) or the one before (the actor's forward, which runs after the idle window).
        newest = step - self.sink.lag
        return [e.to_row() for e in self.buffer.sample(s.rows_per_step, step=newest, offset_ratio=s.offset_ratio,
                                                       generator=self.generator)]

    def work(self, window: IdleWindow) -> dict[str, float]:
        """Trains until the window ends, then waits for its end (the window's figures need it) and
        posts the average; the last part of a window (common.idle.ScheduledIdle)."""
        step = window.step
        self._state(step, RankState.IDLE)
        put_as_window_opens(self.sink, window)
        self.trainer.model.refresh_head()  # the target's LM head changed at the last weight sync
        self._state(step, RankState.TRAINING)
        t0 = window.clock()
        result = self.trainer.train(lambda i: self._rows(step), window.others_done, self.settings.max_micro_steps,
                                    keep_cut=True)  # the window's end keeps the chunks done
        t1 = window.clock()
        self._state(step, RankState.BARRIER)
        filled = FilledTime.of(t0, t1, window.started, window.all_done_at())
        n = float(result["spot/micro_steps"])
        mine = [n, filled.useful_s, filled.idle_s, result.get("spot/drafter_loss", 0.0) * n,
                result.get("spot/top1", 0.0) * n, result.get("spot/aborted", 0.0), result.get("spot/dropped_s", 0.0),
                filled.overrun_s]
        # The average goes on while the step goes on (the barrier, the actor's update): `settle` waits for it.
        self.pending = post_average(list(self.trainer.model.named_parameters()), n, mine, self.group)
        return self.buffer.stats()

    def settle(self) -> dict[str, float]:
        """After the actor's update (pipeline.trainer), before the next rollouts: waits for the
        window's average, loads it into the trainer's copy and, as a new drafter version, into the
        engine; returns the window's metrics over all ranks. Nothing to do when no window is pending."""
        if self.pending is None:
            return {}
        averaged, every = self.pending.result()  # every rank's STATS [world, 8]
        self.pending = None
        sums, overrun = every[:, :7].sum(0), every[:, 7].max()
        metrics = {"spot/micro_steps": float(sums[0]), "spot/train_s": float(sums[1]), "spot/idle_s": float(sums[2]),
                   "spot/overrun_s": float(overrun), "spot/drafter_version": float(self.drafter_version),
                   "spot/aborted": float(sums[5]),  # micro-steps the window's end cut short
                   "spot/dropped_s": float(sums[6])}  # the work it dropped: in train_s (and utilisation), no weights changed
        if sums[2] > 0:
            metrics["spot/utilisation"] = float(sums[1] / sums[2])
        if averaged is not None:
            self.trainer.load_weights(averaged)
            self.drafter_version += 1
            self.engine.load_drafter_weights(averaged, version=self.drafter_version)
            metrics["spot/drafter_version"] = float(self.drafter_version)
            metrics["spot/drafter_loss"] = float(sums[3] / sums[0])
            metrics["spot/top1"] = float(sums[4] / sums[0])
        return metrics
