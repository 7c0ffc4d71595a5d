"""Actor backends behind one protocol (pipeline.actors.base): `build_actor` picks one by config."""

from __future__ import annotations

from pathlib import Path

from pipeline.actors.base import Actor, ActorCapabilities, ActorConfig, LogProbs, LossFn

__all__ = ["ACTOR_BACKENDS", "Actor", "ActorConfig", "LogProbs", "LossFn", "actor_class", "build_actor"]

ACTOR_BACKENDS = ("torch", "deepspeed", "megatron")


def actor_class(name: str) -> type:
    """The class of actor.backend=`name` (imported, nothing built; none imports its framework at module
    level), whose `CAPS: ActorCapabilities` say what it can do."""
    if name == "torch":
        from pipeline.actors.torch_actor import TorchActor

        return TorchActor
    if name == "deepspeed":
        from pipeline.actors.deepspeed_actor import DeepSpeedActor

        return DeepSpeedActor
    if name == "megatron":
        from pipeline.actors.megatron_actor import MegatronActor

        return MegatronActor
    raise ValueError(f"actor.backend must be one of {', '.join(ACTOR_BACKENDS)}, got {name!r}")


def actor_caps(name: str) -> ActorCapabilities:
    """What actor.backend=`name` can do."""
    return actor_class(name).CAPS


def build_actor(cfg: ActorConfig, model_path: str | Path, group=None) -> Actor:
    """The actor of cfg.backend over the Hugging Face folder model_path (collective under torch.distributed).

    `group`: the data-parallel ranks (None: every rank of the job; a separated placement's actor
    group, pipeline.placement), for a backend whose CAPS have subgroup (launch.run.capabilities refuses
    the others on a separated run)."""
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

        return DeepSpeedActor(cfg, model_path, group)
    from pipeline.actors.torch_actor import TorchActor

    return TorchActor(cfg, model_path, group)
