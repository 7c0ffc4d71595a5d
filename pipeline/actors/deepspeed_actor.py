"""The DeepSpeed actor backend: ZeRO stage 1 / 2 / 3, optionally offloading to CPU memory.

`deepspeed_config` renders the actor section into DeepSpeed's config dict (a pure function);
under ZeRO-3 its bucket sizes and persistence threshold come from the model's hidden size H the
way transformers' "auto" values do (H^2, 0.9 H^2, 10 H), so a 7B (H = 4096) or 32B (H = 5120)
model gets buckets of tens of millions of elements rather than DeepSpeed's one-size defaults.
Micro-batches vary in number and size, so there is no fixed gradient-accumulation count: the
engine is told which backward is the last (`set_gradient_accumulation_boundary`) and steps
once; `accumulate` makes every rank run the same number of micro-batches, since ZeRO-2 / 3
reduce gradients in every backward. On CPU the optimizer is torch's AdamW (`torch_adam`), which
needs no compiled DeepSpeed ops.

ZeRO-3 never holds the full model on one rank: the model is built under deepspeed.zero.Init
(transformers does so while an HfDeepSpeedConfig is alive), so each rank loads only its shard,
and `named_weights` gathers one decoder layer at a time (deepspeed.zero.GatheredParameters).
Parameters under the persistence threshold (norms, biases) stay whole on every rank by design.
A checkpoint is DeepSpeed's own (tag `actor`: each rank's partitions) plus each rank's RNG state.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from pipeline.actors.base import ActorConfig, LogProbs, LossFn
from pipeline.actors.checkpoint import collective_folder, load_rng, rank_and_world, require_files, rng_file, save_rng
from pipeline.actors.forward import accumulate, batched_logprobs, load_policy, policy_forward
from common.optim import param_groups
from pipeline.actors.torch_actor import actor_device
from pipeline.records import TrainBatch

TAG = "actor"
_LAYER = re.compile(r"^(.*?\.\d+)\.")  # "model.layers.3.mlp.up_proj.weight" -> "model.layers.3"


def zero3_settings(hidden_size: int) -> dict:
    """ZeRO-3's communication knobs for a model of this hidden size (transformers' "auto" rules).

    Buckets of H^2 elements (one square matrix) batch enough to keep NCCL busy; parameters under
    10 H elements (norm weights, biases) stay whole on every rank, which costs little memory and
    saves a gather per tiny tensor. Live / reuse limits are DeepSpeed's and HF's 1e9. The 16-bit
    consolidation on save is off: weight sync gathers layer by layer itself (named_weights).
    DeepSpeed's memory-efficient linear is off because it replaces torch.nn.functional.linear
    for the whole process and never puts it back (zero.Init's `_enable_mem_efficient_linear`),
    and the rollout engine and the drafter trainer run their nn.Linear layers in this process.
    """
    return {
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
        "stage3_max_live_parameters": 10**9,
        "stage3_max_reuse_distance": 10**9,
        "stage3_gather_16bit_weights_on_model_save": False,
        "memory_efficient_linear": False,
    }


def deepspeed_config(cfg: ActorConfig, world_size: int, *, hidden_size: int | None = None) -> dict:
    """DeepSpeed's config dict for this actor section at this data-parallel world size.

    hidden_size (the model's; needed for ZeRO-3 only) sizes ZeRO-3's buckets: see zero3_settings.
    """
    cpu = cfg.device == "cpu"
    zero: dict = {"stage": cfg.zero_stage}
    if cfg.zero_stage == 3:
        if hidden_size is None:
            raise ValueError("deepspeed_config: actor.zero_stage=3 needs the model's hidden_size to size its buckets")
        zero.update(zero3_settings(hidden_size))
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": not cpu}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": not cpu}
    return {
        # Rows per micro-batch vary (token budget); DeepSpeed only checks these three agree.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "gradient_clipping": cfg.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": cfg.lr, "betas": list(cfg.betas), "eps": 1e-8, "weight_decay": cfg.weight_decay,
                       "torch_adam": cpu},
        },
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def hidden_size_of(model_path: str | Path) -> int:
    """The hidden size in folder `model_path`'s config.json (or its text_config's, for multimodal models).

    Read from the folder before loading, since ZeRO-3 needs its config to build the model partitioned.
    """
    from transformers import AutoConfig

    if not (Path(model_path) / "config.json").is_file():
        raise FileNotFoundError(f"actor model folder {model_path} has no config.json: "
                                "expected a Hugging Face model folder")
    config = AutoConfig.from_pretrained(model_path)
    for c in (config, getattr(config, "text_config", None)):
        if isinstance(getattr(c, "hidden_size", None), int):
            return c.hidden_size
    raise ValueError(f"{model_path}/config.json has no hidden_size (nor text_config.hidden_size): the DeepSpeed "
                     "actor sizes ZeRO-3's buckets from it; use actor.zero_stage=1 or 2 for this model")


@contextlib.contextmanager
def partitioned_construction(ds_config: dict) -> Iterator[None]:
    """While open, transformers' from_pretrained builds a model under deepspeed.zero.Init (ZeRO-3 configs).

    transformers keeps only a weak reference to the HfDeepSpeedConfig, so this holds it; on exit
    the global is cleared, so no later from_pretrained in the process is partitioned by surprise.
    """
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    held = HfDeepSpeedConfig(ds_config)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del held


def layer_key(name: str) -> str:
    """Parameters gathered together under ZeRO-3: one decoder layer's, or a top-level tensor alone."""
    m = _LAYER.match(name)
    return m.group(1) if m else name


class DeepSpeedActor:
    def __init__(self, cfg: ActorConfig, model_path: str | Path):
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        cfg.validate()
        self.cfg = cfg
        self.device = actor_device(cfg)
        self.rank, self.world = rank_and_world()
        # zero.Init reads the world size from deepspeed.comm, which deepspeed.initialize would set up too late.
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
        hidden = hidden_size_of(model_path) if cfg.zero_stage == 3 else None
        config = deepspeed_config(cfg, self.world, hidden_size=hidden)
        with partitioned_construction(config) if cfg.zero_stage == 3 else contextlib.nullcontext():
            model = load_policy(model_path, cfg)
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model.parameters(), cfg.weight_decay), config=config,
        )

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, entropy: bool = False,
                 hidden_layers: tuple[int, ...] | None = None, hidden: bool = False) -> LogProbs:
        self.engine.eval()
        forward = functools.partial(policy_forward, self.engine)
        return batched_logprobs(forward, input_ids.to(self.device), attention_mask.to(self.device),
                                self.cfg.micro_batch_tokens, entropy=entropy, hidden=hidden, hidden_layers=hidden_layers)

    def update(self, batch: TrainBatch, loss_fn: LossFn, *, entropy: bool = False) -> dict[str, float]:
        self.engine.train()

        @contextlib.contextmanager
        def boundary(last: bool):
            self.engine.set_gradient_accumulation_boundary(last)
            yield

        metrics = accumulate(functools.partial(policy_forward, self.engine), batch.to(self.device), loss_fn,
                             self.cfg.micro_batch_tokens, context=boundary,
                             backward=lambda loss: self.engine.backward(loss * self.world), entropy=entropy)
        self.engine.step()
        metrics["train/grad_norm"] = float(self.engine.get_global_grad_norm())
        return metrics

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        named = self.engine.module.named_parameters()
        if self.cfg.zero_stage != 3:
            for name, p in named:
                yield name, p.detach()
            return
        import deepspeed

        for _, group in itertools.groupby(named, key=lambda item: layer_key(item[0])):
            group = list(group)
            with deepspeed.zero.GatheredParameters([p for _, p in group]):
                for name, p in group:
                    yield name, p.detach().clone()

    def save(self, path: str | Path) -> None:
        with collective_folder(path) as tmp:
            self.engine.save_checkpoint(str(tmp), tag=TAG)
            save_rng(tmp, self.rank)

    def load(self, path: str | Path) -> None:
        r = self.rank
        model_file = f"{TAG}/mp_rank_00_model_states.pt|{TAG}/zero_pp_rank_{r}_mp_rank_00_model_states.pt"
        optim_file = f"{TAG}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt|{TAG}/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        path = require_files(path, [model_file, optim_file, rng_file(r)], "deepspeed actor")
        load_path, _ = self.engine.load_checkpoint(str(path), tag=TAG)
        if load_path is None:
            raise FileNotFoundError(f"deepspeed actor checkpoint folder {path}: DeepSpeed could not load tag {TAG!r}")
        load_rng(path, r)
