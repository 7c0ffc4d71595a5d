"""One generate() call: admission, decode steps and retirement over the engine's slots.

Requests are admitted in order into free slots (engine.admission): a prompt is prefilled once
and its cache shared by its samples, and each sample's first token is drawn. A `RequestSource`
(engine.source), if given, is asked for more requests before every admission until it has none
left; they join the queue after those already there. A request with more
samples than the batch holds is admitted in chunks: its prefill (KV rows, last logits, features)
is kept aside and copied into the slots of each later chunk, never recomputed.

Each decode step asks the speculation policy for a shape (or off), runs the target on every
active row's *root* (its last sampled token) followed by the row's draft tree, samples the
target's token at every entry with the noise-indexed sampler, keeps the accepted path
(engine.spec.verify), emits accepted tokens plus one bonus / correction token per row, tells
the drafter and the feature sink, and appends a `StepRecord`. With no draft this is plain
autoregressive decoding. Rows that finish become rollouts and leave their slot; the rest are
compacted into the first slots, so the work shrinks with the batch (the long tail).

The step's target forward is chosen once per call: the engine's CUDA graphs where it has them
(engine.graphs.DecodeGraphs; a shape without a graph runs eager), else the eager runtime.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from engine.admission import Pending, Prefill, admission_record, right_pad, take_chunks

from engine.features import CommittedFeatures, target_features
from engine.model import ModelOutput, causal_mask
from engine.row_steps import finished_only
from engine.sampling import SamplingParams, gumbel, mask_logits, prompt_key, row_keys, sample
from engine.slots import SlotState
from engine.source import RequestSource
from engine.spec.drafter import DraftContext, DraftShape
from engine.spec.pregenerated import sibling_corpus
from engine.spec.tree import DraftTree, PaddedTree, tree_mask, tree_positions
from engine.spec.verify import Verdict, coupled_chain_verdict, coupled_verify
from engine.types import FinishReason, Request, Rollout, RolloutBatch, StepRecord


def _sync(device: torch.device) -> None:
    """Waits for the device, so that step timings are true on asynchronous devices."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GenerateRun:
    def __init__(self, engine, requests: list[Request], params: SamplingParams, progress, should_stop=None,
                 source: RequestSource | None = None) -> None:
        self.e, self.requests, self.params, self.progress = engine, list(requests), params, progress
        self.source = source  # None once it has nothing left
        self.should_stop = should_stop
        self.device = engine.device
        self.t0 = time.perf_counter()
        self.prefill_s = 0.0
        self.steps: list[StepRecord] = []
        self.state = SlotState(engine.cfg.max_batch, params.max_new_tokens, self.device)
        self.rollouts: list[Rollout | None] = []
        self.meta: list[tuple[int, int, float]] = []  # per rollout: (request index, sample, admitted at)
        self.pending = deque(Pending(i, r, r.first_sample, r.n) for i, r in enumerate(requests))
        self.kept: dict[int, Prefill] = {}
        self.stop_ids = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=self.device)
        drafter, sink = engine.drafter, engine.sink
        self.drafter_layers = tuple(drafter.feature_layers) if drafter is not None else ()
        self.drafter_wants = drafter is not None and bool(drafter.feature_layers or drafter.wants_features)
        self.drafter_noise = drafter is not None and drafter.wants_noise  # a chain's noise drawn once a step (_noise_ahead)
        # Drafts are verified by rejection sampling (engine.spec.verify=rejection) when sampling; greedy
        # decoding and the coupled mode verify by matching the target's own noise-indexed samples.
        self.rejection = engine.cfg.spec.verify == "rejection" and params.temperature > 0
        self.sink_layers = tuple(sink.feature_layers) if sink is not None else ()
        self._rows = torch.arange(engine.cfg.max_batch, device=self.device)  # [max_batch] a plain step's entry rows, sliced
        self._entries = torch.arange(engine.limits.verify_tokens + engine.limits.depth + 2, device=self.device)  # [root, nodes] indices, sliced
        self.hidden_layers = tuple(sorted(set(self.drafter_layers) | set(self.sink_layers)))
        # The target's decode forward, chosen once: CUDA graphs (eager outside their shapes), or eager.
        graphs = engine.graphs
        self.target = self._eager if graphs is None else graphs.runner(
            engine.runtime, engine.cache, engine.model.rope_table, self.hidden_layers, speculative=drafter is not None)

    def run(self) -> RolloutBatch:
        preempted = False
        while self.pending or self.state.active or self.source is not None:
            self.admit()
            self.retire()
            if self.state.active:
                self.step()
                if self.should_stop is not None and self.should_stop():
                    preempted = True
                    self.state.preempt()
                self.retire()
            if preempted:
                break
        rollouts, steps = (self.rollouts, self.steps) if not preempted else finished_only(self.rollouts, self.steps)
        return RolloutBatch(rollouts=rollouts, steps=steps, prefill_s=self.prefill_s,  # type: ignore[arg-type]
                            wall_s=time.perf_counter() - self.t0, policy_version=self.e.version)

    # -- admission -------------------------------------------------------------------------
    def admit(self) -> None:
        """Admits what fits: prefills new prompts, copies kept prefills, draws first tokens."""
        if self.source is not None:
            self._pull()
        chunks = take_chunks(self.pending, self.e.cfg.max_batch - self.state.active, self.e.cfg.max_batch)
        if not chunks:
            return
        ts = time.perf_counter()
        e, state = self.e, self.state
        fresh = [c for c in chunks if c.index not in self.kept]
        prefilled = self._prefill(fresh)
        base = state.active
        slots_of, logits, feats, ids_list = [], [], [], []
        acc, now = base, time.perf_counter() - self.t0
        for c in chunks:
            pre = self.kept.get(c.index) or prefilled[c.index]
            if c.first + c.count < c.request.samples.stop:
                self.kept[c.index] = pre  # later chunks reuse this prefill
            elif c.index in self.kept:
                del self.kept[c.index]
            slots = torch.arange(acc, acc + c.count, device=self.device)
            self._fill_slots(c, slots, pre, now)
            slots_of.append(slots)
            logits.append(pre.logits.expand(c.count, -1))
            feats.append(pre.features)
            ids_list.append(pre.ids)
            acc += c.count
        state.active = acc
        rows = torch.arange(base, acc, device=self.device)
        tok, lp = sample(torch.cat(logits), state.keys[rows], state.generated[rows], self.params)  # first tokens
        if e.drafter is not None:
            e.drafter.admit(admission_record([c.count for c in chunks], slots_of, ids_list, feats if self.drafter_wants else None,
                                             tok, self.device))
        self._emit(rows, tok.unsqueeze(1), lp.unsqueeze(1), torch.ones_like(tok))
        self.prefill_s += time.perf_counter() - ts

    def _pull(self) -> None:
        """The source's requests for the slots not promised to pending samples, queued after those."""
        free = self.e.cfg.max_batch - self.state.active - sum(p.count for p in self.pending)
        got = self.source.pull(self.state.active, max(free, 0))
        if got is None:
            self.source = None
            return
        if not got and not self.state.active and not self.pending:
            raise RuntimeError("the request source handed nothing to an idle engine and is not done: it would never be "
                               "asked again with rows finishing (RequestSource.pull must return requests or None)")
        self.e.check(got)
        for r in got:
            self.pending.append(Pending(len(self.requests), r, r.first_sample, r.n))
            self.requests.append(r)

    def _prefill(self, chunks: list[Pending]) -> dict[int, Prefill]:
        """One target pass over the new prompts (right-padded); their KV rows land in scratch
        slots at the end of the free range and are kept as `Prefill` records."""
        if not chunks:
            return {}
        e = self.e
        ids, lens = right_pad([torch.tensor(c.request.prompt, dtype=torch.long) for c in chunks], self.device)
        P, T = ids.shape
        pos = torch.arange(T, device=self.device).expand(P, T)
        start = self.state.active  # scratch rows: free now, filled by _fill_slots next
        view = e.cache.rows(start, start + P)
        out = e.runtime(ids, pos, cache=view, attn_mask=causal_mask(pos), logits=False, hidden_layers=self.hidden_layers)
        logits = e.runtime.lm_head(out.hidden[torch.arange(P), lens - 1]).float()  # [P, V]
        dfeat = target_features(out, self.drafter_layers) if self.drafter_wants else None
        sfeat = target_features(out, self.sink_layers) if e.sink is not None else None
        kept = {}
        for j, c in enumerate(chunks):
            n = len(c.request.prompt)
            kept[c.index] = Prefill(
                k=view.k[:, j, :, :n].clone(), v=view.v[:, j, :, :n].clone(), logits=logits[j],
                features=dfeat[j, :n] if dfeat is not None else None, ids=ids[j, :n],
            )
            if e.sink is not None:
                e.sink.prompt(c.request.prompt_id, ids[j, :n], sfeat[j, :n], e.version)
        return kept

    def _fill_slots(self, c: Pending, slots: torch.Tensor, pre: Prefill, now: float) -> None:
        state, e, r = self.state, self.e, c.request
        n = pre.ids.shape[0]
        e.cache.k[:, slots, :, :n] = pre.k.unsqueeze(1)
        e.cache.v[:, slots, :, :n] = pre.v.unsqueeze(1)
        e.cache.lengths[slots] = n
        samples = torch.arange(c.first, c.first + c.count, device=self.device)
        key = torch.full((c.count,), prompt_key(r.prompt_id), dtype=torch.long, device=self.device)
        state.keys[slots] = row_keys(self.params.seed, self.params.step, key, samples)
        state.generated[slots] = 0
        state.predicted[slots] = r.predicted_len or 0
        state.limit[slots] = min(self.params.max_new_tokens, e.max_len - n + 1)
        state.sample[slots] = samples
        state.stopped[slots] = False
        state.done[slots] = False
        drafts = {k: torch.tensor(d, dtype=torch.long, device=self.device) for k, d in (r.drafts or {}).items() if d}
        for slot, k in zip(slots.tolist(), samples.tolist()):
            state.rollout[slot] = len(self.rollouts)
            self.rollouts.append(None)
            self.meta.append((c.index, k, now))
            state.prompt_ids[slot], state.prompts[slot] = r.prompt_id, pre.ids
            state.drafts[slot] = drafts.get(k)
            state.siblings[slot] = sibling_corpus([d for j, d in drafts.items() if j != k])

    # -- decoding --------------------------------------------------------------------------
    def step(self) -> None:
        """One target pass over [root, draft tree] for every active row (no tree when off)."""
        e, b = self.e, self.state.active
        shape = e.policy.choose(b, self.steps[-1] if self.steps else None) if e.drafter is not None else None
        if shape is not None:
            shape.check_within(e.limits)
        context = float(e.cache.lengths[:b].float().mean())
        td = time.perf_counter()
        long = self._long_rows(b, shape)
        drafting = shape.for_long_rows() if long is not None else shape  # long rows in the batch: draft deep, then cut
        ahead = self._noise_ahead(b, drafting) if shape is not None else None
        tree = self._propose(b, drafting, ahead) if shape is not None else None
        pt = tree.padded() if tree is not None else None
        if long is not None:
            pt = pt.cut_chains(torch.where(long, drafting.depth, shape.chain_len))
        draft_s = time.perf_counter() - td
        if pt is None or pt.width == 0:
            forward_s, verdict, drafted, emitted = self._plain_step(b)
        elif pt.chain and not self.rejection:
            forward_s, verdict, drafted, emitted = self._chain_step(b, pt, ahead)
        else:
            forward_s, verdict, drafted, emitted = self._tree_step(b, pt)
        other_s = time.perf_counter() - td - draft_s - forward_s
        self.steps.append(StepRecord(
            index=len(self.steps), batch_size=b, shape=shape.label if shape is not None else "off",
            drafted=drafted.tolist(), accepted=verdict.num_accepted.tolist(), emitted=emitted.tolist(),
            context_mean=context, draft_s=draft_s, forward_s=forward_s, other_s=other_s,
            source=tree.source.tolist() if tree is not None and tree.source is not None else None,
            rollout=self.state.rollout[:b].tolist(),
        ))

    def _forward(self, entries, pos, slots, mask):
        """The target over entries [b, T] at positions and cache slots [b, T] under mask [b, T, S]; and its seconds."""
        t = time.perf_counter()
        out = self.target(entries, pos, slots, mask)
        _sync(self.device)
        return out, time.perf_counter() - t

    def _eager(self, entries, pos, slots, mask) -> ModelOutput:
        return self.e.runtime(entries, pos, cache=self.e.cache, cache_pos=slots, attn_mask=mask, hidden_layers=self.hidden_layers)

    def _plain_step(self, b: int):
        """Autoregressive decoding (no draft this step): the general step without tree bookkeeping."""
        state, e = self.state, self.e
        lengths = e.cache.lengths[:b]
        pos = lengths.unsqueeze(1)  # [b, 1]: the root's position and cache slot
        roots = state.roots(b)
        out, forward_s = self._forward(roots.unsqueeze(1), pos, pos, causal_mask(pos, int(lengths.max()) + 1))
        token, logp = sample(out.logits[:, 0].float(), state.keys[:b], state.generated[:b], self.params)  # [b]
        lengths += 1
        ones = torch.ones(b, dtype=torch.long, device=self.device)
        empty = torch.empty(b, 0, dtype=torch.long, device=self.device)
        verdict = Verdict(accepted=empty.bool(), num_accepted=ones - 1, last_index=ones - 1, path=empty,
                          tokens=token.unsqueeze(1), num_emitted=ones)
        emitted = self._after_pass(b, out, roots.unsqueeze(1), verdict, token.unsqueeze(1), logp.unsqueeze(1))
        return forward_s, verdict, ones - 1, emitted

    def _chain_step(self, b: int, pt: PaddedTree, ahead: torch.Tensor | None = None):
        """`_tree_step` for chains under coupled verification, in fewer ops: a chain's entries sit at
        consecutive slots and positions, its accepted nodes are already where they are committed,
        and [root, path] is the entries in order (nothing to gather)."""
        state, e = self.state, self.e
        N = pt.width
        lengths = e.cache.lengths[:b]
        j = self._entries[: N + 1]
        slots = lengths.unsqueeze(1) + j  # [b, 1+N]: positions too
        entries = torch.cat([state.roots(b).unsqueeze(1), pt.tokens], 1)  # [b, 1+N]
        out, forward_s = self._forward(entries, slots, slots, causal_mask(slots, int(lengths.max()) + N + 1))
        noise_pos = state.generated[:b].unsqueeze(1) + j  # [b, 1+N]
        noise = ahead[:, : N + 1].reshape(b * (N + 1), -1) if ahead is not None and ahead.shape[1] > N else None
        target, logp = sample(out.logits.float().view(b * (N + 1), -1), state.keys[:b].repeat_interleave(N + 1),
                              noise_pos.view(-1), self.params, noise)
        target, logp = target.view(b, N + 1), logp.view(b, N + 1)
        verdict = coupled_chain_verdict(pt.tokens, pt.valid, target)
        lengths += verdict.num_emitted  # the root and the accepted prefix, in place
        # Coupled: each emitted token is the target's own sample at its entry (logp's entry).
        emitted = self._after_pass(b, out, entries, verdict, verdict.tokens, logp)
        return forward_s, verdict, pt.valid.sum(1), emitted

    def _tree_step(self, b: int, pt: PaddedTree):
        state, e = self.state, self.e
        N = pt.width
        lengths = e.cache.lengths[:b]
        pos, slots = tree_positions(pt.depth, lengths)  # [b, 1+N]
        visible = int(lengths.max()) + N + 1
        mask = causal_mask(slots, visible) if pt.chain else tree_mask(pt.parents, pt.valid, lengths, visible)
        entries = torch.cat([state.roots(b).unsqueeze(1), pt.tokens], 1)  # [b, 1+N]
        out, forward_s = self._forward(entries, pos, slots, mask)
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
        fed = entries.gather(1, src)  # [b, N+1] the tokens input at root, then path nodes
        emitted = self._after_pass(b, out, fed, verdict, verdict.tokens, self._emitted_logprobs(logits, logp, src, verdict), src)
        return forward_s, verdict, pt.valid.sum(1), emitted

    def _after_pass(self, b, out, fed, verdict: Verdict, tokens, logprobs, src=None) -> torch.Tensor:
        """Emission, then the drafter's and the sink's view of the pass; returns the tokens emitted per row [b]."""
        gen_before = self.state.generated[:b].clone() if self.e.sink is not None else None
        emitted = self._emit(torch.arange(b, device=self.device), tokens, logprobs, verdict.num_emitted)
        e = self.e
        feats = target_features(out, self.drafter_layers) if self.drafter_wants else None  # [b, 1+N, F]
        if e.drafter is not None:
            e.drafter.update(verdict, feats)
        if e.sink is not None:
            if feats is None or self.sink_layers != self.drafter_layers:  # an EAGLE-3 drafter's and its sink's agree: one concat
                feats = target_features(out, self.sink_layers) if self.sink_layers else out.hidden  # the final hidden: no copy
            self._sink(b, feats, fed, gen_before, emitted, src)
        return emitted

    def _sink(self, b, feats, fed, gen_before, emitted, src) -> None:
        """Committed tokens that stay in the rollout: entry j of the path (0 = the root) at
        response position gen_before - 1 + j, for j < emitted. feats [b, 1+N, F]: the pass's
        features in the sink's layers."""
        state = self.state
        if fed.shape[1] == 1:  # a plain step: every active row committed its root (retire() left room for it), no mask
            feats = feats[:, 0]  # [b, F]
            rows, position, tokens, every_row = self._rows[:b], gen_before - 1, fed[:, 0], True
        else:
            W = fed.shape[1]
            if src is not None:
                feats = feats.gather(1, src.unsqueeze(-1).expand(-1, -1, feats.shape[-1]))
            j = torch.arange(W, device=self.device)
            keep = j < emitted.unsqueeze(1)  # [b, W]
            rows = torch.arange(b, device=self.device).unsqueeze(1).expand(b, W)[keep]
            position, tokens, feats, every_row = (gen_before.unsqueeze(1) - 1 + j)[keep], fed[keep], feats[keep], False
        self.e.sink.tokens(CommittedFeatures(
            prompt_ids=state.prompt_ids[:b], samples=state.sample[:b], rollouts=state.rollout[:b], row=rows,  # views: valid during the call
            position=position, tokens=tokens, features=feats, policy_version=self.e.version, every_row=every_row,
        ))

    def _long_rows(self, b: int, shape: DraftShape | None) -> torch.Tensor | None:
        """[b] bool: the rows a length-aware shape drafts deeper (engine.spec.long_row_tokens generated
        or predicted); None when the shape has no budget or no row is long."""
        if shape is None or not shape.long_depth:
            return None
        state, at = self.state, self.e.cfg.spec.long_row_tokens
        long = (state.generated[:b] >= at) | (state.predicted[:b] >= at)
        return long if bool(long.any()) else None

    def _noise_ahead(self, b: int, shape: DraftShape) -> torch.Tensor | None:
        """[b, D + 1, V] the Gumbel noise a chain's verify pass samples with (response positions
        generated + 0..D), drawn once for the drafter and the verifier (None: greedy, or a tree,
        whose verify positions repeat by depth)."""
        if self.params.temperature == 0 or shape.topk != 1 or shape.iid_children or not self.drafter_noise:
            return None
        D = shape.chain_len
        state = self.state
        pos = state.generated[:b].unsqueeze(1) + self._entries[: D + 1]  # [b, D + 1]
        V = self.e.model.config.vocab_size
        return gumbel(state.keys[:b].repeat_interleave(D + 1), pos.view(-1), V).view(b, D + 1, V)

    def _propose(self, b: int, shape: DraftShape, noise: torch.Tensor | None = None) -> DraftTree:
        state = self.state
        ctx = DraftContext(
            roots=state.roots(b), positions=state.generated[:b] - 1, keys=state.keys[:b], responses=state.tokens[:b],
            generated=state.generated[:b], prompts=state.prompts[:b], prompt_ids=state.prompt_ids[:b],
            samples=state.sample[:b], drafts=state.drafts[:b], params=self.params, shape=shape, siblings=state.siblings[:b],
            noise=noise,
        )
        return self.e.drafter.propose(ctx)

    def _verify(self, pt, logits, target, keys, noise_pos) -> Verdict:
        if self.rejection:  # every caller has drafts to verify (pt.width > 0)
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

    def _emit(self, rows: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Appends up to counts[i] of tokens[i] ([R, K]) to rows[i], cut at a stop token or the
        limit; returns the number appended per row [R]."""
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
        return n

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
                logprobs=state.logprobs[i, :n].tolist(),
                finish_reason=(FinishReason.STOP if bool(state.stopped[i]) else
                               FinishReason.PREEMPTED if bool(state.preempted[i]) else FinishReason.LENGTH),
                policy_version=e.version, timings={"admitted_s": admitted, "finished_s": now},
            )
            if e.drafter is not None:
                e.drafter.finish(req.prompt_id, self.rollouts[idx].tokens)
        keep = b - int(done.sum())
        holes = done[:keep].nonzero().squeeze(1)
        movers = (~done[keep:]).nonzero().squeeze(1) + keep
        if holes.numel():
            state.move(movers, holes)
            e.cache.move_rows(movers, holes)
            if e.drafter is not None:
                e.drafter.move_rows(movers, holes)
        state.active = keep
        if self.progress is not None:
            self.progress(sum(r is not None for r in self.rollouts))
