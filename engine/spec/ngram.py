"""NgramDrafter: model-free drafts by suffix match over a prompt's text and its sibling responses.

For each active row, the last n tokens of its sequence (prompt + response so far; n from
`max_ngram` down to `min_ngram`, the longest n that matches anywhere wins) are looked up in the
row's *corpus*: its prompt, the responses so far of every active row of the same prompt id (its
own included, a GRPO group's siblings besides), and the responses of finished rollouts of that
prompt, reported through `finish` (in a group they are the richest source: complete responses
to the same question). The tokens that followed each earlier occurrence are *continuations*
(at most `ctx.shape.depth` tokens, never crossing from one response into another).

Continuations are merged into a trie whose node *weight* is the number of continuations through
it: an estimate of how likely the target's sample is to follow that path. The draft keeps, per
node, its `topk` heaviest children and then, per row, its `verify_tokens` heaviest nodes (a
child never outweighs its parent, so the kept nodes form a tree, emitted parents first). With
topk = 1 that is a chain: the path most continuations agree on. Ties go to the more recent
source: finished responses (newest first), then active rows, then the prompt; within one
source, later occurrences first. Only the `max_matches` most recent occurrences are counted.

It knows token ids only: no model and no logits, so its trees carry no `q_logits` (they are for
coupled verification, not rejection sampling), and drafts ignore temperature and noise keys.
Its only state is the finished responses, keyed by prompt id, never by slot: batch compaction
(`move_rows`) needs nothing. They are kept across the generate() calls of one RL step (the same
sampling seed and step: a GRPO group served in several calls still drafts from its finished
siblings) and forgotten when a call starts with another seed or step.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.nn.functional as F

from engine.sampling import SamplingParams
from engine.spec.drafter import DraftContext, DrafterBase, DraftShape
from engine.spec.tree import DraftTree

SEP = -1  # separates corpus segments; no token id equals it, so no match spans two segments


class NgramDrafter(DrafterBase):
    name = "ngram"

    def __init__(self, *, max_ngram: int = 4, min_ngram: int = 2, max_matches: int = 32,
                 max_finished: int = 16) -> None:
        if min_ngram < 1:
            raise ValueError(f"min_ngram must be >= 1, got {min_ngram}")
        if max_ngram < min_ngram:
            raise ValueError(f"max_ngram ({max_ngram}) must be >= min_ngram ({min_ngram})")
        if max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {max_matches}")
        if max_finished < 0:
            raise ValueError(f"max_finished must be >= 0, got {max_finished}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = max_matches  # occurrences counted per row, most recent first
        self.max_finished = max_finished  # finished responses remembered per prompt, newest kept
        self._finished: dict[str, deque[torch.Tensor]] = {}
        self._finished_corpus: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # per prompt, on device
        self._step: tuple[int, int] | None = None  # (seed, RL step) the finished responses belong to

    def reset(self, max_batch: int, max_len: int, params: SamplingParams, limits: DraftShape) -> None:
        if self._step != (params.seed, params.step):
            self._finished.clear()
            self._finished_corpus.clear()
            self._step = (params.seed, params.step)

    def finish(self, prompt_id: str, tokens: list[int]) -> None:
        if self.max_finished == 0 or not tokens:
            return
        memory = self._finished.setdefault(prompt_id, deque(maxlen=self.max_finished))
        memory.append(torch.tensor(tokens, dtype=torch.long))
        self._finished_corpus.pop(prompt_id, None)

    def propose(self, ctx: DraftContext) -> DraftTree:
        b = ctx.roots.shape[0]
        device = ctx.responses.device
        depth, topk, budget = ctx.shape.depth, ctx.shape.topk, ctx.shape.verify_tokens
        if b == 0 or min(depth, topk, budget) < 1:
            return DraftTree.empty(b, device)
        generated = ctx.generated.tolist()
        responses = [ctx.responses[r, :generated[r]] for r in range(b)]
        prompts = [p.to(device) for p in ctx.prompts]
        groups: dict[str, list[int]] = {}
        for r, pid in enumerate(ctx.prompt_ids):
            groups.setdefault(pid, []).append(r)

        rows, tokens, lengths = [], [], []
        for pid, members in groups.items():
            prompt = prompts[members[0]]
            corpus, start_ok = self._group_corpus(pid, prompt, [responses[r] for r in members])
            lead = prompt[-self.max_ngram:]
            tails = {r: torch.cat([lead, responses[r][-self.max_ngram:]])[-self.max_ngram:] for r in members}
            pending = set(members)
            for n in range(self.max_ngram, self.min_ngram - 1, -1):
                asked = [r for r in members if r in pending and tails[r].numel() >= n]
                if not asked:
                    continue
                suffixes = torch.stack([tails[r][-n:] for r in asked])  # [R, n]
                starts = suffix_matches(corpus, start_ok, suffixes, self.max_matches)  # [R, K]
                cont, lens = continuations(corpus, starts, depth)  # [R, K, D], [R, K]
                found = lens > 0
                row_ids = torch.tensor(asked, device=device).unsqueeze(1).expand_as(lens)
                rows.append(row_ids[found])
                tokens.append(cont[found])
                lengths.append(lens[found])
                pending -= {r for r, hit in zip(asked, found.any(1).tolist()) if hit}
        if not rows:
            return DraftTree.empty(b, device)
        return continuation_trie(torch.cat(rows), torch.cat(tokens), torch.cat(lengths), b, topk, budget)

    def _group_corpus(self, prompt_id: str, prompt: torch.Tensor,
                      active: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A prompt's corpus [C] and where a continuation may start [C] (bool).

        Segments, oldest source first: the prompt, the active rows' responses, the finished
        responses (oldest to newest). A response segment opens with the prompt's last
        `max_ngram` tokens, so a match ending in the prompt can continue into the response;
        continuations start only in the response part, so prompt text is counted once.
        """
        cached = self._finished_corpus.get(prompt_id)
        if cached is None or cached[0].device != prompt.device:
            finished = [f.to(prompt.device) for f in self._finished.get(prompt_id, ())]
            cached = response_segments(prompt[-self.max_ngram:], finished)
            self._finished_corpus[prompt_id] = cached
        own_prompt = response_segments(prompt[:0], [prompt])
        rows = response_segments(prompt[-self.max_ngram:], active)
        return torch.cat([own_prompt[0], rows[0], cached[0]]), torch.cat([own_prompt[1], rows[1], cached[1]])


