"""Which rank trains which of a step's prompt groups: a pure function of the step's whole batch.

A step's prompt groups (a prompt's n samples stay together: advantages are per group) are
numbered in global order: the loader's global step (pipeline.data), rank 0's shard first. Where a
group was *generated* (a rank's own shard, a stolen unit, a separate rollout rank) never enters
these functions, so the data-parallel update sees the same rows on the same ranks in the same
order whichever way the rollout was placed, and the run stays bit for bit the same.

- `shard_shares`: rank r trains its loader shard, the groups it would have generated alone
  (the colocated layout's assignment, and a separated run's: actor rank k trains what colocated
  rank k would).
- `token_shares`: groups dealt longest first to the rank with the fewest tokens so far (ties: the
  rank with fewer groups, then the lower rank: groups that weigh nothing are spread too), each
  rank's groups then in global order: ranks finish their updates together when
  lengths are long-tailed. A different assignment from `shard_shares` sums gradients in another
  order, so it is a different (equally valid) run, not the same bits.
- `mini_batch_shares`: the same deal over (mini-batch, rank) cells with equal group counts per
  mini-batch (over one rank: which groups form each mini-batch, about equal in tokens).
- `row_shares`: what `trainer.train_shares: tokens` trains. Whole groups form the mini-batches
  (`mini_batch_shares` over one rank); each mini-batch's *rows* are then dealt longest first over
  the ranks (`token_shares`). Every mini-batch ends in a gradient all-reduce that waits for its
  slowest rank, so it is each mini-batch that must be balanced, and a prompt group (4 samples of
  up to ~800 tokens on the mult task) is too coarse a unit for that: dealt whole, the ranks'
  parts of a mini-batch stay short of balanced, dealt by rows they are nearly even (the run's
  `train/update_balance`; docs/BENCHMARKS.md, "The update"). A
  group's samples may then train on different ranks; advantages are per group, so each rank
  holds the whole groups of its rows (pipeline.rollout.schedule) and trains only its rows.
- `update_balance`: how evenly the ranks' update tokens fall in each mini-batch (the learner's
  `train/update_balance`).
- `update_tokens`: what a group weighs in `token_shares`: its response tokens, or 0 when the
  update leaves it out (rewards all equal: advantage 0, pipeline.update.learner).
- `generation_shares`: which groups each rollout rank of a separated placement generates.
- `split_samples`: which samples of every group a rank generates when groups are split over the
  ranks (rollout.split_groups).
"""

from __future__ import annotations

from collections.abc import Sequence


def shard_shares(groups: int, world: int) -> list[list[int]]:
    """Contiguous equal shards in rank order: [[0..g/w-1], [g/w..2g/w-1], ...]."""
    if world < 1 or groups % world:
        raise ValueError(f"{groups} prompt groups do not split evenly over {world} ranks (trainer.prompts_per_step "
                         "must be divisible by the number of training ranks)")
    size = groups // world
    return [list(range(r * size, (r + 1) * size)) for r in range(world)]


def token_shares(group_tokens: Sequence[int], world: int) -> list[list[int]]:
    """Longest-first greedy balance of the groups' token counts over `world` ranks."""
    return [cells[0] for cells in mini_batch_shares(group_tokens, world, 1)]


