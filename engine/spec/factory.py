"""Builds the drafter named by the `engine.spec` config section.

A `history` part drafts from a HistoryStore: the run's (kept across steps, in its checkpoints),
when the caller passes one, else a fresh one sized by the config (for engine-only use). An EAGLE
part's kernels multiply in float32 or bf16 (`bf16_products`).
"""

from __future__ import annotations

from engine.model import Transformer
from engine.spec.config import SpecConfig
from engine.spec.drafter import Drafter
from engine.spec.history_index import HistoryStore


def history_store(cfg: SpecConfig) -> HistoryStore:
    """An empty store with the limits of `engine.spec.history_*`."""
    return HistoryStore(max_prompts=cfg.history_max_prompts, max_tokens=cfg.history_max_tokens,
                        max_responses=cfg.history_max_responses, min_match=cfg.history_match())


def bf16_products(cfg: SpecConfig) -> bool:
    """Whether an EAGLE drafter's kernels multiply in bf16 (`engine.spec.drafter_products`; auto: where
    the CPU kernels were built with AVX512_BF16, so its dot products run natively)."""
    from engine.kernels.skinny import bf16_dot

    return bf16_dot(cfg.drafter_products)


def build_drafter(cfg: SpecConfig, target: Transformer, history: HistoryStore | None = None) -> Drafter | None:
    cfg.validate()
    if not cfg.enabled:
        return None
    parts = []
    for name in cfg.drafter_spec.parts:
        if name == "ngram":
            from engine.spec.ngram import NgramDrafter

            parts.append(NgramDrafter())
        elif name == "history":
            from engine.spec.history import HistoryDrafter

            parts.append(HistoryDrafter(history if history is not None else history_store(cfg),
                                        max_candidates=cfg.history_max_candidates, max_match=cfg.history_max_match))
        elif name == "pregenerated":
            from engine.spec.pregenerated import PregeneratedDrafter

            parts.append(PregeneratedDrafter())
        else:
            from engine.spec.eagle_drafter import EagleDrafter

            parts.append(EagleDrafter.load(cfg.drafter_path, target, expect=name, bf16_weights=cfg.drafter_weights == "bfloat16",
                                           bf16_products=bf16_products(cfg)))
    if len(parts) == 1:
        return parts[0]
    from engine.spec.compose import FallbackDrafter

    return FallbackDrafter(parts)
