"""The engine's config section (`engine:` in configs/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.backends.vllm_config import VllmConfig
from engine.spec.config import SpecConfig


@dataclass(kw_only=True)
class EngineConfig:
    # native: this project's engine (the CPU default, exact: speculation changes no token); vllm: vLLM
    # (engine.backends.vllm_engine; GPU clusters), exact in distribution only (its rejection sampler).
    backend: Literal["native", "vllm"] = "native"
    max_batch: int = 64  # decode slots: rows generated together
    max_len: int = 2048  # KV cache length per row (prompt + response), capped by the model's context
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    # bfloat16: the CPU kernels stream the target's matrices as bf16 (rounded; float32 arithmetic):
    # half the bytes of a memory-bound decode pass, still exact under speculation, but the served
    # model is the bf16-rounded policy (engine.runtime; measured in docs/BENCHMARKS.md).
    weights: Literal["float32", "bfloat16"] = "float32"
    # The target's matrix products in the CPU kernels: float32, or bf16 arithmetic (x and the weights
    # rounded to bf16, pairs of products summed in float32 by AVX512_BF16's dot product: twice the
    # arithmetic of a core), or auto (bf16 where the kernels have AVX512_BF16). Every pass, decode and
    # verify, goes through the same row-independent kernels, so speculation still changes no token;
    # what differs is the sampled policy's numerics (the LM head stays float32), as in bf16 serving
    # on GPUs. Its log-probs are those of the distribution sampled from, not the float32 policy's:
    # trainer.old_logprobs=auto then has the actor recompute them (engine: keep the behaviour's).
    products: Literal["float32", "bf16", "auto"] = "float32"
    device: str = "cpu"
    # The native engine on a CUDA device replays its target decode and verify forwards from CUDA
    # graphs captured at the padded (batch, tokens) shapes of its speculation policy (engine.graphs;
    # other shapes run eager); false: always eager. No effect elsewhere: a CPU runs eager, and
    # vLLM has its own switch (engine.vllm.enforce_eager).
    cuda_graphs: bool = True
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    spec: SpecConfig = field(default_factory=SpecConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)

    def _float32(self) -> bool:
        """The float32 mode with float32 weights: where bf16 products can run."""
        return self.dtype == "float32" and self.weights == "float32"

    def bf16_products(self) -> bool:
        """`products` decided for this machine by the native engine (auto: bf16 where its CPU float32
        mode runs on kernels with AVX512_BF16, float32 elsewhere)."""
        if self.products == "auto" and not (self._float32() and self.device == "cpu"):
            return False
        from engine.kernels.skinny import bf16_dot

        return bf16_dot(self.products)

    def validate(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"engine.max_batch must be >= 1, got {self.max_batch}")
        if self.max_len < 2:
            raise ValueError(f"engine.max_len must be >= 2, got {self.max_len}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"engine.cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        if self.threads < 0:
            raise ValueError(f"engine.threads must be >= 0, got {self.threads}")
        if self.weights not in ("float32", "bfloat16"):
            raise ValueError(f"engine.weights must be float32 or bfloat16, got {self.weights!r}")
        if self.products not in ("float32", "bf16", "auto"):
            raise ValueError(f"engine.products must be float32, bf16 or auto, got {self.products!r}")
        # Whether the backend has these numerics at all is its capability (bf16_kernels: launch.run.capabilities).
        if self.products == "bf16" and not self._float32():
            raise ValueError(f"engine.products=bf16 is the CPU kernels' float32 mode computing its products in bf16; it "
                             f"needs engine.dtype=float32 and engine.weights=float32 (got {self.dtype}, {self.weights}); "
                             "or engine.products=auto")
        if self.weights == "bfloat16" and self.dtype != "float32":
            raise ValueError(f"engine.weights=bfloat16 is the CPU kernels' float32 mode with bf16 weights; it needs "
                             f"engine.dtype=float32 (got {self.dtype})")
        self.spec.validate()
        self.vllm.validate()
