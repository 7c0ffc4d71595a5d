"""The history of a prompt's responses, indexed for suffix lookups; and a bounded store of them.

Vocabulary: a prompt's *corpus* is its responses joined as segments `[START * (k - 1), response,
SEP]` (k = `min_match`); a *key* is k consecutive corpus tokens, and the index maps each key to
the *continuation starts* that follow it: the corpus positions p with corpus[p - k : p] == key
inside one segment and corpus[p] a response token. A row whose last k tokens (its response,
left-padded with START) equal a key continues, probably, as the corpus does after it. START pads
the first tokens of a response, so a row one token into its response already has a key.

`SuffixIndex` is one prompt's corpus and key index: adding a response costs O(its length)
dictionary inserts; a lookup is one dictionary read of a k-tuple. The caller extends matches
backwards and picks among the candidates with tensor ops (engine.spec.history).

`HistoryStore` keeps the indexes of many prompts across RL steps, bounded: at most
`max_responses` responses per prompt (the oldest dropped), `max_prompts` prompts and
`max_tokens` corpus tokens in all (the least recently used prompt evicted first). It also
predicts a prompt's response length (the mean of its kept responses). Its state is plain JSON
(the responses, in use order), saved with run checkpoints. It knows token ids only: nothing of
rows, ranks, sampling or steps.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

SEP = -1  # ends a segment (engine.spec.ngram.SEP: no token id equals it)
START = -2  # pads the first k - 1 key positions of a segment, and of a row shorter than k


class SuffixIndex:
    """One prompt's responses: the corpus and its key -> continuation-starts index."""

    def __init__(self, min_match: int) -> None:
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        self.k = min_match
        self.corpus: list[int] = []
        self.keys: dict[tuple[int, ...], list[int]] = {}  # key -> continuation starts, ascending (latest last)
        self.lengths: list[int] = []  # each response's length, in the order added
        self._tensor: torch.Tensor | None = None

    def add(self, response: list[int]) -> None:
        """Appends one response as a segment and indexes its continuation starts."""
        if not response:
            return
        base = len(self.corpus) + self.k - 1  # corpus position of the response's first token
        seg = [START] * (self.k - 1) + list(response)
        for j in range(1, len(response)):  # key seg[j - 1 : j - 1 + k] ends right before response token j
            self.keys.setdefault(tuple(seg[j - 1 : j - 1 + self.k]), []).append(base + j)
        self.corpus += seg
        self.corpus.append(SEP)
        self.lengths.append(len(response))
        self._tensor = None

    def candidates(self, key: tuple[int, ...], limit: int) -> list[int]:
        """The latest `limit` continuation starts after `key` (ascending), or []."""
        return self.keys.get(key, [])[-limit:]

    def tensor(self) -> torch.Tensor:
        """[C] the corpus (built once per change)."""
        if self._tensor is None:
            self._tensor = torch.tensor(self.corpus, dtype=torch.long)
        return self._tensor

    @property
    def num_tokens(self) -> int:
        return len(self.corpus)

    def responses(self) -> list[list[int]]:
        """The responses, oldest first (the corpus's segments without their padding)."""
        out, start = [], 0
        for n in self.lengths:
            start += self.k - 1
            out.append(self.corpus[start : start + n])
            start += n + 1
        return out


class HistoryStore:
    """Indexes of many prompts' earlier responses, bounded by prompts, tokens and responses per prompt."""

    def __init__(self, *, max_prompts: int = 4096, max_tokens: int = 2_000_000, max_responses: int = 16,
                 min_match: int = 3) -> None:
        for key, value in (("max_prompts", max_prompts), ("max_tokens", max_tokens), ("max_responses", max_responses),
                           ("min_match", min_match)):
            if value < 1:
                raise ValueError(f"engine.spec.history_{key} must be >= 1, got {value}")
        self.max_prompts, self.max_tokens, self.max_responses, self.min_match = max_prompts, max_tokens, max_responses, min_match
        self._prompts: OrderedDict[str, SuffixIndex] = OrderedDict()  # least recently used first
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._prompts)

    def __contains__(self, prompt_id: str) -> bool:
        return prompt_id in self._prompts

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def get(self, prompt_id: str) -> SuffixIndex | None:
        """The prompt's index (a lookup: it does not count as a use for eviction), or None."""
        return self._prompts.get(prompt_id)

    def add(self, prompt_id: str, responses: list[list[int]]) -> None:
        """Adds a prompt's new responses (newest last), marks it most recently used, then evicts."""
        responses = [r for r in responses if r]
        if not responses:
            return
        index = self._prompts.pop(prompt_id, None)
        kept = (index.responses() if index is not None else []) + responses
        if index is None or len(kept) > self.max_responses:
            if index is not None:
                self._tokens -= index.num_tokens
            index = SuffixIndex(self.min_match)
            responses = kept[-self.max_responses:]
        before = index.num_tokens
        for r in responses:
            index.add(r)
        self._tokens += index.num_tokens - before
        self._prompts[prompt_id] = index
        self._evict()

    def _evict(self) -> None:
        while self._prompts and (len(self._prompts) > self.max_prompts or self._tokens > self.max_tokens):
            _, index = self._prompts.popitem(last=False)
            self._tokens -= index.num_tokens

    def predicted_length(self, prompt_id: str) -> float | None:
        """The mean length of the prompt's kept responses, or None for a prompt never seen (or evicted)."""
        index = self._prompts.get(prompt_id)
        return sum(index.lengths) / len(index.lengths) if index is not None else None

    def state_dict(self) -> dict:
        return {"prompts": [[pid, index.responses()] for pid, index in self._prompts.items()], "min_match": self.min_match}

    def load_state_dict(self, state: dict) -> None:
        """Replaces the contents with a saved store's (bounded by this store's limits)."""
        try:
            entries = [(str(pid), [[int(t) for t in r] for r in responses]) for pid, responses in state["prompts"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"history store state is malformed ({type(e).__name__}: {e})") from None
        self._prompts.clear()
        self._tokens = 0
        for pid, responses in entries:
            self.add(pid, responses)
