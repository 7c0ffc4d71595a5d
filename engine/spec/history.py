"""HistoryDrafter: drafts from the same prompt's earlier responses (RhymeRL, SuffixDecoding).

In RL on a fixed problem set a prompt recurs every epoch, and the policy's responses to it move
little between epochs; within a step a GRPO group's samples share much of their reasoning. The
drafter looks a row's recent tokens up in two suffix indexes of its prompt
(engine.spec.history_index): the run's `HistoryStore` (responses of earlier steps, kept across
steps by the run and saved in its checkpoints) and this step's *finished siblings* (rollouts of
the same prompt finished in this RL step, reported through `finish`; forgotten when a call starts
with another seed or step). Per row: the row's last `min_match` tokens select candidate
continuation starts (a dictionary read); each candidate's match is extended backwards up to
`max_match` tokens, and the longest match wins (ties: the latest, a finished sibling before the
store); the draft is the chain of up to `min(depth, verify_tokens)` tokens that followed it,
never crossing into another response. Rows without a candidate get no draft, so in a composition
(`history+eagle`) the next drafter takes them.

The per-row work is a dictionary read; matching and continuation are a few tensor ops over the
whole batch. Token ids only: chains without `q_logits` (coupled verification), no slot state.
`history_counts` and `history_metrics` read step records for the share of speculative row-steps
this drafter drafted and their accept length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.sampling import SamplingParams
from engine.spec.drafter import DraftContext, DrafterBase, DraftShape
from engine.spec.history_index import SEP, START, HistoryStore, SuffixIndex
from engine.spec.tree import DraftTree
from engine.types import StepRecord


class HistoryDrafter(DrafterBase):
    name = "history"

    def __init__(self, store: HistoryStore, *, max_candidates: int = 8, max_match: int = 32) -> None:
        if max_candidates < 1:
            raise ValueError(f"engine.spec.history_max_candidates must be >= 1, got {max_candidates}")
        if max_match < store.min_match:
            raise ValueError(f"history max_match ({max_match}) must be >= the store's min_match ({store.min_match})")
        self.store = store
        self.k = store.min_match
        self.max_candidates, self.max_match = max_candidates, max_match
        self._siblings: dict[str, SuffixIndex] = {}  # this step's finished responses, by prompt id
        self._step: tuple[int, int] | None = None

    def reset(self, max_batch: int, max_len: int, params: SamplingParams, limits: DraftShape) -> None:
        if self._step != (params.seed, params.step):
            self._siblings.clear()
            self._step = (params.seed, params.step)

    def finish(self, prompt_id: str, tokens: list[int]) -> None:
        self._siblings.setdefault(prompt_id, SuffixIndex(self.k)).add(tokens)

    def propose(self, ctx: DraftContext) -> DraftTree:
        b, D, M, K = ctx.roots.shape[0], ctx.shape.chain_len, self.max_match, self.max_candidates
        device = ctx.responses.device
        if b == 0:
            return DraftTree.empty(b, device)
        tails = _tails(ctx.responses[:b], ctx.generated[:b], M)  # [b, M] the last M tokens, START before the response
        keys = tails[:, M - self.k:].tolist()
        # Candidates per row, as positions in the concatenation of the corpora used this call.
        parts: list[torch.Tensor] = []
        where: dict[int, int] = {}  # id(index) -> its offset in the concatenation
        offset = M  # the concatenation opens with M SEP so backward windows stay in range
        rows, cands = [], []
        for r, pid in enumerate(ctx.prompt_ids[:b]):
            found: list[int] = []
            for index in (self.store.get(pid), self._siblings.get(pid)):  # the latter wins ties: listed last
                if index is None:
                    continue
                hits = index.candidates(tuple(keys[r]), K)
                if not hits:
                    continue
                if id(index) not in where:
                    where[id(index)] = offset
                    parts.append(index.tensor())
                    offset += index.num_tokens
                found += [where[id(index)] + p for p in hits]
            if found:
                rows.append(r)
                cands.append(found[-K:])
        if not rows:
            return DraftTree.empty(b, device)
        pad = torch.full((M,), SEP, dtype=torch.long)
        corpus = torch.cat([pad, *parts, torch.full((D,), SEP, dtype=torch.long)]).to(device)  # [C]
        starts = _pad_rows(cands, device)  # [R, K'] continuation starts, -1 pads
        row_idx = torch.tensor(rows, device=device)
        match = _match_lengths(corpus, starts, tails[row_idx])  # [R, K']
        best = starts.gather(1, (match * corpus.numel() + starts).argmax(1, keepdim=True)).squeeze(1)  # [R]
        cont = corpus[best.unsqueeze(1) + torch.arange(D, device=device)]  # [R, D]
        lens = (cont != SEP).long().cumprod(1).sum(1)
        tokens = torch.zeros(b, D, dtype=torch.long, device=device)
        lengths = torch.zeros(b, dtype=torch.long, device=device)
        tokens[row_idx] = torch.where(cont == SEP, 0, cont)
        lengths[row_idx] = lens
        return DraftTree.chains(tokens, lengths)


def _tails(responses: torch.Tensor, generated: torch.Tensor, M: int) -> torch.Tensor:
    """responses [b, L], generated [b] -> [b, M] each row's last M response tokens, START-padded on the left."""
    idx = generated.unsqueeze(1) - M + torch.arange(M, device=responses.device)  # [b, M]
    return torch.where(idx >= 0, responses.gather(1, idx.clamp(min=0)), START)


