"""RolloutEngine: batched generation with a slot-based KV cache, speculative or not.

Requests (token ids, a prompt id, n samples) are admitted into free slots: the prompt is
prefilled once, its cache shared by its n samples, and each sample's first token drawn. Every
decode step then runs the target on each active row's *root* (its last sampled token) followed
by the row's draft tree, if a drafter is attached and proposed one; samples the target's token
at every entry with the noise-indexed sampler; keeps the accepted path (engine.spec.verify);
and emits accepted tokens plus one bonus / correction token per row. With no draft this is
plain autoregressive decoding, through the same code. Rows that finish leave their slot and the
rest are compacted into the first slots, so the work shrinks with the batch (the long tail).

Tokens in, tokens out: tokenisation lives with the caller. Vocabulary: a *slot* is a row of the
KV cache; *active* rows are slots 0..b-1; a *rollout* is one finished sample.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from engine.checkpoint import load_checkpoint, parse_dtype
from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.layout import prepare_for_inference
from engine.packed import pack_model
from engine.model import Transformer, causal_mask
from engine.sampling import SamplingParams, mask_logits, prompt_key, row_keys, sample
from engine.spec.drafter import Admission, DraftContext, Drafter, DraftShape
from engine.spec.tree import DraftTree, tree_mask, tree_positions
from engine.spec.verify import Verdict, coupled_verify
from engine.types import GenerateStats, Request, Rollout


class SlotState:
    """Per-slot tensors of the running batch; rows move together when the batch is compacted."""

    def __init__(self, max_batch: int, max_new: int, device) -> None:
        z = lambda dtype=torch.long: torch.zeros(max_batch, dtype=dtype, device=device)  # noqa: E731
        self.keys = z()  # noise key per row
        self.generated = z()  # tokens emitted so far (the last one is the root)
        self.limit = z()  # most tokens this row may emit (max_new_tokens, or the context)
        self.rollout = z()  # index of the rollout this row produces
        self.stopped = z(torch.bool)
        self.done = z(torch.bool)
        self.tokens = torch.zeros(max_batch, max_new, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(max_batch, max_new, dtype=torch.float32, device=device)
        self.active = 0

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.generated, self.limit, self.rollout, self.stopped, self.done, self.tokens, self.logprobs]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in self.tensors():
            t[dst] = t[src]

    def roots(self, b: int) -> torch.Tensor:  # [b] last emitted token of each active row
        return self.tokens[:b].gather(1, (self.generated[:b] - 1).unsqueeze(1)).squeeze(1)


class RolloutEngine:
    def __init__(self, model: Transformer, cfg: EngineConfig | None = None, drafter: Drafter | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        self.cfg.validate()
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.model = model.eval()
        self.drafter = drafter
        for net in [model, *self._drafter_nets()]:
            prepare_for_inference(net)
        spec = self.cfg.spec
        self.shape = DraftShape(depth=spec.depth, topk=spec.topk, verify_tokens=spec.verify_tokens, iid_children=spec.verify == "rejection")
        self.max_len = min(self.cfg.max_len, model.config.max_position_embeddings)
        margin = self.shape.verify_tokens + 1 if drafter is not None else 0  # room for tentative tree entries
        self.cache = KVCache.for_model(model.config, self.cfg.max_batch, self.max_len + margin, model.dtype, model.device)
        # RoPE rows for every position the target and drafters reach (drafts run ahead of the cache).
        reach = self.max_len + margin + 2 * self.shape.verify_tokens + 2 * spec.depth + 2
        for net in [model, *self._drafter_nets()]:
            net.build_rope_table(reach)
        self.last_stats = GenerateStats()

    @classmethod
    def from_pretrained(cls, path, cfg: EngineConfig | None = None) -> RolloutEngine:
        from engine.spec.factory import build_drafter

        cfg = cfg or EngineConfig()
        model = load_checkpoint(path, parse_dtype(cfg.dtype), cfg.device)
        return cls(model, cfg, build_drafter(cfg.spec, model))

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

    def refresh_weights(self) -> None:
        """Re-packs the target's and drafters' inference copies after their weights changed (a
        policy update, `model.to(...)`): the compiled kernels read packed copies, not the
        parameters, so without this they would keep serving the old weights."""
        for net in [self.model, *self._drafter_nets()]:
            pack_model(net, refresh=True)

    def _drafter_nets(self) -> list:
        """The drafters' networks (a FallbackDrafter's parts too); model-free drafters have none."""
        if self.drafter is None:
            return []
        return [part.net for part in getattr(self.drafter, "drafters", [self.drafter]) if hasattr(part, "net")]

    @torch.inference_mode()
    def generate(self, requests: list[Request], params: SamplingParams, progress=None) -> list[Rollout]:
        """Generates n samples per request; returns rollouts in request order, then sample order.

        `progress`, if given, is called with the number of rollouts finished so far.
        """
        self.check(requests)
        run = _Run(self, requests, params, progress)
        if self.drafter is not None:
            self.drafter.reset(self.cfg.max_batch, self.max_len, params)
        while run.pending or run.state.active:
            run.admit()
            run.retire()
            if run.state.active:
                run.step()
                run.retire()
        run.stats.wall_s = time.perf_counter() - run.t0
        self.last_stats = run.stats
        return run.rollouts  # type: ignore[return-value]


class _Run:
    """The state of one generate() call."""

    def __init__(self, engine: RolloutEngine, requests: list[Request], params: SamplingParams, progress) -> None:
        self.e, self.requests, self.params, self.progress = engine, requests, params, progress
        self.device = engine.device
        self.t0 = time.perf_counter()
        self.stats = GenerateStats()
        self.state = SlotState(engine.cfg.max_batch, params.max_new_tokens, self.device)
        self.rollouts: list[Rollout | None] = []
        self.meta: list[tuple[int, int, float]] = []  # per rollout: (request index, sample, admitted at)
        self.pending = deque(enumerate(requests))
        self.stop_ids = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=self.device)
        self.prompt_ids: list[str] = [""] * engine.cfg.max_batch  # per slot
        self.prompts: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long)] * engine.cfg.max_batch

    # -- admission -------------------------------------------------------------------------
    def admit(self) -> None:
        """Prefills as many pending requests as free slots allow and draws their first tokens."""
        state, e = self.state, self.e
        free = e.cfg.max_batch - state.active
        batch: list[tuple[int, Request]] = []
        while self.pending and self.pending[0][1].n <= free:
            free -= self.pending[0][1].n
            batch.append(self.pending.popleft())
        if not batch:
            return
        ts = time.perf_counter()
        base, P = state.active, len(batch)
        T = max(len(r.prompt) for _, r in batch)
        ids = torch.zeros(P, T, dtype=torch.long)
        for j, (_, r) in enumerate(batch):
            ids[j, : len(r.prompt)] = torch.tensor(r.prompt)
        ids = ids.to(self.device)
        lens = torch.tensor([len(r.prompt) for _, r in batch], device=self.device)
        pos = torch.arange(T, device=self.device).expand(P, T)
        view = e.cache.rows(base, base + P)
        out = e.model(ids, pos, cache=view, attn_mask=causal_mask(pos), logits=False, hidden_layers=self._feature_layers())
        logits = e.model.lm_head(out.hidden[torch.arange(P), lens - 1]).float()  # [P, V]
        feats = self._features(out)
        view.lengths[:] = lens
        # Slots of prompt j: starts[j] .. starts[j] + n - 1, and so are its rollout indices.
        starts, acc, now = [], base, time.perf_counter() - self.t0
        first = len(self.rollouts) - base
        for req_idx, r in batch:
            starts.append(acc)
            acc += r.n
            self.rollouts.extend([None] * r.n)
            self.meta.extend((req_idx, k, now) for k in range(r.n))
        # Fan prompt j out to its n slots; descending j never overwrites an unread prompt.
        for j in reversed(range(P)):
            r, s = batch[j][1], starts[j]
            slots = torch.arange(s, s + r.n, device=self.device)
            e.cache.copy_prefix(base + j, slots)
            key = torch.full((r.n,), prompt_key(r.prompt_id), dtype=torch.long, device=self.device)
            state.keys[slots] = row_keys(self.params.seed, self.params.step, key, slots - s)
            state.generated[slots] = 0
            state.limit[slots] = min(self.params.max_new_tokens, e.max_len - len(r.prompt) + 1)
            state.rollout[slots] = slots + first
            state.stopped[slots] = False
            state.done[slots] = False
            prompt = ids[j, : len(r.prompt)]
            for slot in range(s, s + r.n):
                self.prompt_ids[slot], self.prompts[slot] = r.prompt_id, prompt
        state.active = acc
        owner = torch.repeat_interleave(torch.arange(P, device=self.device), torch.tensor([r.n for _, r in batch], device=self.device))
        rows = torch.arange(base, acc, device=self.device)
        if e.drafter is not None:
            e.drafter.admit(Admission(slots=rows, owner=owner, tokens=ids, lengths=lens, features=feats))
        # First tokens: every sample of prompt j draws from prompt j's last logits.
        tok, lp = sample(logits[owner], state.keys[rows], state.generated[rows], self.params)
        self._emit(rows, tok.unsqueeze(1), lp.unsqueeze(1), torch.ones_like(tok))
        self.stats.prefill_s += time.perf_counter() - ts

    def _feature_layers(self) -> tuple[int, ...]:
        d = self.e.drafter
        return tuple(d.feature_layers) if d is not None else ()

    def _features(self, out) -> torch.Tensor | None:
        """The drafter's target features: outputs of its auxiliary layers, then the final hidden."""
        d = self.e.drafter
        if d is None or not (d.feature_layers or getattr(d, "wants_features", False)):
            return None
        return torch.cat([out.layer_hidden[i] for i in d.feature_layers] + [out.hidden], -1)

    # -- decoding --------------------------------------------------------------------------
    def step(self) -> None:
        """One verify pass over [root, draft tree] for every active row."""
        state, e, b = self.state, self.e, self.state.active
        self.stats.batch_sizes.append(b)
        tree = self._propose(b)
        pt = tree.padded()
        N = pt.width
        if N == 0:
            return self._plain_step(b)
        lengths = e.cache.lengths[:b]
        pos, slots = tree_positions(pt.depth, lengths)  # [b, 1+N]
        visible = int(lengths.max()) + N + 1
        mask = causal_mask(slots, visible) if pt.chain else tree_mask(pt.parents, pt.valid, lengths, visible)
        entries = torch.cat([state.roots(b).unsqueeze(1), pt.tokens], 1)  # [b, 1+N]
        td = time.perf_counter()
        out = e.model(entries, pos, cache=e.cache, cache_pos=slots, attn_mask=mask, hidden_layers=self._feature_layers())
        self.stats.decode_s += time.perf_counter() - td
        ts = time.perf_counter()
        logits = out.logits.float()  # [b, 1+N, V]
        noise_pos = state.generated[:b].unsqueeze(1) + torch.cat([torch.zeros(b, 1, dtype=torch.long, device=self.device), pt.depth], 1)
        flat_keys = state.keys[:b].repeat_interleave(N + 1)
        target, logp = sample(logits.view(b * (N + 1), -1), flat_keys, noise_pos.reshape(-1), self.params)
        target, logp = target.view(b, N + 1), logp.view(b, N + 1)
        verdict = self._verify(pt, logits, target, state.keys[:b], noise_pos)
        # Commit the root, then move the accepted path's entries into place.
        lengths += 1
        e.cache.commit_path(torch.where(verdict.path >= 0, verdict.path + lengths.unsqueeze(1), 0), verdict.num_accepted)
        # Log-prob of each emitted token: at the entry it was sampled from (root, then path nodes).
        src = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=self.device), verdict.path + 1], 1).clamp(min=0)  # [b, N+1]
        self._emit(torch.arange(b, device=self.device), verdict.tokens, self._emitted_logprobs(logits, logp, src, verdict), verdict.num_emitted)
        if e.drafter is not None:
            e.drafter.update(verdict, self._features(out))
            self.stats.drafted += int(pt.valid.sum())
            self.stats.accepted += int(verdict.num_accepted.sum())
            self.stats.accept_hist.extend(verdict.num_emitted.tolist())
        self.stats.sample_s += time.perf_counter() - ts

    def _plain_step(self, b: int) -> None:
        """Autoregressive decoding (no draft this step): the general step without tree bookkeeping."""
        state, e = self.state, self.e
        lengths = e.cache.lengths[:b]
        pos = lengths.unsqueeze(1)  # [b, 1]: the root's position and cache slot
        mask = causal_mask(pos, int(lengths.max()) + 1)  # [b, 1, S]
        td = time.perf_counter()
        out = e.model(state.roots(b).unsqueeze(1), pos, cache=e.cache, cache_pos=pos, attn_mask=mask,
                      hidden_layers=self._feature_layers())
        self.stats.decode_s += time.perf_counter() - td
        ts = time.perf_counter()
        token, logp = sample(out.logits[:, 0].float(), state.keys[:b], state.generated[:b], self.params)  # [b]
        lengths += 1
        ones = torch.ones(b, dtype=torch.long, device=self.device)
        self._emit(torch.arange(b, device=self.device), token.unsqueeze(1), logp.unsqueeze(1), ones)
        if e.drafter is not None:
            empty = torch.empty(b, 0, dtype=torch.long, device=self.device)
            verdict = Verdict(accepted=empty.bool(), num_accepted=ones - 1, last_index=ones - 1, path=empty,
                              tokens=token.unsqueeze(1), num_emitted=ones)
            e.drafter.update(verdict, self._features(out))
            self.stats.accept_hist.extend([1] * b)
        self.stats.sample_s += time.perf_counter() - ts

    def _propose(self, b: int) -> DraftTree:
        e = self.e
        if e.drafter is None:
            return DraftTree.empty(b, self.device)
        t = time.perf_counter()
        state = self.state
        ctx = DraftContext(
            roots=state.roots(b), positions=state.generated[:b] - 1, keys=state.keys[:b], responses=state.tokens[:b],
            generated=state.generated[:b], prompts=self.prompts[:b], prompt_ids=self.prompt_ids[:b], params=self.params,
            shape=e.shape,
        )
        tree = e.drafter.propose(ctx)
        self.stats.draft_s += time.perf_counter() - t
        return tree

    def _verify(self, pt, logits, target, keys, noise_pos) -> Verdict:
        if self.e.cfg.spec.verify == "rejection" and self.params.temperature > 0 and pt.width:
            from engine.spec.verify_rejection import rejection_verify

            p_logits = mask_logits(logits.flatten(0, 1), self.params.temperature, self.params.top_k, self.params.top_p)
            return rejection_verify(pt, p_logits.view_as(logits), keys, noise_pos)
        return coupled_verify(pt.tokens, pt.parents, pt.valid, target, chain=pt.chain)

    def _emitted_logprobs(self, logits, logp, src, verdict: Verdict) -> torch.Tensor:
        """[b, N+1] log-prob of each emitted token under the sampling distribution at its entry."""
        if self.e.cfg.spec.verify == "coupled" or self.params.temperature == 0:
            return logp.gather(1, src)  # coupled: emitted tokens are the target's own samples
        p = self.params
        at = logits.gather(1, src.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))  # [b, N+1, V]
        masked = mask_logits(at.flatten(0, 1), p.temperature, p.top_k, p.top_p).log_softmax(-1).view_as(at)
        return masked.gather(2, verdict.tokens.unsqueeze(-1)).squeeze(-1)

    def _emit(self, rows: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, counts: torch.Tensor) -> None:
        """Appends up to counts[i] of tokens[i] ([R, K]) to rows[i], cut at a stop token or the limit."""
        state = self.state
        R, K = tokens.shape
        k = torch.arange(K, device=self.device).expand(R, K)
        gen, limit = state.generated[rows], state.limit[rows]
        is_stop = torch.isin(tokens, self.stop_ids) & (k < counts.unsqueeze(1))
        first_stop = torch.where(is_stop.any(1), is_stop.int().argmax(1), K)
        n = torch.minimum(torch.minimum(counts, first_stop + 1), limit - gen)
        keep = k < n.unsqueeze(1)
        r_idx, c_idx = rows.unsqueeze(1).expand(R, K)[keep], (gen.unsqueeze(1) + k)[keep]
        state.tokens[r_idx, c_idx] = tokens[keep]
        state.logprobs[r_idx, c_idx] = logprobs[keep].float()
        state.generated[rows] = gen + n
        state.stopped[rows] = first_stop < n
        state.done[rows] = state.stopped[rows] | (gen + n >= limit)
        self.stats.new_tokens += int(n.sum())

    # -- retirement ------------------------------------------------------------------------
    def retire(self) -> None:
        """Turns finished rows into rollouts and compacts the active rows into the first slots."""
        state, e = self.state, self.e
        b = state.active
        done = state.done[:b]
        if not bool(done.any()):
            return
        now = time.perf_counter() - self.t0
        for i in done.nonzero().squeeze(1).tolist():
            idx = int(state.rollout[i])
            req_idx, k, admitted = self.meta[idx]
            n = int(state.generated[i])
            req = self.requests[req_idx]
            self.rollouts[idx] = Rollout(
                prompt_id=req.prompt_id, sample=k, prompt_tokens=len(req.prompt), tokens=state.tokens[i, :n].tolist(),
                logprobs=state.logprobs[i, :n].tolist(), finish_reason="stop" if bool(state.stopped[i]) else "length",
                timings={"admitted_s": admitted, "finished_s": now},
            )
            if e.drafter is not None:
                e.drafter.finish(req.prompt_id, self.rollouts[idx].tokens)
        keep = b - int(done.sum())
        holes = done[:keep].nonzero().squeeze(1)
        movers = (~done[keep:]).nonzero().squeeze(1) + keep
        if holes.numel():
            state.move(movers, holes)
            e.cache.move_rows(movers, holes)
            for s, d in zip(movers.tolist(), holes.tolist()):
                self.prompt_ids[d], self.prompts[d] = self.prompt_ids[s], self.prompts[s]
            if e.drafter is not None:
                e.drafter.move_rows(movers, holes)
        state.active = keep
        if self.progress is not None:
            self.progress(sum(r is not None for r in self.rollouts))
