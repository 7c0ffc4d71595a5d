"""The vLLM backend's config section (`engine.vllm:` in configs/*.yaml; used when engine.backend=vllm).

Importing it imports nothing of vLLM: configs load where vLLM is not installed.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.spec.drafter_spec import DrafterSpec

# The drafters vLLM serves are single parts (compositions and pre-generated drafts are the native
# engine's): ngram, or a learned network of one of these kinds (its weights are exported and
# pushed), by the vLLM speculative method that runs it.
VLLM_METHODS = {"eagle": "eagle", "eagle3_vllm": "eagle3", "mtp": "mtp"}
SERVED = ", ".join((*VLLM_METHODS, "ngram"))  # for messages


def vllm_serves(drafter: DrafterSpec) -> bool:
    return not drafter.composed and (drafter.ngram or drafter.learned in VLLM_METHODS)


def vllm_network(drafter: DrafterSpec) -> str | None:
    """The learned kind whose network vLLM serves for this drafter, or None (ngram, or not served)."""
    return drafter.learned if vllm_serves(drafter) else None


@dataclass(kw_only=True)
class VllmConfig:
    # Share of device memory vLLM takes for weights and KV cache (on CPU: of host memory).
    gpu_memory_utilization: float = 0.85
    kv_cache_gb: float | None = None  # a fixed KV-cache size instead (vLLM's kv_cache_memory_bytes)
    tensor_parallel_size: int = 1  # GPUs one rollout engine spans
    enforce_eager: bool = False  # True: no torch.compile / CUDA graphs (faster start, slower steps)
    weight_bucket_mb: int = 512  # a policy push is sent in buckets of at most this many MiB
    # Free vLLM's memory while the colocated actor trains: 0 = never; 1 = offload weights, drop the
    # KV cache; 2 = drop both (the next push re-sends the policy, and the drafter is re-sent too).
    sleep_level: int = 0
    ngram_max: int = 3  # engine.spec.drafter=ngram: the longest n-gram matched (vLLM's prompt_lookup_max)

    def validate(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"engine.vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"engine.vllm.kv_cache_gb must be > 0 (or null), got {self.kv_cache_gb}")
        for key in ("tensor_parallel_size", "weight_bucket_mb", "ngram_max"):
            if getattr(self, key) < 1:
                raise ValueError(f"engine.vllm.{key} must be >= 1, got {getattr(self, key)}")
        if self.sleep_level not in (0, 1, 2):
            raise ValueError(f"engine.vllm.sleep_level must be 0, 1 or 2, got {self.sleep_level}")