def response_segments(lead: torch.Tensor, responses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[lead, response, SEP] per response -> (tokens [C], continuation may start here [C] bool)."""
    device = lead.device
    if not responses:
        return torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, dtype=torch.bool, device=device)
    sep = torch.full((1,), SEP, dtype=torch.long, device=device)
    tokens, ok = [], []
    for resp in responses:
        tokens += [lead, resp, sep]
        ok += [torch.zeros(lead.numel(), dtype=torch.bool, device=device),
               torch.ones(resp.numel(), dtype=torch.bool, device=device),
               torch.zeros(1, dtype=torch.bool, device=device)]
    return torch.cat(tokens), torch.cat(ok)


def suffix_matches(corpus: torch.Tensor, start_ok: torch.Tensor, suffixes: torch.Tensor, limit: int) -> torch.Tensor:
    """Where the continuations of each suffix's latest occurrences start.

    corpus [C] (ends with SEP), start_ok [C], suffixes [R, n] -> starts [R, K] corpus positions
    right after an occurrence, latest first, K <= limit; -1 pads rows with fewer. An occurrence
    counts only if a continuation may start right after it (so a row's own suffix, followed by
    SEP, never matches itself).
    """
    R, n = suffixes.shape
    W = corpus.numel() - n  # windows [i, i + n) that have a next position i + n
    if W <= 0:
        return torch.full((R, 0), -1, dtype=torch.long, device=corpus.device)
    hit = start_ok[n:].expand(R, W).clone()  # [R, W]
    for k in range(n):  # one [R, W] comparison per suffix position, not an [R, W, n] window stack
        hit &= corpus[k:k + W] == suffixes[:, k:k + 1]
    after = torch.arange(n, n + W, device=corpus.device)
    return torch.where(hit, after, -1).topk(min(limit, W), dim=1).values


def continuations(corpus: torch.Tensor, starts: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """starts [R, K] (-1 = none) -> tokens [R, K, depth] (SEP past the end), lengths [R, K].

    A continuation stops at the end of its segment.
    """
    padded = F.pad(corpus, (0, depth), value=SEP)
    idx = starts.clamp(min=0).unsqueeze(-1) + torch.arange(depth, device=corpus.device)  # [R, K, D]
    tokens = padded[idx]
    live = (tokens != SEP).long().cumprod(-1).bool() & (starts >= 0).unsqueeze(-1)
    return torch.where(live, tokens, SEP), live.sum(-1)


def continuation_trie(rows: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, batch: int,
                      topk: int, budget: int) -> DraftTree:
    """Merge continuations into one trie per row and keep its heaviest nodes.

    rows [M] each continuation's row; tokens [M, D] (SEP past lengths [M] >= 1); within a row,
    continuations come in priority order. A node is a distinct (row, prefix), its weight the
    number of continuations sharing that prefix. Keeps per node its `topk` heaviest children
    (ties: higher priority), then per row its `budget` heaviest nodes (ties: shallower, then
    higher priority), in that order: topological, since a child never outweighs its parent.
    """
    device = rows.device
    if rows.numel() == 0:
        return DraftTree.empty(batch, device)
    row, tok, parent, weight, first, depth = trie_nodes(rows, tokens, lengths)
    N = row.numel()

    # Siblings share a parent, or the root of their row (encoded as -(row + 1)).
    family = torch.where(parent >= 0, parent, -(row + 1))
    order = lexsort(family, -weight, first)
    ranked = family[order]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(N, device=device) - torch.searchsorted(ranked, ranked)
    keep = rank < topk
    for _ in range(int(depth.max()) - 1):  # a node survives only with its ancestors: one level a pass
        keep &= torch.where(parent >= 0, keep[parent.clamp(min=0)], True)

    kept = keep.nonzero().squeeze(1)
    kept = kept[lexsort(row[kept], -weight[kept], depth[kept], first[kept])]
    kept_rows = row[kept]
    slot = torch.arange(kept.numel(), device=device) - torch.searchsorted(kept_rows, kept_rows)
    kept, slot = kept[slot < budget], slot[slot < budget]
    index_in_row = torch.full((N,), -1, dtype=torch.long, device=device)
    index_in_row[kept] = slot
    par = parent[kept]
    parents = torch.where(par >= 0, index_in_row[par.clamp(min=0)], -1)
    offsets = torch.zeros(batch + 1, dtype=torch.long, device=device)
    offsets[1:] = torch.bincount(row[kept], minlength=batch).cumsum(0)
    return DraftTree(tok[kept], parents, offsets)


def trie_nodes(rows: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The distinct (row, prefix) nodes of M >= 1 continuations, level by level.

    Returns per node [N]: row, last token, parent (global node index, -1 = root), weight (number of
    continuations through it), first (highest-priority continuation through it), depth (1-based).
    """
    M = rows.numel()
    device = rows.device
    prio = torch.arange(M, device=device)
    node_of = torch.full((M,), -1, dtype=torch.long, device=device)  # each continuation's node one level up
    levels, base = [], 0
    for d in range(int(lengths.max())):
        alive = lengths > d
        key = torch.cat([rows[alive].unsqueeze(1), tokens[alive, :d + 1]], 1)  # [A, 1 + d + 1]
        uniq, inv, weight = torch.unique(key, dim=0, return_inverse=True, return_counts=True)
        U = uniq.shape[0]
        parent = torch.full((U,), -1, dtype=torch.long, device=device).scatter(0, inv, node_of[alive])
        first = torch.full((U,), M, dtype=torch.long, device=device).scatter_reduce(0, inv, prio[alive], "amin")
        levels.append((uniq[:, 0], uniq[:, -1], parent, weight, first, torch.full((U,), d + 1, device=device)))
        node_of = torch.full((M,), -1, dtype=torch.long, device=device)
        node_of[alive] = base + inv
        base += U
    return tuple(torch.cat(part) for part in zip(*levels))


def lexsort(*keys: torch.Tensor) -> torch.Tensor:
    """Indices that sort by keys[0], then keys[1], ... (all [N], ascending)."""
    order = torch.arange(keys[0].numel(), device=keys[0].device)
    for key in reversed(keys):
        order = order[torch.sort(key[order], stable=True).indices]
    return order
