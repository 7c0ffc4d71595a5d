"""Actor backends behind one protocol (pipeline.actors.base): `build_actor` picks one by config."""

from __future__ import annotations

from pathlib import Path

from pipeline.actors.base import Actor, ActorConfig, LogProbs, LossFn

__all__ = ["Actor", "ActorConfig", "LogProbs", "LossFn", "build_actor"]


def build_actor(cfg: ActorConfig, model_path: str | Path) -> Actor:
    """The actor of cfg.backend over the Hugging Face folder model_path (collective under torch.distributed)."""
    cfg.validate()
    if cfg.backend == "megatron":
        try:
            import megatron.core  # noqa: F401
        except ImportError as e:
            raise ImportError("actor.backend=megatron needs megatron-core: pip install megatron-core "
                              "(or pip install -e .[megatron])") from e
        from pipeline.actors.megatron_actor import MegatronActor

        return MegatronActor(cfg, model_path)
    if cfg.backend == "deepspeed":
        from pipeline.actors.deepspeed_actor import DeepSpeedActor

        return DeepSpeedActor(cfg, model_path)
    from pipeline.actors.torch_actor import TorchActor

    return TorchActor(cfg, model_path)
