"""The rank coordinator: spot training in each rank's idle window, one drafter for all ranks.

Per rank and step, a state machine kept in the job's TCPStore (common.control, the control
plane: no Redis, ZMQ or Ray):

    GENERATING --rollouts done--> IDLE --spot work--> TRAINING --last rank done--> BARRIER

`SpotWork` is the loop's idle-window hook (pipeline.idle.IdleWork). While a rank generates,
its engine's feature sink collects the target's features (stashed when its rollouts are done,
`rollouts_done`) and the rank puts them into the node's DataBuffer as its idle window opens; the
rank that finished last keeps them for its next window instead (spot.sink: nobody is left to
train on them this step, and the put would delay the step). In the idle window the rank trains its copy of
the drafter on buffer samples (the current step's finished responses mixed with the previous
step's long ones) and checks before each micro-step and after each chunk's forward and backward
inside it (spot.trainer) whether every rank is done, so it stops within about half a chunk of
the window's end; the micro-step in flight is taken on its chunks done (the chunk in flight is
dropped). Then the replicas are averaged, each weighted by the
micro-steps it ran (one all-reduce: gloo on CPU, NCCL on GPU; a rank that ran none counts
zero), and every rank loads the average into its engine as a new drafter version before the
next step. Each rank keeps its own AdamW moments (local-SGD style): only weights are averaged.

Time is accounted honestly: a rank's idle time is from its rollouts' end to the last rank's
(`IdleWindow.all_done_at`); training within it counts towards `spot/utilisation`; training past
it is `spot/overrun_s`, time the step pays for spot training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.control import ControlPlane, RankState
from spot.buffer import DataBuffer
from spot.sink import put_as_window_opens
from spot.trainer import SpotTrainer


def weighted_average(named: list[tuple[str, torch.Tensor]], weight: float) -> list[tuple[str, torch.Tensor]] | None:
    """sum_r w_r * theta_r / sum_r w_r over the process group, in one all-reduce; None when every
    weight is 0 (nobody trained: keep the weights). Identical on every rank: an all-reduce hands
    every rank the same sum. A rank of weight 0 sends zeros without reading its weights."""
    sizes = [t.numel() for _, t in named]
    N = sum(sizes)
    # [N + 1] float32: the drafter's dtype; float64 would double the bytes (a 467k-weight tiny
    # drafter: 1.5 against 4.5 ms a step on 2 gloo ranks) and the weights are float32 anyway.
    buf = torch.zeros(N + 1, dtype=torch.float32)
    if weight:
        buf[:N].copy_(torch.cat([t.detach().reshape(-1) for _, t in named])).mul_(weight)
        buf[N] = weight
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(buf)
    total = float(buf[N])
    if total <= 0:
        return None
    avg = buf[:N].div_(total)
    return [(name, a.view(t.shape).to(t.dtype)) for (name, t), a in zip(named, avg.split(sizes))]


@dataclass(kw_only=True)
class SpotSettings:
    rows_per_step: int = 8  # buffer entries per micro-step
    offset_ratio: float = 0.25  # share of the previous step's long responses in a sample
    max_micro_steps: int | None = None  # per window; None: until the window ends
    seed: int = 0


class SpotWork:
    """pipeline.idle.IdleWork: spot training in the idle window, on one rank."""

    def __init__(self, engine, trainer: SpotTrainer, buffer: DataBuffer, sink, control: ControlPlane | None,
                 settings: SpotSettings) -> None:
        self.engine, self.trainer, self.buffer, self.sink = engine, trainer, buffer, sink
        self.control, self.settings = control, settings
        self.drafter_version = 0
        self.generator = torch.Generator().manual_seed(settings.seed * 1000 + (control.rank if control else 0))

    # -- checkpoints (pipeline.run_state: rank 0 writes, every rank resumes from it) ----------
    def save(self, folder) -> None:
        self.trainer.save(folder)

    def state_dict(self) -> dict:
        return {"drafter_version": self.drafter_version}

    def load_state_dict(self, state: dict) -> None:
        self.drafter_version = int(state["drafter_version"])

    def _state(self, step: int, state: RankState) -> None:
        if self.control is not None:
            self.control.set(step, state)

    def begin(self, step: int) -> None:
        self._state(step, RankState.GENERATING)

    def rollouts_done(self, step: int, batch) -> None:
        self.sink.stash(batch.rollouts, step)

    def _rows(self, step: int):
        s = self.settings
        # The newest step the producer has put: this one (the engine's sink, put as the ranks'
        # windows open) or the one before (the actor's forward, which runs after the idle window).
        newest = step - getattr(self.sink, "lag", 0)
        return [e.to_row() for e in self.buffer.sample(s.rows_per_step, step=newest, offset_ratio=s.offset_ratio,
                                                       generator=self.generator)]

    def work(self, window) -> dict[str, float]:
        step = window.step
        self._state(step, RankState.IDLE)
        put_as_window_opens(self.sink, window)
        self.trainer.model.refresh_head()  # the target's LM head changed at the last weight sync
        self._state(step, RankState.TRAINING)
        t0 = time.time()
        result = self.trainer.train(lambda i: self._rows(step), window.others_done, self.settings.max_micro_steps,
                                    keep_cut=True)  # the window's end keeps the chunks done
        t1 = time.time()
        self._state(step, RankState.BARRIER)
        end = window.all_done_at()
        idle_s = max(0.0, end - window.started)
        useful_s = max(0.0, min(t1, end) - t0)
        overrun_s = max(0.0, t1 - max(end, t0))
        n = float(result["spot/micro_steps"])
        mine = torch.tensor([n, useful_s, idle_s, result.get("spot/drafter_loss", 0.0) * n,
                             result.get("spot/top1", 0.0) * n, result.get("spot/aborted", 0.0),
                             result.get("spot/dropped_s", 0.0), overrun_s], dtype=torch.float64)
        ranks = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:  # one collective: sums and the worst overrun
            ranks = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(ranks, mine)
        every = torch.stack(ranks)  # [world, 8]
        sums, overrun = every[:, :7].sum(0), every[:, 7].max()
        averaged = None  # the weights' all-reduce only when some rank trained (every rank sees the same sums)
        if sums[0] > 0:
            averaged = weighted_average(list(self.trainer.model.named_parameters()), n)
        metrics = {"spot/micro_steps": float(sums[0]), "spot/train_s": float(sums[1]), "spot/idle_s": float(sums[2]),
                   "spot/overrun_s": float(overrun), "spot/drafter_version": float(self.drafter_version),
                   "spot/aborted": float(sums[5]),  # micro-steps dropped inside when the window ended
                   "spot/dropped_s": float(sums[6])}  # their time: in train_s (and utilisation), but no weights changed
        if sums[2] > 0:
            metrics["spot/utilisation"] = float(sums[1] / sums[2])
        if averaged is not None:
            self.trainer.load_weights(averaged)
            self.drafter_version += 1
            self.engine.load_drafter_weights(averaged, version=self.drafter_version)
            metrics["spot/drafter_version"] = float(self.drafter_version)
            metrics["spot/drafter_loss"] = float(sums[3] / sums[0])
            metrics["spot/top1"] = float(sums[4] / sums[0])
        metrics.update(self.buffer.stats())
        return metrics
