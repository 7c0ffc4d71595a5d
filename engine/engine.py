"""RolloutEngine: batched autoregressive generation with a slot-based KV cache.

Requests (token ids, a prompt id, n samples) are admitted into free slots: the prompt is
prefilled once and its cache shared by its n samples. Every decode step samples one token for
each active row with the noise-indexed sampler, then runs the model on those tokens. Rows that
finish leave their slot and the remaining rows are compacted into the first slots, so each step
only computes the rows still running (the long tail shrinks the batch). Tokens in, tokens out:
tokenisation lives with the caller.

Vocabulary: a *slot* is a row of the KV cache; *active* rows are slots 0..b-1; a *rollout* is
one finished sample.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from engine.checkpoint import load_checkpoint, parse_dtype
from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.model import Transformer, causal_mask
from engine.sampling import SamplingParams, prompt_key, row_keys, sample
from engine.types import GenerateStats, Request, Rollout


class SlotState:
    """Per-slot tensors of the running batch; rows move together when the batch is compacted."""

    def __init__(self, max_batch: int, max_new: int, vocab: int, device) -> None:
        self.keys = torch.zeros(max_batch, dtype=torch.long, device=device)  # noise key per row
        self.generated = torch.zeros(max_batch, dtype=torch.long, device=device)  # tokens so far
        self.rollout = torch.full((max_batch,), -1, dtype=torch.long, device=device)  # rollout index
        self.tokens = torch.zeros(max_batch, max_new, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(max_batch, max_new, dtype=torch.float32, device=device)
        self.logits = torch.zeros(max_batch, vocab, dtype=torch.float32, device=device)  # next-token logits
        self.last = torch.zeros(max_batch, dtype=torch.long, device=device)  # last sampled token
        self.active = 0

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.generated, self.rollout, self.tokens, self.logprobs, self.logits, self.last]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in self.tensors():
            t[dst] = t[src]


class RolloutEngine:
    def __init__(self, model: Transformer, cfg: EngineConfig | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        self.cfg.validate()
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.model = model.eval()
        self.max_len = min(self.cfg.max_len, model.config.max_position_embeddings)
        self.cache = KVCache.for_model(model.config, self.cfg.max_batch, self.max_len, model.dtype, model.device)
        self.last_stats = GenerateStats()

    @classmethod
    def from_pretrained(cls, path, cfg: EngineConfig | None = None) -> RolloutEngine:
        cfg = cfg or EngineConfig()
        return cls(load_checkpoint(path, parse_dtype(cfg.dtype), cfg.device), cfg)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def check(self, requests: list[Request]) -> None:
        for r in requests:
            if len(r.prompt) >= self.max_len:
                raise ValueError(
                    f"prompt {r.prompt_id!r} has {len(r.prompt)} tokens but the context holds {self.max_len} "
                    f"(engine.max_len, capped by the model's max_position_embeddings); shorten the prompt"
                )
            if r.n > self.cfg.max_batch:
                raise ValueError(f"request {r.prompt_id!r} asks for n={r.n} samples > engine.max_batch={self.cfg.max_batch}")
            bad = [t for t in r.prompt if not 0 <= t < self.model.config.vocab_size]
            if bad:
                raise ValueError(f"prompt {r.prompt_id!r} has token ids outside the vocabulary: {bad[:5]}")

    @torch.inference_mode()
    def generate(self, requests: list[Request], params: SamplingParams, progress=None) -> list[Rollout]:
        """Generates n samples per request; returns rollouts in request order, then sample order.

        `progress`, if given, is called with the number of rollouts finished so far.
        """
        self.check(requests)
        t0 = time.perf_counter()
        stats = self.last_stats = GenerateStats()
        state = SlotState(self.cfg.max_batch, params.max_new_tokens, self.model.config.vocab_size, self.device)
        rollouts: list[Rollout | None] = []
        meta: list[tuple[int, int, float]] = []  # per rollout: (request index, sample, admitted at)
        pending = deque(enumerate(requests))
        stop_ids = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=self.device)
        while pending or state.active:
            admitted = self._admit(pending, state, params, rollouts, meta, t0)
            stats.prefill_s += admitted
            b = state.active
            stats.batch_sizes.append(b)
            ts = time.perf_counter()
            tok, lp = sample(state.logits[:b], state.keys[:b], state.generated[:b], params)
            rows = torch.arange(b, device=self.device)
            state.tokens[rows, state.generated[:b]] = tok
            state.logprobs[rows, state.generated[:b]] = lp
            state.generated[:b] += 1
            state.last[:b] = tok
            stats.new_tokens += b
            stopped = torch.isin(tok, stop_ids)
            full = self.cache.lengths[:b] >= self.max_len
            done = stopped | full | (state.generated[:b] >= params.max_new_tokens)
            stats.sample_s += time.perf_counter() - ts
            if bool(done.any()):
                self._retire(state, done, stopped, rollouts, meta, requests, t0)
                if progress is not None:
                    progress(sum(r is not None for r in rollouts))
            b = state.active
            if b:
                td = time.perf_counter()
                state.logits[:b] = self._decode(state.last[:b])
                stats.decode_s += time.perf_counter() - td
        stats.wall_s = time.perf_counter() - t0
        return rollouts  # type: ignore[return-value]

    def _decode(self, tok: torch.Tensor) -> torch.Tensor:
        """One token for each active row: tok [b] -> next logits [b, V]."""
        b = tok.shape[0]
        pos = self.cache.lengths[:b].unsqueeze(1)  # [b, 1]
        out = self.model(tok.unsqueeze(1), pos, cache=self.cache)
        self.cache.lengths[:b] += 1
        return out.logits[:, -1].float()

    def _admit(self, pending, state: SlotState, params, rollouts, meta, t0) -> float:
        """Prefills as many pending requests as free slots allow; returns the seconds spent."""
        free = self.cfg.max_batch - state.active
        batch: list[tuple[int, Request]] = []
        while pending and pending[0][1].n <= free:
            free -= pending[0][1].n
            batch.append(pending.popleft())
        if not batch:
            return 0.0
        ts = time.perf_counter()
        base, P = state.active, len(batch)
        T = max(len(r.prompt) for _, r in batch)
        ids = torch.zeros(P, T, dtype=torch.long)
        for j, (_, r) in enumerate(batch):
            ids[j, : len(r.prompt)] = torch.tensor(r.prompt)
        ids = ids.to(self.device)
        lens = torch.tensor([len(r.prompt) for _, r in batch], device=self.device)
        pos = torch.arange(T, device=self.device).expand(P, T)
        view = self.cache.rows(base, base + P)
        out = self.model(ids, pos, cache=view, attn_mask=causal_mask(pos), logits=False)
        last = out.hidden[torch.arange(P), lens - 1]  # [P, H]
        logits = self.model.lm_head(last).float()  # [P, V]
        view.lengths[:] = lens
        # Slots of prompt j: starts[j] .. starts[j] + n - 1, and so are its rollout indices.
        starts, acc, now = [], base, time.perf_counter() - t0
        first = len(rollouts) - base
        for req_idx, r in batch:
            starts.append(acc)
            acc += r.n
            rollouts.extend([None] * r.n)
            meta.extend((req_idx, k, now) for k in range(r.n))
        # Fan prompt j out to its n slots; descending j never overwrites an unread prompt.
        for j in reversed(range(P)):
            r, s = batch[j][1], starts[j]
            slots = torch.arange(s, s + r.n, device=self.device)
            self.cache.copy_prefix(base + j, slots)
            state.logits[slots] = logits[j]
            key = torch.full((r.n,), prompt_key(r.prompt_id), dtype=torch.long, device=self.device)
            state.keys[slots] = row_keys(params.seed, params.step, key, slots - s)
            state.generated[slots] = 0
            state.rollout[slots] = slots + first
        state.active = acc
        return time.perf_counter() - ts

    def _retire(self, state: SlotState, done, stopped, rollouts, meta, requests, t0) -> None:
        b = state.active
        now = time.perf_counter() - t0
        for i in done.nonzero().squeeze(1).tolist():
            idx = int(state.rollout[i])
            req_idx, k, admitted = meta[idx]
            n = int(state.generated[i])
            rollouts[idx] = Rollout(
                prompt_id=requests[req_idx].prompt_id,
                sample=k,
                prompt_tokens=len(requests[req_idx].prompt),
                tokens=state.tokens[i, :n].tolist(),
                logprobs=state.logprobs[i, :n].tolist(),
                finish_reason="stop" if bool(stopped[i]) else "length",
                timings={"admitted_s": admitted, "finished_s": now},
            )
        keep = b - int(done.sum())
        holes = done[:keep].nonzero().squeeze(1)
        movers = (~done[keep:]).nonzero().squeeze(1) + keep
        if holes.numel():
            state.move(movers, holes)
            self.cache.move_rows(movers, holes)
        state.active = keep
