"""The megatron actor backend: megatron-core's GPTModel with tensor parallelism, on CUDA.

Ranks: `actor.tensor_parallel` ranks split every layer's matrices (a *TP group*, one model
*replica*); the replicas are the data-parallel ranks (world size / TP). `actor.pipeline_parallel`
> 1 raises NotImplementedError: megatron's pipeline schedule is not wired in.

Rows: the trainer hands each rank its own rows (each rank rolls out its own prompts), but the TP
ranks of a replica must run the same micro-batches together. So `logprobs` and `update` first
gather their TP group's rows (`gather_group_rows`), all compute on all of them, and `logprobs`
hands back this rank's rows. The additive metrics (`train/loss`, `train/pg_loss`, the token count)
are the replica's divided by the TP size, so that, as with the other backends, the ranks' values
sum to the mini-batch's.

Gradients: each micro-batch's loss is backpropagated as it is (loss weights are normalised over
all ranks); then Qwen3's q/k-norm gradients are summed over the TP group (each TP rank saw only
its own heads, as in megatron's finalize_model_grads) and every gradient is summed over the
data-parallel group: the step's gradient is the sum over ranks (pipeline.actors.base), and no mean
is taken, so no world-size factor. The optimizer is common.optim's plain AdamW over this rank's
shards, not megatron's DistributedOptimizer: AdamW is elementwise, so a shard's step is the shard
of the full step; the one global quantity, the norm to clip by, sums squares over the TP group and
counts replicated tensors (norms) once.

Model: the HF folder's weights are converted by pipeline.actors.megatron_convert, split for this TP
rank and loaded strictly. The layer spec is Transformer Engine's when it is installed (fused
attention), else megatron's local spec, which materialises [b, heads, T, T] attention scores.
Logits are gathered over TP (runtime_gather_output) and the padded vocabulary dropped, so
log-probs and entropy are forward.py's token_logprobs / token_entropy, token-aligned the same way.
Unlike the torch and DeepSpeed backends' head (pipeline/actors/head.py), this one holds a micro-batch's
whole [b, T, V] logits and ignores actor.head_chunk_tokens: chunking it needs a vocabulary-parallel
log-softmax over each chunk's TP shards, which is not written (lower actor.micro_batch_tokens instead).
Attention is causal with no padding mask: rows are right-padded, so no real token sees a pad.

A checkpoint is each TP rank's parameters and optimizer state (`model_tp{t}.pt`,
`optimizer_tp{t}.pt`, written by data-parallel rank 0: the replicas are identical),
`megatron.json` with the parallel sizes, and each rank's RNG state. Dropout is off (HF's Llama /
Qwen have none), so megatron's CUDA RNG tracker draws nothing and is not saved.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common.optim import make_adamw, set_lr
from engine.checkpoint import load_state_dict
from pipeline.actors.base import ADDITIVE_METRICS, DTYPES, ActorCapabilities, ActorConfig, LogProbs, LossFn
from pipeline.actors.checkpoint import collective_folder, load_rng, rank_and_world, require_files, rng_file, save_rng
from pipeline.actors.deepspeed_actor import layer_key
from pipeline.actors.forward import accumulate, batched_logprobs, token_entropy, token_logprobs
from pipeline.actors.megatron_convert import (GPTLayout, hf_to_megatron, megatron_to_hf, merge_tensor, rope_settings,
                                              split_kind, split_tensor)
from pipeline.actors.torch_actor import actor_device
from pipeline.records import TrainBatch

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


def init_model_parallel(tp: int, pp: int, device: torch.device) -> None:
    """megatron's parallel_state for TP x PP (data parallel = the rest); a world-1 process group if none."""
    from megatron.core import parallel_state

    if not dist.is_initialized():  # one process without torchrun: megatron still needs a process group
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"actor.tensor_parallel ({tp}) x actor.pipeline_parallel ({pp}) must divide the world size "
                         f"({world})")
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise ValueError(f"megatron's parallel state is already TP x PP = {have}; this actor asks {(tp, pp)}")
        return
    parallel_state.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)


