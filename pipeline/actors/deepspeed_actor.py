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

The data-parallel ranks are the job's (`group` None) or a process group of it (a separated
placement's actor ranks, pipeline.placement): DeepSpeed learns the group through its `mpu`
interface (`DataParallelGroup`), and the engine, ZeRO's reductions and partitions, the gradient
norm and the model's initial broadcast all run on it. Nothing here runs a collective over the
whole job, since ranks outside the group (rollout ranks) never join one.

ZeRO-3 never holds the full model on one rank: the model is built under deepspeed.zero.Init over
the group (transformers' from_pretrained loads each rank's shard while an HfDeepSpeedConfig is
alive), and `named_weights` gathers one decoder layer at a time (deepspeed.zero.GatheredParameters).
Parameters under the persistence threshold (norms, biases) stay whole on every rank by design.

A checkpoint is each rank's ZeRO optimizer state (`engine.optimizer.state_dict()`: its partition
of the float32 master weights and of Adam's moments; pipeline.actors.zero_files), its RNG state
and, under ZeRO-1 / 2, the model as a Hugging Face folder (every rank holds the whole model;
ZeRO-3's weights are the master partitions, with the model's config.json and the parameter shapes
in partition order that join them: launch.export). DeepSpeed's own `save_checkpoint` is not used:
it runs barriers over the whole job. A checkpoint resumes on any number of data-parallel ranks
under the ZeRO stage that saved it: on as many, each rank loads its own state; on another number
(a preempted job back on fewer nodes), each rank reads every saved rank's state memory-mapped and
takes its own partition of the master weights and Adam's moments in the new engine's layout
(pipeline.actors.zero_reshard), and rank 0 logs the two numbers. A rank the saving run did not
have restores rank 0's RNG state (pipeline.actors.checkpoint.load_rng).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.actors import zero_reshard
from pipeline.actors.base import ActorCapabilities, ActorConfig, LogProbs, LossFn
from pipeline.actors.checkpoint import collective_folder, load_rng, rank_and_world, require_files, rng_file, save_rng
from pipeline.actors.forward import accumulate, batched_logprobs, load_policy, policy_forward
from pipeline.actors.zero_files import ZERO3_SHAPES, optimizer_file, saved_states, saved_world_and_stage
from common.optim import param_groups, set_lr
from pipeline.actors.torch_actor import actor_device
from pipeline.records import TrainBatch

log = logging.getLogger(__name__)
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


