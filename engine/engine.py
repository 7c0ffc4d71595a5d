"""RolloutEngine: batched generation with a slot-based KV cache, speculative or not.

The engine owns a target model and its inference runtime (engine.runtime), a KV cache sized
for its maximum batch, context and draft shape, and optionally a drafter, a speculation policy
and a feature sink. `generate(requests, params)` runs one call (engine.decode) and returns a
`RolloutBatch`: rollouts plus one `StepRecord` per decode step.

Its handles for a training loop:
- `load_weights(named_tensors, version)`: the one way the target's weights change (a full state
  dict or a stream of (name, tensor) pairs by Hugging Face name). The runtime's packed copies
  and the drafter's shared head follow; rollouts carry the version that produced them; weights
  changed in place behind the engine's back are refused at the next generate(), never served.
- `load_drafter_weights(named_tensors, version)` and `attach_drafter(drafter)`.
- `policy` (engine.spec.policy.SpecPolicy): asked every decode step; the default is the config's
  fixed shape. Any shape within `limits` (engine.spec.max_*) works on any step.
- `sink` (engine.features.FeatureSink): the target's features of every committed token.
- `graphs` (engine.graphs.DecodeGraphs): on a CUDA device with `engine.cuda_graphs`, the CUDA
  graphs the decode loop replays for the target's decode and verify forwards; None elsewhere.

Tokens in, tokens out: tokenisation lives with the caller. Vocabulary: a *slot* is a row of the
KV cache; *active* rows are slots 0..b-1; a *rollout* is one finished sample.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from engine.backend import BackendCapabilities, NamedTensors, RolloutBackend
from engine.checkpoint import load_checkpoint, parse_dtype
from engine.config import EngineConfig
from engine.decode import GenerateRun
from engine.features import FeatureSink
from engine.graphs import DecodeGraphs
from engine.kv_cache import KVCache
from engine.model import Transformer
from engine.runtime import TargetRuntime
from engine.sampling import SamplingParams
from engine.source import RequestSource
from engine.spec.drafter import Drafter, DraftShape
from engine.spec.policy import FixedPolicy, SpecPolicy, TailPolicy
from engine.types import Request, RolloutBatch


class RolloutEngine(RolloutBackend):
    CAPS = BackendCapabilities(exact_logprobs=True, returns_features=True, same_tokens=True, preemptible=True,
                               takes_drafts=True, sleeps=False, pulls_requests=True, bf16_kernels=True)

    def __init__(self, model: Transformer, cfg: EngineConfig | None = None, drafter: Drafter | None = None,
                 policy: SpecPolicy | None = None, sink: FeatureSink | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        self.cfg.validate()
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.model = model.eval()
        bf16_products = self.cfg.bf16_products()
        self.runtime = TargetRuntime(self.model, bf16_weights=self.cfg.weights == "bfloat16", bf16_products=bf16_products)
        # Log-probs are the float32 policy's exactly unless the runtime rounds the weights (bf16 copies)
        # or computes its products in bf16.
        self.caps = dataclasses.replace(self.CAPS, exact_logprobs=self.cfg.weights == "float32" and not bf16_products)
        spec = self.cfg.spec
        iid = spec.verify == "rejection"
        self.shape = DraftShape(depth=spec.depth, topk=spec.topk, verify_tokens=spec.verify_tokens, iid_children=iid,
                                min_confidence=spec.min_confidence, long_depth=spec.long_depth)
        depth, topk, verify = spec.limits()
        self.limits = DraftShape(depth=depth, topk=topk, verify_tokens=verify, iid_children=iid)
        self.shape.check_within(self.limits)
        self.sink = sink
        self.max_len = min(self.cfg.max_len, model.config.max_position_embeddings)
        # Chosen once: on CUDA the decode loop's target forwards replay CUDA graphs; elsewhere they run eager.
        self.graphs: DecodeGraphs | None = None
        if self.cfg.cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs.for_config(spec, self.shape, self.cfg.max_batch, model.config, context=self.max_len)
        self.drafter: Drafter | None = None
        self.cache: KVCache | None = None
        self._build_cache(margin=0)
        self.policy: SpecPolicy = policy or self._config_policy()  # after the cache: the cost tuner measures passes
        if drafter is not None:
            self.attach_drafter(drafter)

    def _config_policy(self) -> SpecPolicy:
        spec = self.cfg.spec
        if spec.tuner_arms:
            from engine.spec.tuner import TunerPolicy, parse_arm

            arms = [parse_arm(a, self.limits.iid_children) for a in spec.tuner_arms]
            for arm in arms:
                if arm is not None:
                    arm.check_within(self.limits)
            if spec.tuner == "cost" and spec.enabled:  # off: no drafter asks the policy, nothing to measure
                from engine.spec import pass_costs
                from engine.spec.cost_policy import CostPolicy, entries

                # Measured once per host (cached): the sampler's cost with noise, as RL samples, at half
                # the engine's context (a rollout's rows mid-way).
                widest = max(entries(a) for a in arms if a is not None)
                costs = pass_costs.cached(self.runtime, SamplingParams(temperature=1.0), self.cfg.max_batch, widest,
                                          context=max(1, min(self.max_len // 2, self.max_len - widest - 1)))
                return CostPolicy(arms, costs, epsilon=spec.tuner_epsilon)
            return TunerPolicy(arms, spec.tuner_buckets, epsilon=spec.tuner_epsilon, window=spec.tuner_window,
                               explore_within=spec.tuner_explore_within)
        if spec.max_active_batch is not None:
            return TailPolicy(self.shape, spec.max_active_batch)
        return FixedPolicy(self.shape)

    @classmethod
    def from_pretrained(cls, path, cfg: EngineConfig | None = None, history=None, **kw) -> RolloutEngine:
        """`history`: the run's engine.spec.history_index.HistoryStore for a `history` drafter part."""
        from engine.spec.factory import build_drafter

        cfg = cfg or EngineConfig()
        model = load_checkpoint(path, parse_dtype(cfg.dtype), cfg.device)
        return cls(model, cfg, build_drafter(cfg.spec, model, history), **kw)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def version(self) -> int:
        return self.runtime.version

    @property
    def model_config(self):
        return self.model.config

    def _build_cache(self, margin: int) -> None:
        """The KV cache, with `margin` slots per row for tentative tree entries, and RoPE rows
        for every position the target and drafters reach (drafts run ahead of the cache)."""
        c = self.model.config
        self.cache = KVCache.for_model(c, self.cfg.max_batch, self.max_len + margin, self.model.dtype, self.model.device)
        self.rope_reach = self.max_len + margin + 2 * self.limits.verify_tokens + 2 * self.limits.depth + 2
        for net in [self.model, *self.drafter_nets()]:
            net.build_rope_table(self.rope_reach)

    def attach_drafter(self, drafter: Drafter) -> None:
        """Speculates with `drafter` from the next generate() on (an engine built without one grows
        its cache margin once)."""
        self.drafter = drafter
        margin = self.limits.verify_tokens + 1
        if self.cache.max_len < self.max_len + margin:
            self._build_cache(margin)
        else:
            for net in self.drafter_nets():
                net.build_rope_table(self.rope_reach)

    def drafter_nets(self) -> list:
        """The drafters' networks (a FallbackDrafter's parts too); model-free drafters have none."""
        return [net for net in (part.network() for part in self._drafter_parts()) if net is not None]

    def _drafter_parts(self) -> list[Drafter]:
        return [] if self.drafter is None else self.drafter.parts()

    # -- weights ---------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Copies the target's weights in (by Hugging Face name: every parameter, each once; a
        tied LM head may be given or left out) and serves them as `version` from now on."""
        if version < self.version:
            raise ValueError(f"load_weights: version {version} is older than the served version {self.version}")
        params = dict(self.model.named_parameters())  # a tied lm_head.weight appears once, as the embedding
        tied = self.model.config.tie_word_embeddings
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        seen: set[str] = set()
        for name, t in items:
            if tied and name == "lm_head.weight":
                continue
            p = params.get(name)
            if p is None:
                raise ValueError(f"load_weights: {name!r} is not a weight of this model (expected Hugging Face names such as "
                                 f"{next(iter(params))!r})")
            if p.shape != t.shape:
                raise ValueError(f"load_weights: {name!r} has shape {tuple(t.shape)}, the model's is {tuple(p.shape)}")
            p.copy_(t)
            seen.add(name)
        if seen != set(params):
            missing = sorted(set(params) - seen)
            raise ValueError(f"load_weights: {len(missing)} weights were not given, e.g. {missing[:3]}; send the full state dict")
        self.runtime.repack(version)
        for part in self._drafter_parts():
            part.target_changed()

    def load_drafter_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Replaces the weights of the engine's (single) model drafter, or of the one model part
        of a composition."""
        parts = [p for p in self._drafter_parts() if p.network() is not None]
        if len(parts) != 1:
            raise ValueError(f"load_drafter_weights: the engine has {len(parts)} drafters with weights; it needs exactly one")
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        parts[0].load_weights(items, version)

    def _check_fresh(self) -> None:
        name = self.runtime.stale()
        if name is None and self.drafter is not None:
            name = self.drafter.stale()
        if name is not None:
            raise ValueError(
                f"weight {name!r} changed in place since the engine packed it; the engine would serve stale copies. "
                "Change weights through engine.load_weights(named_tensors, version) (or load_drafter_weights)"
            )

    # -- generation ------------------------------------------------------------------------
    def check(self, requests: list[Request]) -> None:
        for r in requests:
            if len(r.prompt) >= self.max_len:
                raise ValueError(
                    f"prompt {r.prompt_id!r} has {len(r.prompt)} tokens but the context holds {self.max_len} "
                    f"(engine.max_len, capped by the model's max_position_embeddings); shorten the prompt"
                )
            bad = [t for t in r.prompt if not 0 <= t < self.model.config.vocab_size]
            if bad:
                raise ValueError(f"prompt {r.prompt_id!r} has token ids outside the vocabulary: {bad[:5]}")

    @torch.inference_mode()
    def generate(self, requests: list[Request], params: SamplingParams, progress=None,
                 should_stop=None, source: RequestSource | None = None) -> RolloutBatch:
        """Generates n samples per request: rollouts in request order, then sample order, with
        one step record per decode step. `progress`, if given, is called with the number of
        rollouts finished so far. `should_stop()`, if given, is checked after every decode step:
        once true, the active rows end as FinishReason.PREEMPTED (each a prefix of the response it
        would have become: the noise is keyed by position) and samples never admitted are left
        out, so the batch may hold fewer rollouts than asked for (bubble pre-generation)."""
        self.check(requests)
        self._check_fresh()
        if self.drafter is not None:
            self.drafter.reset(self.cfg.max_batch, self.max_len, params, self.limits)
        return GenerateRun(self, requests, params, progress, should_stop, source).run()