def seed_cuda_tracker(seed: int = 0) -> None:
    """megatron's CUDA RNG tracker, which its layers fork around dropout, without moving torch's CUDA generator."""
    from megatron.core import tensor_parallel

    state = torch.cuda.get_rng_state()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.cuda.set_rng_state(state)


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def build_gpt_model(hf_config, layout: GPTLayout, cfg: ActorConfig, device: torch.device) -> GPTModel:
    """An uninitialised GPTModel of the HF config's architecture, in cfg.dtype, laid out for this TP rank."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = DTYPES[cfg.dtype]
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config = TransformerConfig(
        num_layers=layout.num_layers, hidden_size=hf_config.hidden_size, num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_query_groups, kv_channels=layout.head_dim,
        ffn_hidden_size=hf_config.intermediate_size, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
        add_bias_linear=False, add_qkv_bias=layout.qkv_bias, qk_layernorm=layout.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=cfg.tensor_parallel, pipeline_model_parallel_size=cfg.pipeline_parallel,
        params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device.type == "cpu", perform_initialization=False,  # the HF weights are loaded next
        **(recompute if cfg.gradient_checkpointing else {}),
    )
    if layout.fused_norms:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=layout.qk_norm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=layout.qk_norm, normalization="RMSNorm")
    return GPTModel(config, spec, vocab_size=layout.padded_vocab, max_sequence_length=hf_config.max_position_embeddings,
                    position_embedding_type="rope", share_embeddings_and_output_weights=layout.tied,
                    **rope_settings(hf_config))


def load_megatron_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Strict load of the parameters in `state`; `_extra_state` entries (TE's fp8 metadata) stay the model's own."""
    own = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    model.load_state_dict({**own, **state}, strict=True)


