"""Spawned worker for tests/test_history.py: two gloo ranks keep the run's history store (pipeline.drafts.history).

Each rank remembers its own share of a step's rollouts (rank r: prompts p{r}, and one sample of the
shared prompt "both"), then sums one speculative step record per rank into the history metrics.
Every rank writes <out>/rank{r}.pt with its store's state, predicted lengths and metrics.
"""

from __future__ import annotations

import datetime
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist


def rollout(pid: str, sample: int, tokens: list[int]):
    from engine.types import FinishReason, Rollout

    return Rollout(prompt_id=pid, sample=sample, prompt_tokens=3, tokens=tokens, logprobs=[0.0] * len(tokens),
                   finish_reason=FinishReason.STOP)


def worker(rank: int, world: int, port: int, out: str) -> None:
    from engine.spec.history_index import HistoryStore
    from engine.types import StepRecord
    from pipeline.dist import Ranks
    from pipeline.drafts.history import RunHistory

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        h = RunHistory(HistoryStore(min_match=2), Ranks(rank=rank, world=world), source=0)
        mine = [rollout(f"p{rank}", 0, [rank + 1] * (4 + 2 * rank)), rollout("both", rank, [7, rank, 7, rank, 9])]
        h.remember(mine)
        # rank r: one speculative step of 2 rows, the history part (source 0) drafted r + 1 of them, each emitting 3
        step = StepRecord(index=0, batch_size=2, shape="d4k1v4", drafted=[4, 4], accepted=[2, 2], emitted=[3, 3],
                          context_mean=5.0, draft_s=0.0, forward_s=0.0, other_s=0.0, source=[0, 0 if rank else 1])
        torch.save({"state": h.state_dict(), "predicted": h.predicted(["p0", "p1", "both", "unseen"]),
                    "metrics": h.metrics(SimpleNamespace(batch=SimpleNamespace(steps=[step])))}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
