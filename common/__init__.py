"""Helpers shared by the engine's callers (pipeline, spot, launch, bench) that belong to none of
them: text around the engine (tokenizers, prompts, stop tokens) and the optimiser step. spot and
pipeline both use this package and never import each other."""