@contextlib.contextmanager
def recorded_states(model: GPTModel, wanted: set[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Forward hooks filling {i: [b, T, H]} in HF's hidden_states indexing: 0 = the embeddings, i = decoder
    layer i's output, and the last (number of layers) = the final norm's output, as transformers reports it."""
    n = len(model.decoder.layers)
    if any(not 0 <= i <= n for i in wanted):
        raise ValueError(f"hidden_layers {sorted(wanted)}: this model has hidden states 0..{n}")
    modules = {0: model.embedding, **{i + 1: layer for i, layer in enumerate(model.decoder.layers)}}
    modules[n] = model.decoder.final_layernorm
    states: dict[int, torch.Tensor] = {}

    def keep(i: int):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output  # a layer returns (hidden, context)
            states[i] = out.detach().transpose(0, 1)  # [T, b, H] -> [b, T, H]
        return hook

    handles = [modules[i].register_forward_hook(keep(i)) for i in sorted(wanted)]
    try:
        yield states
    finally:
        for h in handles:
            h.remove()


def megatron_forward(model: GPTModel, vocab: int, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                     entropy: bool = False, hidden: bool = False, hidden_layers: tuple[int, ...] | None = None,
                     scored: torch.Tensor | None = None) -> LogProbs:
    """forward.py's policy_forward for a GPTModel: [b, T] right-padded rows -> token-aligned LogProbs,
    0 outside `scored` (None: the real tokens)."""
    b, T = input_ids.shape
    n = len(model.decoder.layers)
    wanted = set(hidden_layers or ()) | ({n} if hidden else set())
    positions = torch.arange(T, device=input_ids.device).expand(b, T)  # unused by rope, required by the signature
    with recorded_states(model, wanted) as states:
        logits = model(input_ids=input_ids, position_ids=positions, attention_mask=None, runtime_gather_output=True)
    logits = logits[..., :vocab]  # [b, T, V]: the padded vocabulary rows are no tokens
    real = attention_mask.bool() if scored is None else (scored * attention_mask).bool()
    return LogProbs(
        logprobs=token_logprobs(logits, input_ids).masked_fill(~real, 0.0),
        entropy=token_entropy(logits).masked_fill(~real, 0.0) if entropy else None,
        hidden=states[n] if hidden else None,
        hidden_layers={i: states[i] for i in hidden_layers} if hidden_layers else None,
    )


def gather_group_rows(tensors: list[torch.Tensor | None], group) -> tuple[list[torch.Tensor | None], slice]:
    """Each rank's [B_r, T_r] tensors -> every rank's rows, right-padded with zeros to the longest T_r and
    concatenated in group-rank order, on every rank of `group`; with the slice of this rank's rows.

    Collective over `group`; None stays None (it must be None on every rank)."""
    size = dist.get_world_size(group)
    first = next(t for t in tensors if t is not None)
    if size == 1:
        return tensors, slice(0, first.shape[0])
    shape = torch.tensor(first.shape, device=first.device)
    shapes = [torch.empty_like(shape) for _ in range(size)]
    dist.all_gather(shapes, shape, group=group)
    rows, width = [int(s[0]) for s in shapes], max(int(s[1]) for s in shapes)
    out: list[torch.Tensor | None] = []
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        padded = t.new_zeros(max(rows), width)
        padded[: t.shape[0], : t.shape[1]] = t
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded, group=group)
        out.append(torch.cat([p[:r] for p, r in zip(parts, rows)]))
    start = sum(rows[: dist.get_rank(group)])
    return out, slice(start, start + first.shape[0])


class MegatronActor:
    # megatron-core builds its parallel groups over the whole job and runs its forward on CUDA; bf16
    # is its own setting, not autocast over float32 weights
    CAPS = ActorCapabilities(offloads=False, model_parallel=True, autocast=False, cpu=False, subgroup=False)

    def __init__(self, cfg: ActorConfig, model_path: str | Path):
        from megatron.core import parallel_state
        from transformers import AutoConfig

        cfg.validate()
        if cfg.pipeline_parallel > 1:
            raise NotImplementedError(f"actor.pipeline_parallel={cfg.pipeline_parallel}: the megatron actor does not "
                                      "run megatron's pipeline schedule yet; use actor.tensor_parallel and data "
                                      "parallelism (actor.pipeline_parallel=1)")
        if not (Path(model_path) / "config.json").is_file():
            raise FileNotFoundError(f"actor model folder {model_path} has no config.json: expected a Hugging Face "
                                    "model folder")
        self.cfg = cfg
        self.device = actor_device(cfg)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.rank, _ = rank_and_world()
        init_model_parallel(cfg.tensor_parallel, cfg.pipeline_parallel, self.device)
        self.tp, self.tp_rank = cfg.tensor_parallel, parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp, self.dp_rank = dist.get_world_size(self.dp_group), dist.get_rank(self.dp_group)
        hf_config = AutoConfig.from_pretrained(model_path)
        for key in ("num_attention_heads", "intermediate_size"):
            if getattr(hf_config, key) % self.tp:
                raise ValueError(f"actor.tensor_parallel={self.tp} must divide config.json "
                                 f"{key}={getattr(hf_config, key)}")
        te = transformer_engine_available()
        if not te:
            warnings.warn("transformer_engine is not installed: the megatron actor uses megatron-core's local layer "
                          "spec, which materialises [b, heads, T, T] attention scores; pip install transformer-engine "
                          "for fused attention", stacklevel=2)
        self.layout = GPTLayout.from_hf_config(hf_config, tensor_parallel=self.tp, fused_norms=te)
        seed_cuda_tracker()
        self.model = build_gpt_model(hf_config, self.layout, cfg, self.device)
        # Every rank reads the whole folder (CPU memory) and keeps its shard.
        full = hf_to_megatron(load_state_dict(Path(model_path)), self.layout)
        load_megatron_state(self.model, {k: split_tensor(k, t, self.tp)[self.tp_rank] for k, t in full.items()})
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_adamw(self.params, cfg.lr, cfg.betas, cfg.weight_decay)
        self.forward = functools.partial(megatron_forward, self.model, self.layout.vocab)

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, entropy: bool = False,
                 hidden_layers: tuple[int, ...] | None = None, hidden: bool = False) -> LogProbs:
        self.model.eval()
        local = [input_ids.to(self.device), attention_mask.to(self.device)]
        (ids, mask), mine = gather_group_rows(local, self.tp_group)
        out = batched_logprobs(self.forward, ids, mask, self.cfg.micro_batch_tokens, entropy=entropy, hidden=hidden,
                               hidden_layers=hidden_layers)
        cut = lambda t: None if t is None else t[mine, : input_ids.shape[1]]  # noqa: E731
        layers = None if out.hidden_layers is None else {i: cut(h) for i, h in out.hidden_layers.items()}
        return LogProbs(logprobs=cut(out.logprobs), entropy=cut(out.entropy), hidden=cut(out.hidden),
                        hidden_layers=layers)

    def update(self, batch: TrainBatch, loss_fn: LossFn, *, entropy: bool = False) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        names = list(TrainBatch.__dataclass_fields__)
        local = batch.to(self.device)
        gathered, _ = gather_group_rows([getattr(local, n) for n in names], self.tp_group)
        replica = TrainBatch(**dict(zip(names, gathered)))  # this TP group's rows
        metrics = accumulate(self.forward, replica, loss_fn, self.cfg.micro_batch_tokens,
                             context=lambda last: contextlib.nullcontext(), backward=lambda loss: loss.backward(),
                             entropy=entropy)
        for key in ADDITIVE_METRICS & metrics.keys():
            metrics[key] /= self.tp  # every TP rank computed the replica's loss and tokens
        self._reduce_grads()
        metrics["train/grad_norm"] = self._clip_and_step()
        return metrics

    def _reduce_grads(self) -> None:
        """q/k-norm gradients summed over TP (each rank saw its heads only), then every gradient over data parallel."""
        for name, p in self.model.named_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # every rank joins every all-reduce
            if self.tp > 1 and ("q_layernorm" in name or "k_layernorm" in name):
                dist.all_reduce(p.grad, group=self.tp_group)
            if self.dp > 1:
                dist.all_reduce(p.grad, group=self.dp_group)

    def _clip_and_step(self) -> float:
        """common.optim.clip_and_step across TP shards: the global norm counts a replicated tensor once."""
        # By name, not megatron's tensor_model_parallel attribute: perform_initialization=False leaves it unset.
        counted = [p.grad for name, p in self.model.named_parameters()
                   if p.requires_grad and (split_kind(name) != "replicated" or self.tp_rank == 0)]
        squares = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in counted]).pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(squares, group=self.tp_group)
        norm = squares.sqrt()
        if self.cfg.grad_clip > 0:
            coef = (self.cfg.grad_clip / (norm + 1e-6)).clamp(max=1.0)
            for p in self.params:
                p.grad.mul_(coef)
        self.optimizer.step()
        return float(norm)

    def _full(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """This parameter gathered over the TP group into the full megatron tensor."""
        if self.tp == 1 or split_kind(name) == "replicated":
            return p.detach()
        shards = [torch.empty_like(p) for _ in range(self.tp)]
        dist.all_gather(shards, p.detach().contiguous(), group=self.tp_group)
        return merge_tensor(name, shards)

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, one decoder layer at a time (collective over the TP group)."""
        for _, group in itertools.groupby(self.model.named_parameters(), key=lambda item: layer_key(item[0])):
            yield from megatron_to_hf({name: self._full(name, p) for name, p in group}, self.layout).items()

    def save(self, path: str | Path) -> None:
        params = {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        with collective_folder(path) as tmp:
            if self.dp_rank == 0:
                torch.save(params, tmp / f"model_tp{self.tp_rank}.pt")
                torch.save(self.optimizer.state_dict(), tmp / f"optimizer_tp{self.tp_rank}.pt")
            if self.rank == 0:
                sizes = {"tensor_parallel": self.tp, "pipeline_parallel": self.cfg.pipeline_parallel}
                (tmp / "megatron.json").write_text(json.dumps(sizes))
            save_rng(tmp, self.rank)

    def load(self, path: str | Path) -> None:
        t = self.tp_rank
        path = require_files(path, ["megatron.json", f"model_tp{t}.pt", f"optimizer_tp{t}.pt", rng_file(self.rank)],
                             "megatron actor")
        saved = json.loads((path / "megatron.json").read_text())
        if saved["tensor_parallel"] != self.tp:
            raise ValueError(f"megatron actor checkpoint {path} was saved with actor.tensor_parallel="
                             f"{saved['tensor_parallel']}; this run has {self.tp}: resume with the same value")
        read = lambda name: torch.load(path / name, weights_only=True, map_location=self.device)  # noqa: E731
        load_megatron_state(self.model, read(f"model_tp{t}.pt"))
        self.optimizer.load_state_dict(read(f"optimizer_tp{t}.pt"))
        load_rng(path, self.rank)
        if dist.get_world_size() > 1:
            dist.barrier()
