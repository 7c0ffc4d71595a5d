"""A ZeRO optimizer checkpoint re-sharded for another number of data-parallel ranks.

A DeepSpeed actor checkpoint (pipeline.actors.deepspeed_actor) holds each rank's
`engine.optimizer.state_dict()`: its partition of the float32 master weights and of Adam's moments.
Given every saved rank's state (in rank order) and the *template*, the state dict that the engine
about to load lays out for this rank (`optimizer.state_dict()` of the new engine, on the new number
of ranks), `zero12_state` and `zero3_state` return this rank's state in the template's layout
holding the saved values, for DeepSpeed's own `optimizer.load_state_dict` to restore as if this
rank had saved it.

Vocabulary:
- *flat*: one float32 tensor the base optimizer (torch's AdamW, DeepSpeed's CPU or fused Adam)
  steps: under ZeRO-1 / 2 a rank's partition of one parameter group, under ZeRO-3 of one
  sub-group of a parameter group. A rank's flats in order are its *stream*.
- *whole*: the unpartitioned values of one unit: under ZeRO-1 / 2 a parameter group (its parameters
  flattened in order, each followed by its alignment padding, which does not depend on the number
  of ranks), under ZeRO-3 one parameter, flattened.
- *moment*: a base optimizer state tensor shaped as its flat (Adam's exp_avg, exp_avg_sq); any other
  state value (Adam's step) is the same on every rank and is copied from saved rank 0.

The layouts (DeepSpeed 0.19's non-elastic checkpoints, which the actor writes):
- ZeRO-1 / 2 (runtime/zero/stage_1_and_2.py): a group's whole, zero-padded at its end to a multiple
  of 2 x ranks, is cut into one equal partition per rank. The saved masters leave the padding out
  (`single_partition_of_fp32_groups`, with `group_paddings`); the moments keep it
  (`base_optimizer_state`, a torch optimizer state dict with one flat per group).
- ZeRO-3 (runtime/zero/stage3.py, as utils/zero_to_fp32.py reads it): a parameter of n elements is
  zero-padded to ranks x ceil(n / ranks) and rank r holds slice r; a rank's slices in parameter
  order, cut into sub-groups, are its flats (`fp32_flat_groups`; the moments in
  `optimizer_state_dict`, whose param groups list their sub-groups' flats).

It knows nothing of files, processes or engines. Nothing is built whole: each new flat is read
from views into the saved tensors (`read_range`), so with the saved files memory-mapped
(torch.load(mmap=True)) a rank reads only the parts it keeps. Values are copied, never changed:
a re-sharded state steps exactly as the saved one would have, up to the order in which the new
number of ranks sums gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

# DeepSpeed's state dict keys (deepspeed/checkpoint/constants.py)
MASTERS = "single_partition_of_fp32_groups"  # ZeRO-1 / 2
PADDINGS = "group_paddings"
ALIGNMENT = "param_alignment_paddings"
BASE = "base_optimizer_state"
FLATS = "fp32_flat_groups"  # ZeRO-3
BASE3 = "optimizer_state_dict"
STAGE = "zero_stage"  # 1, 2 or 3
PARTITION_COUNT = "partition_count"
SLICE_MAPPINGS = "param_slice_mappings"


def read_range(pieces: Sequence[torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of the concatenation of the flattened `pieces`, without building it."""
    out, offset = [], 0
    for p in pieces:
        lo, hi = max(start - offset, 0), min(stop - offset, p.numel())
        if lo < hi:
            out.append(p.reshape(-1)[lo:hi])
        offset += p.numel()
        if offset >= stop:
            break
    return torch.cat(out) if out else torch.empty(0, dtype=pieces[0].dtype)


def partition(pieces: Sequence[torch.Tensor], length: int, size: int, rank: int) -> torch.Tensor:
    """Partition `rank` (`size` elements, zero-padded past `length`) of the whole that `pieces`
    concatenate (its first `length` elements: what follows is padding); a new tensor [size]."""
    part = read_range(pieces, rank * size, min((rank + 1) * size, length))
    return torch.cat([part, part.new_zeros(size - part.numel())])


def flat_ids(optimizer_state: dict) -> list[list[int]]:
    """The state ids of a torch optimizer state dict's flats, by param group."""
    return [list(group["params"]) for group in optimizer_state["param_groups"]]


def base_state(saved: Sequence[dict], template: dict, saved_sizes: Sequence[Sequence[int]],
               reshard: Callable[[list[list[torch.Tensor]]], list[torch.Tensor]]) -> dict:
    """A torch optimizer state dict (one entry per flat) in `template`'s ids from every saved rank's.

    saved_sizes[i][k]: the numel of saved rank i's flat k (a value of that shape is a moment);
    reshard: every saved rank's flats of one moment -> this rank's new flats. Moments are
    re-sharded, other values copied from the first flat of the same param group on saved rank 0;
    the param groups' settings (lr, betas, ...) are saved rank 0's.
    """
    old_ids, new_ids = [flat_ids(s) for s in saved], flat_ids(template)
    if len(old_ids[0]) != len(new_ids):
        raise ValueError(f"the checkpoint's optimizer has {len(old_ids[0])} param groups, this actor's "
                         f"{len(new_ids)}: resume with the model it was saved with")
    groups = [{**g, "params": ids} for g, ids in zip(saved[0]["param_groups"], new_ids)]
    states = [[s["state"].get(i, {}) for group in ids for i in group] for s, ids in zip(saved, old_ids)]
    if not states[0] or not states[0][0]:  # saved before the optimizer's first step: nothing to carry
        return {"state": {}, "param_groups": groups}
    keys = list(states[0][0])
    moments = [k for k in keys if all(torch.is_tensor(st[k]) and st[k].shape == (n,)
                                      for rank_states, sizes in zip(states, saved_sizes)
                                      for st, n in zip(rank_states, sizes))]
    new_flats = {k: reshard([[st[k] for st in rank_states] for rank_states in states]) for k in moments}
    out, flat = {}, 0
    for g, ids in enumerate(new_ids):
        first = saved[0]["state"][old_ids[0][g][0]]
        for i in ids:
            out[i] = {k: new_flats[k][flat] if k in moments else (v.clone() if torch.is_tensor(v) else v)
                      for k, v in first.items()}
            flat += 1
    return {"state": out, "param_groups": groups}


