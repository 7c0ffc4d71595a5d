"""EagleDrafter: runs the one-layer EAGLE network (engine.spec.eagle) as a Drafter.

Per row the drafter keeps its own one-layer KV cache of *pairs* (f_{t-1}, x_t) at position t
(cache slot t - 1), built from the target's true features. Pairs committed by a target pass
(the target's features at the root and the accepted nodes, each with the token that followed
it: the last one's token is the next root) wait in a *pending* buffer. When asked to draft, the
drafter first *catches up* (all pending pairs go through the network at once), then expands the
tree level by level from its own predicted features, on tentative cache slots that the next
catch-up overwrites. After a chain draft, the leading verified pairs whose tokens the chain drafted
keep the chain's entries (its own predicted features in place of the target's: `_keep_drafted`),
so a catch-up mostly runs one pair a row rather than one per accepted token, at the same accept
length. Steps without a draft only append to the pending buffer (sized for whole
responses within a byte budget; past it, pending pairs are caught up without drafting), so
speculation can be off for many steps (a large batch) and on again with the drafter's cache
complete, and rows that finish while it is off cost the drafter nothing.

Tree expansion (coupled verification): a node's first child is the drafter's own noise-indexed
sample at that position (the same keys the target samples with, so a good drafter proposes
exactly the target's token), then the top-k alternatives by probability, all distinct. Nodes
are scored by an estimate of the chance they are accepted: the product along the path of q(x)
for alternatives and max(q(x), coupled_prior) for coupled samples, whose match rate is much
higher than q(x) (DESIGN.md). The `topk` best children of each level are expanded; the
`verify_tokens` best nodes overall form the tree (scores never increase down a path, so that
set is closed under ancestors). For rejection verification, children are instead i.i.d. samples
from q, with q's logits attached.

Two ways to draft, chosen once per `reset` (the run's sampling and limits) and again when the
weights are repacked (`load_weights`, `target_changed`), never per call: with plain sampling
(`SamplingParams.plain`), coupled children and a network the CPU kernels take, chains
(engine.kernels.eagle_chain) and trees (engine.kernels.eagle_tree) run catch-up and drafting in
one compiled call; otherwise the Python levels below draft (`_chain_reference`,
`_tree_reference`). The Python path is the reference: it computes the same tokens, and
`reference=True` keeps a drafter on it so tests can compare the two.
"""

from __future__ import annotations

import math

import torch

from engine.kernels import eagle_chain as chain_kernel
from engine.kernels import eagle_tree as tree_kernel
from engine.model import Transformer
from engine.sampling import SamplingParams, derive_keys, gumbel, mask_logits
from engine.spec.drafter import Admission, DraftContext, DrafterBase, DraftShape
from engine.spec.eagle import EagleModel, copy_named_weights
from engine.spec.eagle_runtime import EagleRuntime
from engine.spec.tree import DraftTree
from engine.spec.verify import Verdict

PENDING_BYTES = 256 * 2**20  # the pending features' budget; past it, off steps catch up early