def _pad_rows(rows: list[list[int]], device) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def _match_lengths(corpus: torch.Tensor, starts: torch.Tensor, tails: torch.Tensor) -> torch.Tensor:
    """How many tokens before each continuation start equal the row's last tokens.

    corpus [C] (opens with M SEP), starts [R, K] (-1: none), tails [R, M] -> [R, K] in 0..M (-1 where none)."""
    M = tails.shape[1]
    back = torch.arange(1, M + 1, device=corpus.device)  # distance before the start
    window = corpus[(starts.clamp(min=M).unsqueeze(-1) - back)]  # [R, K, M] corpus[p - 1], corpus[p - 2], ...
    same = window == tails.flip(1).unsqueeze(1)  # [R, 1, M] the row's last token first
    return torch.where(starts >= 0, same.long().cumprod(-1).sum(-1), -1)


def history_counts(steps: list[StepRecord], source: int | None) -> list[float]:
    """[speculative row-steps, of them drafted by the history drafter, tokens those emitted]
    over a generate() call's step records (summable over calls and ranks). `source`: the
    drafter's index in its composition (StepRecord.source); a step without sources (a drafter
    alone) counts every row that got a draft."""
    rows = covered = emitted = 0
    drafted = history_drafted(source)
    for s in steps:
        if not s.speculative:
            continue
        rows += s.batch_size
        mine = [drafted(s, i) for i in range(s.batch_size)]
        covered += sum(mine)
        emitted += sum(e for e, m in zip(s.emitted, mine) if m)
    return [float(rows), float(covered), float(emitted)]


def history_drafted(source: int | None) -> Callable[[StepRecord, int], bool]:
    """Whether row i of a step record is a row-step the history drafter drafted (`source`: its index
    in the composition, as in history_counts)."""
    def drafted(s: StepRecord, i: int) -> bool:
        if not s.speculative or s.drafted[i] == 0:
            return False
        return source is None or s.source is None or s.source[i] == source
    return drafted


def history_metrics(counts: list[float]) -> dict[str, float]:
    """spec/history_coverage: the share of speculative row-steps the history drafter drafted;
    spec/history_accept_len: their mean emitted tokens (accepted + 1); {} without a speculative
    step. `counts`: history_counts' (summed)."""
    rows, covered, emitted = counts
    if rows == 0:
        return {}
    out = {"spec/history_coverage": covered / rows}
    if covered:
        out["spec/history_accept_len"] = emitted / covered
    return out
