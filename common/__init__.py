"""Helpers shared by the engine's callers (pipeline, spot, launch, sim, bench) that belong to none of
them: text around the engine (tokenizers, prompts, stop tokens), the optimiser step, and config
loading (YAML and dotted overrides into typed sections). spot and pipeline both use this package
and never import each other."""