def zero12_state(saved: Sequence[dict], template: dict, rank: int) -> dict:
    """This rank's ZeRO-1 / 2 optimizer state in `template`'s layout from every saved rank's state.

    Each group's whole is the saved ranks' masters (without their padding) end to end; this rank's
    partition of it has the template's size (its masters plus its padding).
    """
    if any(s[ALIGNMENT] != template[ALIGNMENT] for s in saved):
        raise ValueError("the checkpoint's parameters are laid out with other alignment paddings than this actor's: "
                         "resume with the model and zero_optimization settings it was saved with")
    lengths = [sum(s[MASTERS][g].numel() for s in saved) for g in range(len(saved[0][MASTERS]))]
    sizes = [m.numel() + pad for m, pad in zip(template[MASTERS], template[PADDINGS])]

    def fits(n: int, size: int, world: int, mine: int) -> bool:  # DeepSpeed pads a whole by under 2 x world
        return world * size - 2 * world < n <= world * size and mine == min(max(n - rank * size, 0), size)

    if len(lengths) != len(sizes) or not all(fits(n, size, world, m.numel()) for n, size, world, m in
                                             zip(lengths, sizes, template[PARTITION_COUNT], template[MASTERS])):
        raise ValueError(f"the checkpoint's parameter groups hold {lengths} elements, which do not fit this actor's "
                         "partitions: resume with the model it was saved with")

    def reshard(flats: list[list[torch.Tensor]]) -> list[torch.Tensor]:  # flats[i][g]: saved rank i's, unpadded
        return [partition([f[g] for f in flats], n, size, rank) for g, (n, size) in enumerate(zip(lengths, sizes))]

    unpadded = [[m.numel() for m in s[MASTERS]] for s in saved]
    padded = [[n + pad for n, pad in zip(u, s[PADDINGS])] for u, s in zip(unpadded, saved)]

    def reshard_moment(flats: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        return reshard([[f[:n] for f, n in zip(rank_flats, u)] for rank_flats, u in zip(flats, unpadded)])

    masters = [p[:m.numel()] for p, m in zip(reshard([list(s[MASTERS]) for s in saved]), template[MASTERS])]
    return {**saved[0], MASTERS: masters, BASE: base_state([s[BASE] for s in saved], template[BASE], padded,
                                                            reshard_moment),
            PADDINGS: template[PADDINGS], PARTITION_COUNT: template[PARTITION_COUNT],
            SLICE_MAPPINGS: template[SLICE_MAPPINGS]}


def zero3_pieces(streams: Sequence[Sequence[torch.Tensor]], numels: Sequence[int]) -> list[list[torch.Tensor]]:
    """Per parameter (of `numels` elements, in partition order), views of its slice on each saved
    rank: concatenated, they are the parameter flattened, then padding. streams[i]: rank i's flats."""
    world = len(streams)
    stream_numel = sum(math.ceil(n / world) for n in numels)
    if any(sum(f.numel() for f in s) != stream_numel for s in streams):
        raise ValueError(f"the checkpoint's ZeRO-3 partitions hold {[sum(f.numel() for f in s) for s in streams]} "
                         f"elements per rank, its {world} ranks' slices of this model's parameters {stream_numel}: "
                         "resume with the model it was saved with")
    pieces, offset = [], 0
    for n in numels:
        size = math.ceil(n / world)
        pieces.append([read_range(s, offset, offset + size) for s in streams])
        offset += size
    return pieces


def zero3_whole(streams: Sequence[Sequence[torch.Tensor]], numels: Sequence[int]) -> list[torch.Tensor]:
    """Every parameter, flattened, from every saved rank's flats (streams[i]: rank i's)."""
    return [torch.cat(p)[:n] for p, n in zip(zero3_pieces(streams, numels), numels)]


def zero3_state(saved: Sequence[dict], template: dict, numels: Sequence[int], rank: int, world: int) -> dict:
    """This rank's ZeRO-3 optimizer state in `template`'s layout (this rank of `world`) from every
    saved rank's state; numels: the parameters' sizes in partition order."""
    sizes = [f.numel() for f in template[FLATS]]
    for state in (*saved, template):  # the base optimizer numbers the flats in sub-group order
        assert sum(flat_ids(state[BASE3]), []) == list(range(len(state[FLATS]))), flat_ids(state[BASE3])

    def reshard(flats: list[list[torch.Tensor]]) -> list[torch.Tensor]:  # flats[i]: saved rank i's stream
        mine = [partition(p, n, math.ceil(n / world), rank) for p, n in zip(zero3_pieces(flats, numels), numels)]
        stream = torch.cat(mine)
        assert stream.numel() == sum(sizes), (stream.numel(), sizes)
        return list(stream.split(sizes))

    saved_sizes = [[f.numel() for f in s[FLATS]] for s in saved]
    return {**saved[0], FLATS: reshard([list(s[FLATS]) for s in saved]),
            BASE3: base_state([s[BASE3] for s in saved], template[BASE3], saved_sizes, reshard),
            PARTITION_COUNT: template[PARTITION_COUNT]}
