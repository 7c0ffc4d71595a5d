"""Actor backends behind one protocol (pipeline.actors.base): `build_actor` picks one by config."""

from __future__ import annotations

from pathlib import Path

from pipeline.actors.base import Actor, ActorConfig, LogProbs, LossFn, having

__all__ = ["Actor", "ActorConfig", "LogProbs", "LossFn", "build_actor"]


def build_actor(cfg: ActorConfig, model_path: str | Path, group=None) -> Actor:
    """The actor of cfg.backend over the Hugging Face folder model_path (collective under torch.distributed).

    `group`: the data-parallel ranks (None: every rank of the job; a separated placement's actor
    group, pipeline.placement). The torch (DDP) and deepspeed (ZeRO) backends train on a subgroup;
    megatron trains on every rank of the job."""
    cfg.validate()
    if group is not None and not cfg.caps.subgroup:
        raise ValueError(f"actor.backend={cfg.backend} builds its parallel groups over every rank of the job (it lacks "
                         "the capability subgroup), so it cannot train on the actor ranks of "
                         f"pipeline.placement=separated: use {having('subgroup')} there, or pipeline.placement=colocated")
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