def mini_batch_shares(group_tokens: Sequence[int], world: int, mini_batches: int) -> list[list[list[int]]]:
    """[rank][mini-batch] -> groups in global order. Groups go longest first to the cell with the
    fewest tokens so far (ties: fewer groups, then the lower mini-batch, then the lower rank) among
    the mini-batches not yet full; mini-batch k holds len(groups) // mini_batches groups, one more
    for the first len(groups) % mini_batches. With at least world * mini_batches groups every cell
    gets one (the first world * mini_batches groups go to empty cells)."""
    if world < 1 or mini_batches < 1:
        raise ValueError(f"world and mini_batches must be >= 1, got {world} and {mini_batches}")
    G = len(group_tokens)
    if G < mini_batches:
        raise ValueError(f"{G} prompt groups cannot fill {mini_batches} mini-batches: lower trainer.mini_batches, "
                         "raise trainer.prompts_per_step, or use trainer.train_shares=shard")
    room = [G // mini_batches + (k < G % mini_batches) for k in range(mini_batches)]
    load = [[0] * world for _ in range(mini_batches)]
    cells: list[list[list[int]]] = [[[] for _ in range(mini_batches)] for _ in range(world)]
    for g in sorted(range(G), key=lambda g: (-group_tokens[g], g)):
        k, r = min(((k, r) for k in range(mini_batches) if room[k] for r in range(world)),
                   key=lambda c: (load[c[0]][c[1]], len(cells[c[1]][c[0]]), c))
        cells[r][k].append(g)
        load[k][r] += group_tokens[g]
        room[k] -= 1
    return [[sorted(c) for c in rank] for rank in cells]


def row_shares(row_tokens: Sequence[Sequence[int]], world: int, mini_batches: int) -> list[list[list[tuple[int, int]]]]:
    """[rank][mini-batch] -> the (group, sample) rows the rank trains in that mini-batch, in global
    order. row_tokens[g][s]: what sample s of group g weighs (0: the update leaves it out)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    groups_of = mini_batch_shares([sum(t) for t in row_tokens], 1, mini_batches)[0]
    out: list[list[list[tuple[int, int]]]] = [[[] for _ in range(mini_batches)] for _ in range(world)]
    for k, groups in enumerate(groups_of):
        rows = [(g, s) for g in groups for s in range(len(row_tokens[g]))]  # global order
        if len(rows) < world:
            raise ValueError(f"mini-batch {k} holds {len(rows)} rows, fewer than the {world} ranks that each train a "
                             "part of it: lower trainer.mini_batches, raise trainer.prompts_per_step, or use "
                             "trainer.train_shares=shard")
        for r, share in enumerate(token_shares([row_tokens[g][s] for g, s in rows], world)):
            out[r][k] = [rows[i] for i in share]
    return out


def update_balance(loads: Sequence[Sequence[float]]) -> float:
    """loads[rank][mini-batch]: the tokens each rank trains in each mini-batch. Every mini-batch
    waits for its slowest rank, so the update takes sum_k max_r; balanced it would take sum_k
    mean_r. Their ratio (1: no rank waits; 0.5 on 2 ranks: one rank does all the work)."""
    k = max((len(rank) for rank in loads), default=0)
    at = lambda rank, i: rank[i] if i < len(rank) else 0.0  # noqa: E731
    worst = sum(max(at(rank, i) for rank in loads) for i in range(k))
    mean = sum(sum(at(rank, i) for rank in loads) / len(loads) for i in range(k))
    return mean / worst if worst > 0 else 1.0


def update_tokens(lengths: Sequence[int], rewards: Sequence[float], equal_rewards_free: bool) -> int:
    """The response tokens the update trains on of a group with these response lengths and rewards:
    none when `equal_rewards_free` (the learner leaves out advantage-0 rows) and its rewards are all equal."""
    if equal_rewards_free and len(set(rewards)) <= 1:
        return 0
    return sum(lengths)


def split_samples(n: int, world: int, rank: int) -> range:
    """Rank `rank`'s part of every group of n samples split over `world` ranks (rollout.split_groups):
    samples rank*n/world .. (rank+1)*n/world - 1. Tokens do not depend on where a sample is made."""
    if n % world:
        raise ValueError(f"rollout.split_groups gives each of the {world} ranks an equal part of every group of "
                         f"rollout.n={n} samples: make rollout.n a multiple of {world}, or set rollout.split_groups=false")
    part = n // world
    return range(rank * part, (rank + 1) * part)


def generation_shares(groups: int, ranks: int) -> list[list[int]]:
    """Which groups each rollout rank of a separated placement generates: contiguous, as equal in
    count as they go (the first `groups % ranks` ranks take one more). Tokens do not depend on
    where a group is generated, so this changes no result, only the ranks' loads."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    size, extra = divmod(groups, ranks)
    starts = [r * size + min(r, extra) for r in range(ranks + 1)]
    return [list(range(starts[r], starts[r + 1])) for r in range(ranks)]
