"""A rank of the coordinator test: spot training in an idle window that ends when the last rank is done.

Rank r waits (through the store) until every earlier rank is training, then finishes its
"rollouts" STAGGER seconds later, so earlier ranks have longer idle windows. Each rank writes what
it trained (its replica before the average, its micro-steps), what its engine serves after the
window, the metrics, and where its own rollouts' features went (the buffer's keys of them, the
steps its sink still holds), to <out>/rank{r}.pt.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

STAGGER = 1.5


def worker(rank: int, world: int, port: int, out: str, model_dir: str, buffer_name: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from engine.checkpoint import load_checkpoint
        from engine.config import EngineConfig
        from engine.engine import RolloutEngine
        from engine.spec.config import SpecConfig
        from engine.spec.eagle import EagleConfig, EagleModel
        from engine.spec.eagle_drafter import EagleDrafter
        from engine.sampling import SamplingParams
        from engine.types import Request
        from spot.buffer.sink import DataBufferSink
        from common.idle import IdleWindows, RankState
        from spot.buffer.ring import DataBuffer
        from spot.colocated import drafter_copy
        from common.idle import ControlPlane
        from spot.coordinator import SpotSettings, SpotWork
        from spot.training.step import DrafterOptim
        from spot.training.trainer import SpotTrainer

        target = load_checkpoint(model_dir)
        torch.manual_seed(0)  # the same drafter on every rank, as after a load
        net = EagleModel(EagleConfig.for_target(target.config), target)
        engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=64, spec=SpecConfig(depth=2, verify_tokens=2)),
                               EagleDrafter(net))
        buffer = DataBuffer.attach(buffer_name)
        trainer = SpotTrainer(drafter_copy(net), DrafterOptim(lr=3e-3, warmup_steps=0), window=64, rows_per_step=4,
                              seed=rank)
        store = dist.distributed_c10d._get_default_store()
        control = ControlPlane(store, rank, world)
        sink = DataBufferSink(buffer, max_new_tokens=8)
        engine.sink = sink
        work = SpotWork(engine, trainer, buffer, sink, control, SpotSettings(rows_per_step=4, offset_ratio=0.0, seed=0))
        before: dict[str, torch.Tensor] = {}
        load = trainer.load_weights

        def spy(named):  # the replica as trained, just before the average replaces it
            before.update({n: t.detach().clone() for n, t in trainer.named_weights()})
            load(named)

        trainer.load_weights = spy
        dist.barrier()
        work.begin(1)
        batch = engine.generate([Request(prompt_id=f"r{rank}", prompt=[5, 9, 17], n=2)],
                                SamplingParams(max_new_tokens=8, temperature=1.0, seed=rank))
        work.rollouts_done(1, batch)  # not yet in the buffer: put as the window opens
        deadline = time.monotonic() + 60  # synchronised by the store: every earlier rank is training
        while any(s != (1, RankState.TRAINING) for s in control.states()[:rank]):
            assert time.monotonic() < deadline, control.states()
            time.sleep(0.005)
        if rank:
            time.sleep(STAGGER)  # this rank's rollouts take longer: a workload, not a synchronisation
        seen = control.states()  # the last rank sees the others training while it still generates
        _, metrics = IdleWindows(store, rank, world, "tailspec/spot-worker", barrier=dist.barrier).run(1, work)
        metrics |= work.settle()  # the loop's call after the actor's update: the average, loaded
        torch.save({"before": before, "micro_steps": trainer.micro_steps, "metrics": metrics, "seen": [None if s is None else (s[0], s[1].value) for s in seen],
                    "served": {n: p.detach().clone() for n, p in engine.drafter_nets()[0].named_parameters()},
                    "served_version": engine.drafter.version,
                    "put": sorted(i.key for i in buffer.infos() if i.key.startswith(f"r{rank}/")),
                    "held": [st.step for st in sink.stashed]}, os.path.join(out, f"rank{rank}.pt"))
        buffer.close()
    finally:
        dist.destroy_process_group()
