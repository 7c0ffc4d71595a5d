"""The warm start over torchrun's ranks: prompts sharded, features kept where generated, one
drafter trained data-parallel.

    torchrun --standalone --nproc-per-node=R -m spot.warmstart --target DIR --prompts FILE --out DIR ...

Rank r generates prompts r, r + R, r + 2R, ... of the file and computes their features; the rows
(and their features, the bulk of the data) stay on that rank. The engine keys its sampling noise
by prompt and sample, so a response is the same tokens whichever rank generates it. Every choice
a 1-rank run makes about its data — the draft vocabulary, the held-out split, the packing of the
training pairs into windows, the order windows are drawn in — depends on the rows' token ids
only, so those are gathered (not the features) and every rank builds the 1-rank run's *layout*:
the same PackedPairs over featureless rows in the 1-rank order (by prompt, then sample).

Each step draws the 1-rank run's windows. Every rank computes the loss of those windows'
segments that live on it, repacked into windows of its own (a pair's loss depends only on its
segment: spot.training.pairs); the gradients, weighted by the rank's pairs, are summed over the ranks and
divided by the step's pairs: the 1-rank step's mean gradient, up to float rounding, on every rank,
so every replica takes the same optimiser step and the drafter equals the 1-rank one within
float32 tolerance. (For eagle3_vllm, whose loss adds a fed-back term over its own pairs, the
combination weights both terms by the first-level pairs, as a chunked step does.) The held-out
metrics are sums over each rank's held-out rows; rank 0 saves. Collectives run over gloo on CPU,
NCCL for CUDA tensors on GPUs (each rank on its LOCAL_RANK's GPU).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spot.training.step import EVAL_SUMS, DrafterTrainer, evaluate_sums, means
from spot.training.pairs import PackedPairs, Segment
from spot.training.records import HiddenStateRows, RowStore
from spot.warmstart.data import Prompt


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def join(device: str, timeout_s: float = 1800.0) -> Ranks:
    """Joins the process group torchrun describes (RANK, WORLD_SIZE...); alone without one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(local)
        # NCCL carries the gradients (CUDA tensors), gloo the gathered token ids and counts.
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return Ranks(rank=rank, world=world, local_rank=local)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_device(device: str, r: Ranks) -> str:
    """The device this rank runs on: its LOCAL_RANK's GPU under torchrun with `cuda`."""
    if r.world == 1 or device == "cpu":
        return device
    if device != "cuda":
        raise ValueError(f"under torchrun pass --device cuda (each rank takes its LOCAL_RANK's GPU), not {device!r}")
    return f"cuda:{r.local_rank}"


def shard(prompts: list[Prompt], r: Ranks) -> list[Prompt]:
    """This rank's prompts: every R-th from the r-th."""
    if len(prompts) < r.world:
        raise ValueError(f"{len(prompts)} prompts for {r.world} ranks: give at least one prompt per rank")
    return prompts[r.rank :: r.world]


def gather_layout(local: RowStore, prompts: list[Prompt], r: Ranks) -> RowStore:
    """Every rank's rows without their features (token ids, prompt lengths), in the 1-rank order:
    by the prompt's place in the file, then sample."""
    meta = [(row.prompt_id, row.sample, row.tokens.to(torch.int32), row.prompt_len) for row in local]
    everyone: list = [None] * r.world
    dist.all_gather_object(everyone, meta)
    place = {p.id: i for i, p in enumerate(prompts)}
    rows = sorted((m for part in everyone for m in part), key=lambda m: (place[m[0]], m[1]))
    return RowStore([HiddenStateRows(prompt_id=pid, sample=s, tokens=t.long(), features=torch.empty(len(t), 0),
                                     prompt_len=p) for pid, s, t, p in rows])


