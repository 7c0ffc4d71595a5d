"""The rollout backend a run's config names (`engine.backend`): the one place that maps a name to
a backend, so nothing else knows which one runs.

native: engine.engine.RolloutEngine (the CPU default, exact); vllm: engine.backends.vllm_engine
(its module imports nothing of vLLM, so configs and the native path work where vLLM is not
installed). `backend_class` gives the class, whose declared capabilities a config is checked
against before anything is built; `build_rollout_engine` builds one.
"""

from __future__ import annotations

from pathlib import Path

from engine.backend import RolloutBackend
from engine.config import EngineConfig

BACKENDS = ("native", "vllm")


def backend_class(name: str) -> type[RolloutBackend]:
    """The class of the backend engine.backend=`name` (imported, nothing built)."""
    if name == "native":
        from engine.engine import RolloutEngine

        return RolloutEngine
    if name == "vllm":
        from engine.backends.vllm_engine import VllmEngine

        return VllmEngine
    raise ValueError(f"engine.backend must be one of {', '.join(BACKENDS)}, got {name!r}")


def build_rollout_engine(path: str | Path, cfg: EngineConfig, *, seed: int = 0, history=None):
    """The engine serving the model folder `path`; `seed` keys vLLM's sampling (the native engine's
    noise is keyed per request by SamplingParams instead); `history`: the run's HistoryStore for a
    `history` drafter part (the native engine's; vLLM refuses that drafter)."""
    if cfg.backend == "native":
        from engine.engine import RolloutEngine

        return RolloutEngine.from_pretrained(path, cfg, history=history)
    if cfg.backend == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ValueError(f"engine.backend=vllm needs vLLM, which this environment lacks ({e}): run `make setup-vllm` "
                             "and train with .venv-vllm/bin/python, or `pip install vllm` (GPU); or set "
                             "engine.backend=native") from e
        from engine.backends.vllm_engine import VllmEngine

        return VllmEngine.from_pretrained(path, cfg, seed=seed)
    raise ValueError(f"engine.backend must be native or vllm, got {cfg.backend!r}")
