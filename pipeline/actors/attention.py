"""The actor's attention in Hugging Face models: which implementation `load_policy` asks for.

On CPU in float32 the update's attention runs on the project's causal kernels
(engine/kernels/causal_attention.cpp, a forward that keeps each query's log-sum-exp and a backward
that recomputes the softmax from it), registered with transformers as "tailspec_cpu": forward and
backward they outrun torch's SDPA flash kernel at the small head dims of the models trained on a CPU
here (`python -m bench.attention` measures both; docs/BENCHMARKS.md, "The update").

Under bf16-mixed precision (pipeline/actors/precision.py: the matrix products in bf16) the
attention's products run in bf16 arithmetic too, where the kernels have AVX512_BF16
(engine/kernels/causal_attention_bf16.cpp, registered as "tailspec_cpu_bf16": q, k, v, dout and the
probabilities rounded to bf16 where they enter a product, as GPU flash attention in bf16 does; the
softmax and every sum in float32), faster than the float32 kernels where the dot products are
native (`python -m bench.attention` measures both). Like the model's other products, it follows
autocast: a forward outside bf16 autocast attends in float32. Without AVX512_BF16 the float32
kernels serve.

They serve whole right-padded rows without a padding mask (the update's `policy_forward`): a query
at position t sees keys 0..t. Anything else (a padding mask, a KV cache, dropout) is refused with
what to do, rather than computed some other way.
"""

from __future__ import annotations

import warnings

import torch

from pipeline.actors.base import ActorConfig

NAME = "tailspec_cpu"  # the float32 kernels
NAME_BF16 = "tailspec_cpu_bf16"  # the kernels in bf16 arithmetic (bf16-mixed precision)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """HF's attention-function interface: query [B, Hq, T, D], key / value [B, Hkv, T, D] -> ([B, T, Hq, D], None)."""
    return _kernel_attention(query, key, value, attention_mask, dropout, scaling, is_causal, bf16=False)


def _attention_bf16(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """`_attention` in bf16 arithmetic where the call runs under bf16 autocast, as the model's other
    products do (bf16-mixed precision's forwards: pipeline/actors/precision.py); in float32 outside it."""
    bf16 = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    return _kernel_attention(query, key, value, attention_mask, dropout, scaling, is_causal, bf16=bf16)


def _kernel_attention(query, key, value, attention_mask, dropout, scaling, is_causal, *, bf16: bool):
    from engine.kernels.causal_attention import causal_attention

    if attention_mask is not None:
        raise ValueError("actor.attention=tailspec serves right-padded rows without a padding mask (policy_forward); "
                         "this call passed a mask: pass attention_mask=None, or set actor.attention=sdpa")
    if dropout or is_causal is False:
        raise ValueError("actor.attention=tailspec is causal self-attention without dropout: set actor.attention=sdpa")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"actor.attention=tailspec serves whole sequences, got {query.shape[2]} queries over "
                         f"{key.shape[2]} keys (a KV cache): set actor.attention=sdpa to generate with the HF model")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # Under bf16-mixed precision (pipeline/actors/precision.py) projections arrive in bfloat16 (and
    # q, k rotated in float32); the kernels take float32 and round to bf16 themselves where bf16.
    return causal_attention(query.float(), key.float(), value.float(), scale, bf16=bf16), None


def implementation(cfg: ActorConfig) -> str:
    """The attn_implementation for the actor's HF model under cfg (registering the kernels' one if picked):
    sdpa, the float32 kernels, or under bf16-mixed precision the bf16 ones where the kernels have AVX512_BF16."""
    if cfg.attention == "sdpa" or (cfg.attention == "auto" and (cfg.device != "cpu" or cfg.dtype != "float32")):
        return "sdpa"
    from engine.kernels.library import KernelUnavailable, library

    try:
        library()
    except (KernelUnavailable, OSError) as e:
        if cfg.attention == "tailspec":
            raise RuntimeError(f"actor.attention=tailspec, but the CPU kernels do not build here ({e}): "
                               "set actor.attention=sdpa (or auto)") from e
        warnings.warn(f"actor.attention=auto: the CPU kernels do not build here ({e}); using torch's SDPA", stacklevel=2)
        return "sdpa"
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from engine.kernels.causal_attention import bf16_native
    from pipeline.actors import precision

    name, fn = NAME, _attention
    if precision.resolve(cfg) == "bf16-mixed" and bf16_native():
        name, fn = NAME_BF16, _attention_bf16
    AttentionInterface.register(name, fn)
    # SDPA's mask rule: none for unpadded causal rows, a 4-D mask otherwise (which _attention refuses).
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