def local_part(layout: RowStore, local: RowStore) -> tuple[list[HiddenStateRows], dict[int, int]]:
    """The rows of `layout` (a split of the gathered rows) that live here, in layout order, and
    layout index -> index among them."""
    mine = {(row.prompt_id, row.sample): row for row in local}
    rows, index = [], {}
    for i, row in enumerate(layout):
        if (row.prompt_id, row.sample) in mine:
            index[i] = len(rows)
            rows.append(mine[(row.prompt_id, row.sample)])
    return rows, index


class ShardedPairs:
    """Steps of the 1-rank run's windows (`layout`) over data spread across ranks (module docstring)."""

    def __init__(self, layout: PackedPairs, rows: list[HiddenStateRows], index: dict[int, int], device) -> None:
        self.layout, self.index, self.device = layout, index, device
        self.local = PackedPairs(rows, layout.window) if rows else None

    def segments(self, idx: torch.Tensor) -> list[Segment]:
        """The segments of windows idx that live here, their rows indexed as in `local`."""
        segs = (self.layout.segments[i] for w in idx.tolist() for i in self.layout.bins[w])
        return [Segment(self.index[s.row], s.start, s.length) for s in segs if s.row in self.index]

    def step(self, trainer: DrafterTrainer, idx: torch.Tensor, lr: float) -> tuple[float, dict[str, float]]:
        total = int(self.layout.loss[idx].sum())
        segs = self.segments(idx)
        if segs:
            view = self.local.repacked(segs)
            m = view.num_pairs
            _, metrics = trainer.step(view, torch.arange(len(view)), lr, reduce=self.reduce(m, total))
        else:  # none of this step's windows holds a row of this rank: zero gradients into the sum
            m, metrics = 0, {}
            trainer.reduced_step(lr, self.reduce(0, total))
        keys = ("spot/drafter_loss", "spot/feature_loss", "spot/ce_loss", "spot/top1_draft_vocab")
        sums = torch.tensor([metrics.get(k, 0.0) * m for k in keys] + [float(m)], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums)
        assert round(float(sums[-1])) == total, "the ranks' segments are not the step's windows"
        out = {k: float(v) / total for k, v in zip(keys, sums[:-1].tolist(), strict=True)}
        return out["spot/drafter_loss"], out

    def reduce(self, m: int, total: int):
        """Sets each parameter's gradient to sum over ranks (m_r * mean gradient_r) / total."""

        def combine(params: list[torch.nn.Parameter]) -> None:
            params = [p for p in params if p.requires_grad]
            flat = torch.cat([(p.grad * m if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat.div_(total)
            for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
                p.grad = g.view_as(p)

        return combine


def clock(elapsed: float, device) -> float:
    """Rank 0's elapsed time on every rank: the stop and the time-bound schedule agree."""
    t = torch.tensor([elapsed], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return float(t)


def evaluate_sharded(model, rows: list[HiddenStateRows], window: int, ce_weight: float, depth: int, device) -> dict:
    """evaluate's means over every rank's held-out `rows` (this rank's may be none)."""
    local = evaluate_sums(model, PackedPairs(rows, window), ce_weight, depth) if rows else dict.fromkeys((*EVAL_SUMS, "pairs"), 0.0)
    keys = (*EVAL_SUMS, "pairs")
    t = torch.tensor([float(local[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return means(dict(zip(keys, t.tolist(), strict=True)))


def gather_stats(stats: dict, r: Ranks) -> dict:
    """The ranks' generation and feature statistics as one run's: counts summed, times the slowest rank's."""
    everyone: list = [None] * r.world
    dist.all_gather_object(everyone, stats)
    gens = [s["generation"] for s in everyone]
    seconds = max(g["seconds"] for g in gens)
    tokens = sum(g["response_tokens"] for g in gens)
    generation = {"seconds": seconds, "response_tokens": tokens, "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
                  "stopped": sum(g["stopped"] for g in gens), "truncated": sum(g["truncated"] for g in gens)}
    return {"generation": generation, "feature_seconds": max(s["feature_seconds"] for s in everyone)}