class EagleDrafter(DrafterBase):
    wants_features = True
    wants_noise = True

    def __init__(self, net: EagleModel, coupled_prior: float = 0.6, bf16_weights: bool = False,
                 reference: bool = False, bf16_products: bool = False) -> None:
        self.net = net.eval()
        self.rt = EagleRuntime(self.net, bf16_weights, bf16_products)
        self.version = 0  # of the drafter's own weights (load_weights)
        self.name = net.config.kind
        self.feature_layers = tuple(net.config.aux_layers)
        self.coupled_prior = coupled_prior
        self.reference = reference  # always the Python drafts (the definition the kernels reproduce)
        self.cache = None
        self._rope_reach: int | None = None  # the positions the drafts' RoPE tables cover (set by reset)
        self._rope_tables = None
        # [b, D] the last chain draft's tokens while its levels' entries sit in the cache (tentative
        # slots): `update` keeps those of the verified prefix (see `_keep_drafted`); else None.
        self._chain_drafted: torch.Tensor | None = None
        self.params: SamplingParams | None = None
        self.limits: DraftShape | None = None
        # The drafts `propose` calls for chains and for trees: DraftContext -> DraftTree (set by _choose_paths).
        self.draft_chain = self.draft_tree = None

    @classmethod
    def load(cls, path, target: Transformer, expect: str | None = None, bf16_weights: bool = False,
             bf16_products: bool = False) -> EagleDrafter:
        net = EagleModel.load(path, target)
        if expect is not None and net.config.kind != expect:
            raise ValueError(f"engine.spec.drafter={expect} but {path} holds a {net.config.kind} drafter")
        return cls(net, bf16_weights=bf16_weights, bf16_products=bf16_products)

    # -- weights ---------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, named_tensors, version: int) -> None:
        """Replaces the drafter's weights (names as in its state dict: `fc.weight`, `layers.0.*`)."""
        copy_named_weights(self.net, named_tensors)
        self.rt.repack()
        self._choose_paths()
        self.version = version

    def network(self) -> EagleModel:
        return self.net

    def target_changed(self) -> None:
        self.rt.repack()  # re-reads the shared LM head rows
        self._choose_paths()

    def stale(self) -> str | None:
        return self.rt.stale()

    # -- hooks -----------------------------------------------------------------------------
    def reset(self, max_batch: int, max_len: int, params: SamplingParams, limits: DraftShape) -> None:
        self.params, self.limits = params, limits
        self._choose_paths()
        # Pending pairs per row: room for a whole response where the byte budget allows, so rows
        # that finish while speculation is off never pay a catch-up; at least two target passes.
        F = self.net.config.feature_size
        per_pair = F * self.net.fc.weight.element_size() * max_batch
        capacity = max(2 * (limits.verify_tokens + 2), min(max_len + limits.verify_tokens + 2, PENDING_BYTES // per_pair))
        tentative = limits.depth * limits.topk + 1  # tentative slots of the deepest, widest tree
        if (self.cache is None or self.cache.max_batch < max_batch or self.cache.max_len < max_len + tentative
                or self.pend_tok.shape[1] < capacity):
            self.cache = self.net.new_cache(max_batch, max_len + tentative)
            dev, dtype = self.net.fc.weight.device, self.net.fc.weight.dtype
            self.pend_feat = torch.zeros(max_batch, capacity, F, dtype=dtype, device=dev)  # [N, W, F]
            self.pend_tok = torch.zeros(max_batch, capacity, dtype=torch.long, device=dev)  # [N, W]
            self.pend_n = torch.zeros(max_batch, dtype=torch.long, device=dev)  # [N]
        self.cache.lengths.zero_()
        self._chain_drafted = None
        # The compiled drafts' RoPE tables cover every position a draft reaches: committed pairs
        # (< max_len), then the levels.
        reach = max_len + limits.depth + 2
        if self._rope_reach != reach:
            self._rope_reach, self._rope_tables = reach, None

    @torch.inference_mode()
    def admit(self, adm: Admission) -> None:
        """Runs each prompt's pairs (f_j, x_{j+1}), j < P - 1, once, into all its samples' slots;
        (f_{P-1}, first sampled token) is pending. When every prompt has one slot (nothing to
        share) and its pairs fit, they all stay pending instead: the next draft's catch-up runs
        them (in the compiled kernels, one call) and no drafter pass runs here."""
        P, T = adm.tokens.shape
        feats = adm.features
        if adm.slots.shape[0] == P and T <= self.pend_tok.shape[1]:
            self._admit_pending(adm)
            return
        if T > 1:
            scratch = self.net.new_cache(P, T - 1)
            pos = torch.arange(1, T, device=adm.tokens.device).expand(P, T - 1)
            self.rt(adm.tokens[:, 1:], feats[:, : T - 1], pos, cache=scratch, cache_pos=pos - 1)
            self.cache.k[:, adm.slots, :, : T - 1] = scratch.k[:, adm.owner]
            self.cache.v[:, adm.slots, :, : T - 1] = scratch.v[:, adm.owner]
        lens = adm.lengths[adm.owner]  # [R]
        self.cache.lengths[adm.slots] = lens - 1
        self.pend_feat[adm.slots, 0] = feats[adm.owner, lens - 1]
        self.pend_tok[adm.slots, 0] = adm.first_tokens
        self.pend_n[adm.slots] = 1

    def _admit_pending(self, adm: Admission) -> None:
        """One slot per prompt (owner is the identity): the pairs (f_j, x_{j+1}) for j < P - 1
        and (f_{P-1}, first token) are pending, at drafter positions 1..P (as `admit` runs them)."""
        P, T = adm.tokens.shape
        slots, lens = adm.slots, adm.lengths
        self.pend_tok[slots, : T - 1] = adm.tokens[:, 1:]  # right padding lands past each row's pairs
        self.pend_tok[slots, lens - 1] = adm.first_tokens
        self.pend_feat[slots, :T] = adm.features
        self.pend_n[slots] = lens
        self.cache.lengths[slots] = 0

    @torch.inference_mode()
    def update(self, verdict: Verdict, features: torch.Tensor | None) -> None:
        """Appends the pass's pairs: features at [root, accepted path], each with the token after it
        (after a chain draft, less the leading pairs whose entries the chain already wrote)."""
        b, N1 = features.shape[:2]
        m = verdict.num_accepted + 1  # [b] pairs committed per row
        drafted, self._chain_drafted = self._chain_drafted, None
        if drafted is not None and verdict.chain:
            features, tokens, m = self._keep_drafted(drafted, verdict, features, m)
        else:
            tokens = verdict.tokens[:, :N1]
        n = self.pend_n[:b]
        if int(n.max()) + N1 > self.pend_tok.shape[1]:
            self._catch_up(b)  # a long stretch without drafts: take the pending pairs in now
            n = self.pend_n[:b]
        if not verdict.chain:  # features at [root, path]: a chain's are the entries in order
            src = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=m.device), verdict.path + 1], 1).clamp(min=0)  # [b, N1]
            features = features.gather(1, src.unsqueeze(-1).expand(-1, -1, features.shape[-1]))
        # All N1 entries go to columns n..n+N1-1 (rectangular, no masks); those past m lie beyond the
        # new pend_n, where nothing reads them before the next update overwrites them.
        cols = n.unsqueeze(1) + torch.arange(N1, device=m.device)  # [b, N1]
        self.pend_feat[:b].scatter_(1, cols.unsqueeze(-1).expand(-1, -1, features.shape[-1]), features)
        self.pend_tok[:b].scatter_(1, cols, tokens)
        n += m

    def _keep_drafted(self, drafted: torch.Tensor, verdict: Verdict, features: torch.Tensor, m: torch.Tensor):
        """The pass's pairs less the leading ones a chain draft already put in the cache.

        A chain's level d wrote the pair (its own predicted feature, drafted token d) at tentative
        slot lengths + d, for d < D - 1. Where the verified tokens begin with the drafted ones, those
        entries stand for the committed pairs (the target's feature, the same token): they are kept
        (the cache's length moves past them) and only the rest go through the next catch-up, mostly
        one pair a row instead of the whole accepted prefix. The drafter's input there is its own
        feature rather than the target's; the tokens, checked by verification, cannot change (on the
        mult task the accept length did not move: 8.24 -> 8.28 at d8, 14.17 -> 14.32 at d16).
        Rows another drafter drafted (a composition) keep nothing unless their tokens match."""
        b, N1 = features.shape[:2]
        D = drafted.shape[1]
        width = min(D - 1, N1 - 1)
        same = (verdict.tokens[:, :width] == drafted[:, :width]).long().cumprod(1).sum(1)  # [b] leading matches
        k = torch.minimum(same, verdict.num_accepted)  # [b] kept pairs: drafted, written, committed
        src = (k.unsqueeze(1) + torch.arange(N1, device=k.device)).clamp(max=N1 - 1)  # [b, N1]
        features = features.gather(1, src.unsqueeze(-1).expand(-1, -1, features.shape[-1]))
        tokens = verdict.tokens[:, :N1].gather(1, src)
        self.cache.lengths[:b] += k
        return features, tokens, m - k

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.cache.move_rows(src, dst)
        for t in (self.pend_feat, self.pend_tok, self.pend_n):
            t[dst] = t[src]

    # -- drafting --------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> DraftTree:
        chain = ctx.shape.topk == 1 and not ctx.shape.iid_children
        return self.draft_chain(ctx) if chain else self.draft_tree(ctx)

    def _choose_paths(self) -> None:
        """Sets `draft_chain` and `draft_tree` for the current sampling, limits and packed weights:
        the compiled drafts where the kernels compute them (every shape within the limits), else
        the Python reference. Nothing to choose before the first `reset`."""
        if self.params is None:
            return
        compiled = not self.reference and self.params.plain and not self.limits.iid_children
        chain = compiled and chain_kernel.supported(self.rt)
        tree = compiled and tree_kernel.supported(self.rt, self.limits.topk)
        self.draft_chain = self._chain_compiled if chain else self._chain_reference
        self.draft_tree = self._tree_compiled if tree else self._tree_reference

    def _chain_reference(self, ctx: DraftContext) -> DraftTree:
        return self._chain(self._catch_up(ctx.roots.shape[0]), ctx)

    def _tree_reference(self, ctx: DraftContext) -> DraftTree:
        return self._expand(self._catch_up(ctx.roots.shape[0]), ctx)

    def _tree_compiled(self, ctx: DraftContext) -> DraftTree:
        """Catch-up, tree expansion and selection in one compiled call (engine.kernels.eagle_tree):
        the same tree as `_catch_up` + `_expand`. Level d sits where a chain's level d does."""
        b, shape = ctx.roots.shape[0], ctx.shape
        D = shape.depth
        n = self.pend_n[:b]
        T = int(n.max())
        lengths = self.cache.lengths[:b]
        cos, sin_signed = self._draft_rope(lengths.device)
        tokens, parents = tree_kernel.draft(
            self.rt, self.pend_tok[:b, :T], self.pend_feat[:b], n, D, shape.topk, shape.verify_tokens,
            math.log(self.coupled_prior), self._chain_noise(ctx, b, D), self.params.temperature, cos, sin_signed,
            self.cache, lengths,
        )
        lengths += n
        n.zero_()
        return DraftTree.from_padded(tokens, parents, torch.ones_like(tokens, dtype=torch.bool))

    def _draft_rope(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [P, hd] by position, P >= the reach `reset` set: the compiled drafts read the
        rows of the catch-up's pairs (lengths + 1 + j) and the levels' (lengths + n + 1 + d) themselves.
        The engine's RoPE table when it reaches that far (no op a call), else one built here once per reach."""
        t = self.net.rope_table
        if t is not None and t.length >= self._rope_reach and t.cos.dtype == self.pend_feat.dtype:
            return t.cos, t.sin_signed
        if self._rope_tables is None:
            pos = torch.arange(self._rope_reach, device=device).unsqueeze(0)
            cos, sin_signed = self.net.rope_signed(pos, self.pend_feat.dtype)
            self._rope_tables = (cos[0].contiguous(), sin_signed[0].contiguous())
        return self._rope_tables

    def _chain_noise(self, ctx: DraftContext, b: int, D: int) -> torch.Tensor | None:
        """[b, D, Vd] the target's Gumbel noise at the chain's (and a tree's levels') positions (None when greedy)."""
        if self.params.temperature == 0:
            return None
        ids = self.net.vocab_ids
        if ctx.noise is not None and ctx.noise.shape[1] > D:  # the step's noise: level d's position is the target's entry d - 1
            return ctx.noise[:, :D, : self.net.head_t.shape[1]] if ids is None else ctx.noise[:, :D].index_select(-1, ids)
        pos = (ctx.positions.unsqueeze(1) + torch.arange(1, D + 1, device=ctx.positions.device)).flatten()
        vocab = ids if ids is not None else self.net.head_t.shape[1]
        return gumbel(ctx.keys.repeat_interleave(D), pos, vocab).view(b, D, -1)

    def _chain_compiled(self, ctx: DraftContext) -> DraftTree:
        """Catch-up and chain in one compiled call (engine.kernels.eagle_chain)."""
        b = ctx.roots.shape[0]
        D = ctx.shape.chain_len
        n = self.pend_n[:b]
        T = int(n.max())
        tokens = self.pend_tok[:b, :T]
        lengths = self.cache.lengths[:b]
        cos, sin_signed = self._draft_rope(lengths.device)
        conf = ctx.shape.min_confidence
        draft, real = chain_kernel.draft(self.rt, tokens, self.pend_feat[:b], n, D, self._chain_noise(ctx, b, D),
                                         self.params.temperature, cos, sin_signed, self.cache, lengths, conf)
        lengths += n
        n.zero_()
        self._chain_drafted = draft if conf == 0 else None  # a confidence stop skips rows' later levels
        return DraftTree.chains(draft, real if conf > 0 else None)

    def _chain(self, pred: torch.Tensor, ctx: DraftContext) -> DraftTree:
        """The tree with top-k 1, without tree bookkeeping: each level is the drafter's coupled
        sample, and a chain's tentative slots follow each other, so the plain causal mask holds.
        With a confidence stop a row's chain ends at the first level where the product of
        q(token) along it falls below `min_confidence` (as engine/kernels/eagle_chain.cpp)."""
        p, b = self.params, pred.shape[0]
        D = ctx.shape.chain_len
        ids = self.net.vocab_ids
        noise = self._chain_noise(ctx, b, D)  # all levels' noise at once: [b, D, Vd]
        lengths = self.cache.lengths[:b]
        tokens = torch.zeros(b, D, dtype=torch.long, device=pred.device)
        min_conf = ctx.shape.min_confidence
        conf = torch.ones(b, device=pred.device)
        real = torch.full((b,), D, dtype=torch.long, device=pred.device)
        live = torch.ones(b, dtype=torch.bool, device=pred.device)
        for d in range(D):
            logits = self.rt.logits(pred)  # [b, Vd]
            if noise is None:
                pick = logits.argmax(-1)
            else:
                scaled = logits / p.temperature if p.unmasked else mask_logits(logits, p.temperature, p.top_k, p.top_p)
                pick = (scaled + noise[:, d]).argmax(-1)
            tokens[:, d] = torch.where(live, ids[pick] if ids is not None else pick, 0)
            if min_conf > 0:
                q = (logits / (p.temperature if p.temperature > 0 else 1.0)).softmax(-1)
                conf = conf * q.gather(1, pick.unsqueeze(1)).squeeze(1)
                ended = live & (conf < min_conf)
                real = torch.where(ended, d + 1, real)
                live = live & ~ended
                if not bool(live.any()):
                    break
            if d + 1 < D:
                slot = (lengths + d).unsqueeze(1)  # [b, 1]
                pred = self.rt(tokens[:, d : d + 1], pred.unsqueeze(1), slot + 1, cache=self.cache, cache_pos=slot)[:, 0]
        self._chain_drafted = tokens if min_conf == 0 else None  # a confidence stop skips rows' later levels
        return DraftTree.chains(tokens, real if min_conf > 0 else None)

    def _catch_up(self, b: int) -> torch.Tensor:
        """Feeds rows 0..b-1's pending pairs (each row has >= 1; the last one's token is the
        root) into the cache; returns the root's prediction [b, F]."""
        n = self.pend_n[:b]
        T = int(n.max())
        rows = torch.arange(b, device=n.device)
        lengths = self.cache.lengths[:b]
        slots = lengths.unsqueeze(1) + torch.arange(T, device=n.device)  # [b, T]
        pred = self.rt(self.pend_tok[:b, :T], self.pend_feat[:b, :T], slots + 1, cache=self.cache, cache_pos=slots)
        lengths += n
        last = pred[rows, n - 1]
        n.zero_()
        return last

    def _children(self, logits: torch.Tensor, keys: torch.Tensor, position: torch.Tensor, k: int, iid: bool):
        """Draft logits [b, M, Vd] of M parents -> (child token ids [b, M, k], log-score [b, M, k], masked logits)."""
        p, (b, M, Vd) = self.params, logits.shape
        masked = mask_logits(logits.reshape(b * M, Vd), p.temperature, p.top_k, p.top_p).view(b, M, Vd)
        logq = masked.log_softmax(-1)
        ids = self.net.vocab_ids
        vocab = ids if ids is not None else Vd
        pos = position.repeat_interleave(M)
        if iid:  # k independent noise-indexed samples from q (rejection verification)
            picks = [
                (masked + gumbel(derive_keys(keys, 7919 + j).repeat_interleave(M), pos, vocab).view(b, M, Vd)).argmax(-1)
                for j in range(k)
            ]
            idx = torch.stack(picks, -1)  # [b, M, k]
            score = logq.gather(-1, idx)
        else:
            if p.temperature > 0:
                coupled = (masked + gumbel(keys.repeat_interleave(M), pos, vocab).view(b, M, Vd)).argmax(-1)
            else:
                coupled = masked.argmax(-1)
            alts = logq.topk(min(k, Vd), -1).indices  # [b, M, k]
            distinct = alts != coupled.unsqueeze(-1)
            alts = alts.gather(-1, (~distinct).long().argsort(dim=-1, stable=True))[..., : k - 1]  # drop the coupled one
            idx = torch.cat([coupled.unsqueeze(-1), alts], -1)
            score = logq.gather(-1, idx)
            score[..., 0] = score[..., 0].clamp(min=math.log(self.coupled_prior))
        tokens = ids[idx] if ids is not None else idx
        return tokens, score, masked

    def _expand(self, root_pred: torch.Tensor, ctx: DraftContext) -> DraftTree:
        shape, b, dev = ctx.shape, root_pred.shape[0], root_pred.device
        K, D = shape.topk, shape.depth
        lengths = self.cache.lengths[:b]  # committed pairs: the root sits at position `lengths`
        pool_tok, pool_par, pool_score, pool_q = [], [], [], []
        front_pred = root_pred.unsqueeze(1)  # [b, 1, F]
        front_idx = torch.full((b, 1), -1, dtype=torch.long, device=dev)  # pool index of frontier nodes
        front_score = torch.zeros(b, 1, device=dev)
        front_anc = torch.zeros(b, 1, 0, dtype=torch.bool, device=dev)  # [b, M, prior] tentative slots each sees
        size = 0
        for d in range(1, D + 1):
            M = front_pred.shape[1]
            tok, sc, masked = self._children(self.rt.logits(front_pred), ctx.keys, ctx.positions + d, K, shape.iid_children)
            score = (front_score.unsqueeze(-1) + sc).flatten(1)  # [b, M*K]
            pool_tok.append(tok.flatten(1))
            pool_par.append(front_idx.unsqueeze(-1).expand(b, M, K).flatten(1))
            pool_score.append(score)
            if shape.iid_children:
                pool_q.append(masked.unsqueeze(2).expand(b, M, K, masked.shape[-1]).flatten(1, 2))
            if d == D:
                break
            # Expand the K best new nodes: run them through the network on tentative slots.
            best = score.topk(min(K, M * K), -1).indices  # [b, K']
            parent_of = best // K  # frontier position of each one's parent
            new_idx = size + best
            # A child sees what its parent saw, the parent's own slot included (none for the root).
            anc = front_anc.gather(1, parent_of.unsqueeze(-1).expand(-1, -1, front_anc.shape[-1]))
            front_pred, front_anc = self._run_frontier(
                pool_tok[-1].gather(1, best), front_pred.gather(1, parent_of.unsqueeze(-1).expand(-1, -1, front_pred.shape[-1])),
                lengths, d, anc,
            )
            front_score, front_idx = score.gather(1, best), new_idx
            size += M * K
        return self._select(pool_tok, pool_par, pool_score, pool_q, shape.verify_tokens)

    def _run_frontier(self, tokens, parent_pred, lengths, d, anc):
        """Runs frontier nodes (depth d) on tentative slots; returns their predictions and the
        tentative slots each one sees (its own included)."""
        b, K = tokens.shape
        prior = anc.shape[-1]  # tentative slots used by earlier levels
        slots = lengths.unsqueeze(1) + prior + torch.arange(K, device=tokens.device)  # [b, K]
        visible = int(lengths.max()) + prior + K
        rel = torch.arange(visible, device=tokens.device) - lengths.unsqueeze(1)  # [b, S]
        seen = torch.cat([anc, torch.eye(K, dtype=torch.bool, device=tokens.device).expand(b, K, K)], -1)  # [b, K, prior+K]
        tentative = seen.gather(2, rel.clamp(0, prior + K - 1).unsqueeze(1).expand(-1, K, -1))
        mask = (rel < 0).unsqueeze(1) | (((rel >= 0) & (rel < prior + K)).unsqueeze(1) & tentative)
        pred = self.rt(tokens, parent_pred, lengths.unsqueeze(1) + d, cache=self.cache, cache_pos=slots, attn_mask=mask)
        return pred, seen

    def _select(self, pool_tok, pool_par, pool_score, pool_q, budget: int) -> DraftTree:
        """Keeps the `budget` best nodes (ancestor-closed), in creation order, parents remapped."""
        tok, par, score = torch.cat(pool_tok, 1), torch.cat(pool_par, 1), torch.cat(pool_score, 1)  # [b, M]
        b, M = tok.shape
        n = min(budget, M)
        order = torch.sort(-score, dim=1, stable=True).indices[:, :n]  # best first, ties to the older
        keep = order.sort(1).values  # creation order = topological order
        new_pos = torch.full((b, M + 1), -1, dtype=torch.long, device=tok.device)  # pool index + 1 -> kept index
        new_pos.scatter_(1, keep + 1, torch.arange(n, device=tok.device).expand(b, n))
        parents = new_pos.gather(1, par.gather(1, keep) + 1)
        q = torch.cat(pool_q, 1).gather(1, keep.unsqueeze(-1).expand(-1, -1, pool_q[0].shape[-1])) if pool_q else None
        if q is not None and self.net.vocab_ids is not None:
            full = torch.full((b, n, self.net.config.vocab_size), float("-inf"), device=q.device)
            q = full.index_copy_(2, self.net.vocab_ids, q)
        valid = torch.ones(b, n, dtype=torch.bool, device=tok.device)
        return DraftTree.from_padded(tok.gather(1, keep), parents, valid, q)
