"""Response lengths: drawn from a distribution, and dealt out to rollout groups.

Vocabulary: a *request* is one (prompt, sample) to generate; its *length* is the response's
token count; a *group* is one data-parallel rollout engine (tensor-parallel devices together).
Randomness comes only from the `numpy.random.Generator` passed in.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from sim.config import LengthSpec


def draw_lengths(spec: LengthSpec, prompts: int, samples: int, rng: np.random.Generator,
                 empirical: np.ndarray | None = None) -> np.ndarray:
    """[prompts * samples] int64 response lengths >= 1, a prompt's samples adjacent.

    `empirical` holds the lengths read from spec.path (`read_rollout_lengths`: [n], or with
    spec.by_prompt `read_lengths_by_prompt`: [K, samples]); kind=empirical resamples its entries
    (whole rows, a prompt's samples, with by_prompt) with replacement; with spec.stratified, one row
    from each of `prompts` strata of the rows by mean length, in random order.
    """
    n = prompts * samples
    if spec.kind == "lognormal":
        if spec.prompt_share == 0.0:
            x = rng.lognormal(mean=np.log(spec.median), sigma=spec.sigma, size=n)
        else:
            between = rng.standard_normal((prompts, 1))  # [P, 1] shared by a prompt's samples
            within = rng.standard_normal((prompts, samples))  # [P, n]
            z = np.sqrt(spec.prompt_share) * between + np.sqrt(1.0 - spec.prompt_share) * within
            x = np.exp(np.log(spec.median) + spec.sigma * z).ravel()
        return np.clip(np.rint(x), 1, spec.max_len).astype(np.int64)
    if empirical is None or len(empirical) == 0:
        raise ValueError(f"rollout.lengths.kind=empirical: no lengths read from {spec.path}")
    if spec.by_prompt and spec.stratified:
        return empirical[stratified_rows(empirical, prompts, rng)].ravel().astype(np.int64)
    if spec.by_prompt:
        return empirical[rng.integers(0, len(empirical), size=prompts)].ravel().astype(np.int64)
    return rng.choice(np.asarray(empirical, dtype=np.int64), size=n, replace=True)


def stratified_rows(groups: np.ndarray, prompts: int, rng: np.random.Generator) -> np.ndarray:
    """[prompts] indices into groups [K, samples]: one from each of `prompts` strata of the rows
    by mean length (nearly equal sizes, shortest first), in random order."""
    if len(groups) < prompts:
        raise ValueError(f"rollout.lengths.stratified needs at least as many prompt groups as prompts a step: "
                         f"the file has {len(groups)}, a step {prompts}; use a longer run's rollouts.jsonl")
    strata = np.array_split(np.argsort(groups.mean(axis=1), kind="stable"), prompts)
    return rng.permutation([stratum[rng.integers(0, len(stratum))] for stratum in strata])


def _records(path: str | Path) -> Iterator[tuple[str, dict]]:
    """(where, record) of every line of a rollouts.jsonl; `where` is `path:line` for errors."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"rollouts file not found: {path} (expected runs/<run>/rollouts.jsonl)")
    for i, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            yield f"{path}:{i + 1}", json.loads(line)


def read_rollout_lengths(path: str | Path) -> np.ndarray:
    """The `length` of every line of a rollouts.jsonl, [n] int64."""
    out = []
    for where, rec in _records(path):
        if "length" not in rec:
            raise ValueError(f"{where}: a rollout record needs a 'length' field")
        out.append(int(rec["length"]))
    return np.asarray(out, dtype=np.int64)


def read_lengths_by_prompt(path: str | Path, samples: int) -> np.ndarray:
    """[K, samples] int64: a rollouts.jsonl's response lengths, one row per prompt of each step
    (its samples by `sample` index) that holds exactly `samples` responses."""
    prompts: dict[tuple, dict[int, int]] = {}
    for where, rec in _records(path):
        missing = [k for k in ("step", "prompt_id", "sample", "length") if k not in rec]
        if missing:
            raise ValueError(f"{where}: rollout.lengths.by_prompt needs the fields {missing} in every record "
                             "(a rollouts.jsonl the RL loop wrote)")
        prompts.setdefault((rec["step"], rec["prompt_id"]), {})[int(rec["sample"])] = int(rec["length"])
    whole = [[p[s] for s in range(samples)] for p in prompts.values() if sorted(p) == list(range(samples))]
    if not whole:
        raise ValueError(f"{path}: no prompt has exactly {samples} samples in one step; set "
                         "rollout.samples_per_prompt to the run's rollout.n, or rollout.lengths.by_prompt=false")
    return np.asarray(whole, dtype=np.int64)


def deal(lengths: np.ndarray, groups: int) -> list[np.ndarray]:
    """Split requests into `groups` contiguous, near-equal parts (a prompt's samples stay together
    when they are adjacent, as GRPO groups are)."""
    if groups < 1:
        raise ValueError(f"need at least one rollout group, got {groups}")
    return [part.copy() for part in np.array_split(np.asarray(lengths), groups)]


def split_deal(lengths: np.ndarray, groups: int, samples: int) -> list[np.ndarray]:
    """Deal a prompt's samples to different groups (split groups, Seer's divided rollout).

    lengths [P * samples], a prompt's samples adjacent. The requests are cut sample-major into
    `groups` contiguous, near-equal parts, each then ordered prompt by prompt as its engine admits
    them. When `groups` divides `samples` (what the RL loop's rollout.split_groups requires), group
    g holds samples g*samples/groups .. (g+1)*samples/groups - 1 of every prompt, as a rank does.
    """
    if groups < 1:
        raise ValueError(f"need at least one rollout group, got {groups}")
    lengths = np.asarray(lengths)
    if samples < 1 or len(lengths) % samples:
        raise ValueError(f"{len(lengths)} requests are not whole groups of samples_per_prompt={samples}")
    index = np.arange(len(lengths)).reshape(-1, samples).T.ravel()  # sample-major request order
    return [lengths[np.sort(part)] for part in np.array_split(index, groups)]


def row_deal(lengths: np.ndarray, ranks: int, samples: int, mini_batches: int) -> list[list[np.ndarray]]:
    """[rank][mini-batch] the response lengths each trainer rank trains, as the RL loop's token
    shares deal them (trainer.train_shares=tokens, pipeline.shares.row_shares): whole prompt groups
    form `mini_batches` mini-batches (equal group counts, the heaviest group first to the lightest
    mini-batch with room), then each mini-batch's rows go longest first to the rank with the fewest
    tokens. lengths [P * samples], a prompt's samples adjacent."""
    lengths = np.asarray(lengths)
    if samples < 1 or len(lengths) % samples:
        raise ValueError(f"{len(lengths)} requests are not whole groups of samples_per_prompt={samples}")
    groups = lengths.reshape(-1, samples)
    G = len(groups)
    room = [G // mini_batches + (k < G % mini_batches) for k in range(mini_batches)]
    load = [0] * mini_batches
    members: list[list[int]] = [[] for _ in range(mini_batches)]
    for g in sorted(range(G), key=lambda g: (-int(groups[g].sum()), g)):
        k = min((k for k in range(mini_batches) if room[k]), key=lambda k: (load[k], len(members[k]), k))
        members[k].append(g)
        load[k] += int(groups[g].sum())
        room[k] -= 1
    out: list[list[np.ndarray]] = [[] for _ in range(ranks)]
    for k in range(mini_batches):
        rows = groups[sorted(members[k])].ravel()
        part = [0] * ranks
        mine: list[list[int]] = [[] for _ in range(ranks)]
        for i in sorted(range(len(rows)), key=lambda i: (-int(rows[i]), i)):
            r = min(range(ranks), key=lambda r: (part[r], len(mine[r]), r))
            mine[r].append(i)
            part[r] += int(rows[i])
        for r in range(ranks):
            out[r].append(rows[sorted(mine[r])])
    return out
