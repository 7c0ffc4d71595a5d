"""Builds the drafter named by the `engine.spec` config section."""

from __future__ import annotations

from engine.model import Transformer
from engine.spec.config import SpecConfig
from engine.spec.drafter import Drafter


def build_drafter(cfg: SpecConfig, target: Transformer) -> Drafter | None:
    cfg.validate()
    if not cfg.enabled:
        return None
    parts = []
    for name in cfg.drafter_spec.parts:
        if name == "ngram":
            from engine.spec.ngram import NgramDrafter

            parts.append(NgramDrafter())
        elif name == "pregenerated":
            from engine.spec.pregenerated import PregeneratedDrafter

            parts.append(PregeneratedDrafter())
        else:
            from engine.spec.eagle_drafter import EagleDrafter

            parts.append(EagleDrafter.load(cfg.drafter_path, target, expect=name, bf16_weights=cfg.drafter_weights == "bfloat16"))
    if len(parts) == 1:
        return parts[0]
    from engine.spec.compose import FallbackDrafter

    return FallbackDrafter(parts)