def deepspeed_config(cfg: ActorConfig, *, hidden_size: int | None = None) -> dict:
    """DeepSpeed's config dict for this actor section.

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
        # Rows per micro-batch vary (token budget): these only satisfy DeepSpeed's batch arithmetic,
        # which derives train_batch_size from its data-parallel world size. That size is the job's
        # for transformers' zero.Init and the group's for the engine, so it is left out.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
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


class DataParallelGroup:
    """DeepSpeed's `mpu` (model-parallel unit) for plain data parallelism over `group`.

    deepspeed.initialize and zero.Init take it to run every data-parallel collective on `group`
    instead of the whole job; model parallelism is one rank (this one). The model-parallel group
    is a group of this rank alone, made locally (no other rank joins its creation), because some
    of DeepSpeed's norm reductions call all_reduce on it whatever its size.
    """

    def __init__(self, group) -> None:
        self.group = group
        self.alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)

    def get_data_parallel_group(self):
        return self.group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.group)

    def get_model_parallel_group(self):
        return self.alone

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


_CONFINED: list = []  # the group deepspeed.comm's job-wide calls go to in this process, once set


def confine_job_collectives(group) -> None:
    """From now on in this process, DeepSpeed's barriers and broadcasts without a group run on `group`.

    DeepSpeed 0.19.8's ZeRO-3 runs a few collectives over the whole job even when given an mpu:
    three barriers while its optimizer is built (stage3.py) and, whenever it records the order in
    which modules fetch their parameters, broadcasts from global rank 0 that check every rank
    recorded the same order (zero/utils.py `assert_ints_same_as_other_ranks`). Ranks outside the
    data-parallel group never join them, so on a subgroup they would wait until the timeout.
    Confined to the group (whose rank 0 is global rank 0: pipeline.placement puts the actor ranks
    first), they synchronise and check exactly the ranks that train. DeepSpeed calls them through
    the `deepspeed.comm` module, whose two functions are wrapped here; nothing else in the
    process calls them, and a process holds one actor, so this is done once and never undone.
    The one place this backend replaces DeepSpeed functions.
    """
    import deepspeed.comm as ds_comm

    if _CONFINED:
        if _CONFINED[0] is not group:
            raise RuntimeError("a DeepSpeed actor on another process group was built in this process: DeepSpeed's "
                               "job-wide collectives can be confined to one group only")
        return
    if 0 not in dist.get_process_group_ranks(group):
        raise ValueError("a DeepSpeed actor on a process group needs global rank 0 in it (ZeRO-3 broadcasts from "
                         "rank 0); pipeline.placement=separated puts the actor ranks first")

    def on_group(fn, position: int):  # `position`: the index of fn's `group` parameter
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if len(args) > position:
                args = (*args[:position], group if args[position] is None else args[position], *args[position + 1:])
            elif kwargs.get("group") is None:
                kwargs["group"] = group
            return fn(*args, **kwargs)

        return call

    ds_comm.barrier, ds_comm.broadcast = on_group(ds_comm.barrier, 0), on_group(ds_comm.broadcast, 2)
    _CONFINED.append(group)


@contextlib.contextmanager
def partitioned_construction(ds_config: dict, mpu: DataParallelGroup | None, model_path: str | Path) -> Iterator[None]:
    """While open, transformers' from_pretrained builds folder model_path's model partitioned over
    mpu's group (None: the job).

    transformers builds under its own deepspeed.zero.Init (over the whole job) while an
    HfDeepSpeedConfig is alive and loads each layer's weights into the partitions; the
    zero.Init opened here first is the outermost one, and DeepSpeed partitions by the outermost
    context, so the partitions are the group's. transformers' `prevent_arange_dtype_change` is
    entered before it, as transformers does before its own (it keeps RoPE's arange in its dtype).
    The model's class is imported first: zero.Init replaces torch.Tensor.__new__, and a module
    first imported under it can fail (torch._dynamo checks that signature at import). Not confined
    to the group: transformers broadcasts the buffers a checkpoint holds over the whole job, with
    torch.distributed; the decoder LMs trained here (Llama, Qwen2) hold none.
    transformers keeps only a weak reference to the HfDeepSpeedConfig, so this holds it; on exit
    the global is cleared, so no later from_pretrained in the process is partitioned by surprise.
    """
    import deepspeed
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig
    from transformers.integrations.deepspeed import (HfDeepSpeedConfig, prevent_arange_dtype_change,
                                                     unset_hf_deepspeed_config)

    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model_path))]
    held = HfDeepSpeedConfig(ds_config)
    group = None if mpu is None else mpu.get_data_parallel_group()
    try:
        with prevent_arange_dtype_change(), deepspeed.zero.Init(data_parallel_group=group, mpu=mpu,
                                                                config_dict_or_path=ds_config):
            yield
    finally:
        unset_hf_deepspeed_config()
        del held


def layer_key(name: str) -> str:
    """Parameters gathered together under ZeRO-3: one decoder layer's, or a top-level tensor alone."""
    m = _LAYER.match(name)
    return m.group(1) if m else name


class DeepSpeedActor:
    """`group`: the data-parallel ranks (None: the default process group, every rank)."""

    # ZeRO offloads; bf16 is DeepSpeed's own setting, not autocast over float32 weights
    CAPS = ActorCapabilities(offloads=True, model_parallel=False, autocast=False, cpu=True, subgroup=True)

    def __init__(self, cfg: ActorConfig, model_path: str | Path, group=None):
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        cfg.validate()
        self.cfg, self.group = cfg, group
        self.device = actor_device(cfg)
        self.rank, self.world = rank_and_world(group)
        # zero.Init reads deepspeed.comm, which deepspeed.initialize would set up too late. With the
        # job's process group already made (torchrun), this only wraps it: no new group, no barrier.
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
        self.mpu = None
        if group is not None:
            confine_job_collectives(group)
            self.mpu = DataParallelGroup(group)
        hidden = hidden_size_of(model_path) if cfg.zero_stage == 3 else None
        config = deepspeed_config(cfg, hidden_size=hidden)
        with partitioned_construction(config, self.mpu, model_path) if cfg.zero_stage == 3 else contextlib.nullcontext():
            model = load_policy(model_path, cfg)
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model.parameters(), cfg.weight_decay), config=config,
            mpu=self.mpu,
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
                             backward=lambda loss: self.engine.backward(loss * self.world), entropy=entropy,
                             group=self.group)
        self.engine.step()
        metrics["train/grad_norm"] = float(self.engine.get_global_grad_norm())
        return metrics

    def set_lr(self, lr: float) -> None:
        set_lr(self.engine.optimizer, lr)

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
        with collective_folder(path, self.group) as tmp:
            if self.cfg.zero_stage != 3 and self.rank == 0:
                # ZeRO-1 / 2 keep the parameters as views of one flat buffer: copies, so that
                # safetensors sees separate tensors.
                self.engine.module.save_pretrained(tmp, state_dict={n: w.clone() for n, w in self.named_weights()})
            if self.cfg.zero_stage == 3 and self.rank == 0:
                # what joins the partitions into a model (launch.export, pipeline.actors.zero_reshard)
                self.engine.module.config.save_pretrained(tmp)
                shapes = [{n: list(s) for n, s in group.items()} for group in self.engine._get_zero_param_shapes()]
                torch.save({"param_shapes": shapes}, tmp / ZERO3_SHAPES)
            torch.save({"world": self.world, "optimizer": self.engine.optimizer.state_dict()},
                       tmp / optimizer_file(self.rank))
            save_rng(tmp, self.rank)

    def load(self, path: str | Path) -> None:
        r = self.rank
        model = ["config.json", "model.safetensors|model.safetensors.index.json"] if self.cfg.zero_stage != 3 else []
        path = require_files(path, [*model, optimizer_file(0), rng_file(0)], "deepspeed actor")
        saved_world, stage = saved_world_and_stage(path)
        if stage != self.cfg.zero_stage:
            raise ValueError(f"deepspeed actor checkpoint {path} was saved under ZeRO-{stage}, this actor runs "
                             f"ZeRO-{self.cfg.zero_stage}: resume with actor.zero_stage={stage} (a checkpoint's "
                             "partitions are re-sharded for another number of ranks, not for another stage)")
        if model:
            from transformers import AutoModelForCausalLM

            weights = AutoModelForCausalLM.from_pretrained(path, dtype=self.engine.module.dtype).state_dict()
            with torch.no_grad():
                self.engine.module.load_state_dict(weights)
        if saved_world == self.world:
            state = torch.load(path / optimizer_file(r), weights_only=False, map_location=self.device)["optimizer"]
        else:
            state = self._resharded(path, saved_world)
        # ZeRO's load takes every rank's state by data-parallel rank and reads its own only; it
        # restores the float32 masters and, under ZeRO-3, the partitions.
        states = [state if i == r else None for i in range(self.world)]
        optimizer = self.engine.optimizer
        if self.cfg.zero_stage == 3:
            optimizer.checkpoint_event_prologue()  # partitions every parameter, as engine.load_checkpoint does
        optimizer.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)
        if self.cfg.zero_stage == 3:
            optimizer.checkpoint_event_epilogue()  # gathers the persistent parameters back
        load_rng(path, r)

    def _resharded(self, path: Path, saved_world: int) -> dict:
        """This rank's optimizer state from a checkpoint `saved_world` ranks saved (pipeline.actors.zero_reshard)."""
        if self.rank == 0:
            log.warning("deepspeed actor checkpoint %s was saved by %d data-parallel ranks and is resumed on %d: its "
                        "ZeRO-%d partitions are re-sharded", path, saved_world, self.world, self.cfg.zero_stage)
        saved, template = saved_states(path, saved_world), self.engine.optimizer.state_dict()
        if self.cfg.zero_stage != 3:
            return zero_reshard.zero12_state(saved, template, self.rank)
        numels = [math.prod(s) for group in self.engine._get_zero_param_shapes() for s in group.values()]
        return zero_reshard.zero3_state(saved, template, numels, self.rank, self.world)
