"""A member of a three-member spot pool for one micro-step, where member 2's node is generating.

Members 0 and 1 read buffer `idle` (ungated: their nodes may train), member 2 reads buffer `busy`
(gated by one rank that is generating). Each writes its weights after the pool's micro-step to
<out>/rank{r}.pt; member 0 also writes the reference: the two training members' gradients
computed one by one in this process, averaged by hand, and stepped from the same start.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


class Stop(Exception):
    pass


def worker(rank: int, world: int, port: int, out: str, cfg_kw: dict, idle: str, busy: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from spot.buffer.ring import DataBuffer
        from spot.pool.elastic import Members, PoolConfig, make_trainer, open_inputs, sample_rows, train_members
        from spot.buffer.segment import node_segment
        from pipeline.dist import Ranks

        cfg = PoolConfig(**cfg_kw, buffer=idle if rank < 2 else busy, out=f"{out}/pool", micro_steps=1)
        r = Ranks(rank=rank, world=world)
        model, buf = open_inputs(cfg)
        members, averaged = Members(r, "cpu"), {}
        average = members.gradient_average

        def observed(trainers):  # the gradients the optimiser gets, as the pool's reduce leaves them
            reduce = average(trainers)

            def observe(params):
                reduce(params)
                averaged.update({i: p.grad.clone() for i, p in enumerate(params)})

            return observe

        members.gradient_average = observed
        try:
            trainer = make_trainer(cfg, r, model)
            res = train_members(cfg, members, trainer, buf, lambda: False)
        finally:
            buf.close()
        torch.save({"trained": res.trained, "weights": dict(trainer.named_weights()), "grads": averaged},
                   f"{out}/rank{rank}.pt")
        if rank != 0:
            return
        solo = PoolConfig(**cfg_kw, buffer=idle, out=f"{out}/solo", micro_steps=1)
        buf = DataBuffer.attach(node_segment(idle))
        rows = [sample_rows(buf, solo, m, 0) for m in (0, 1)]  # what members 0 and 1 sampled
        buf.close()
        one = Ranks()
        grads = []
        for member_rows in rows:
            t = make_trainer(solo, one, open_inputs(solo)[0])
            got = {}

            def capture(params, got=got):
                got.update({i: p.grad.clone() for i, p in enumerate(params)})
                raise Stop

            try:
                t.micro_step(member_rows, reduce=capture)
            except Stop:
                pass
            grads.append(got)
        ref = make_trainer(solo, one, open_inputs(solo)[0])

        mean = {i: (grads[0][i] + grads[1][i]) / 2 for i in grads[0]}

        def mean_of_the_two(params):
            for i, p in enumerate(params):
                p.grad = mean[i].clone()

        ref.micro_step(rows[0], reduce=mean_of_the_two)
        torch.save({"weights": dict(ref.named_weights()), "grads": mean}, f"{out}/reference.pt")
    finally:
        dist.destroy_process_group()
