"""The actor: the policy being trained, behind one protocol for every training backend.

An actor is a transformers `AutoModelForCausalLM` loaded from the Hugging Face folder the engine
serves, so every model the engine runs trains with the ecosystem's tools (gradient
checkpointing, bf16, DDP, DeepSpeed ZeRO). Backends: `torch` (one process, or DDP when
torch.distributed is initialised with world size > 1), `deepspeed` (ZeRO stage 1 / 2 / 3) and
`megatron` (megatron-core's GPTModel with tensor / pipeline parallelism; its forward needs CUDA).

Vocabulary (see pipeline.records for the alignment rule): a *mini-batch* is one optimizer step's
`TrainBatch` on this rank; it is cut into *micro-batches* of at most `micro_batch_tokens` padded
tokens, whose gradients accumulate. Loss weights are normalised over the whole data-parallel
mini-batch (all ranks), so the step's gradient is the *sum* of the ranks' gradients: backends
multiply each loss by the world size to undo the mean that DDP and DeepSpeed take.

The RL loop's business, not the actor's: how many mini-batches and PPO epochs a step has, the
loss itself (passed in as `LossFn`), advantages and loss weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch

from common.optim import scheduled_lr
from pipeline.records import TrainBatch

# loss_fn(logprobs [b, T] with grad, entropy [b, T] with grad or None, micro) -> (loss, metrics); the
# loss is already weighted by micro.loss_weights, so the micro-batches' losses sum to the mini-batch's.
# Log-probs and entropies are those of micro.response_mask's tokens, 0 at the others (prompt and pads).
LossFn = Callable[[torch.Tensor, "torch.Tensor | None", TrainBatch], "tuple[torch.Tensor, dict[str, float]]"]

# Update metrics that add up over micro-batches and over ranks (a share of the mini-batch's loss, a
# token count); every other loss metric is a mean over its call's response tokens, and the gradient
# norm is the same on every rank (pipeline.algorithms.policy_loss, pipeline.update.learner).
ADDITIVE_METRICS = frozenset({"train/loss", "train/pg_loss", "train/response_tokens"})

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ActorCapabilities:
    """What an actor backend can do, declared on its class (`CAPS`, as engine.backend's backends
    declare theirs) and read before one is built (pipeline.actors.actor_class; launch.run.capabilities)."""

    offloads: bool  # optimizer states / parameters in CPU memory (actor.offload_optimizer, actor.offload_params)
    model_parallel: bool  # each layer's matrices or the layers split over ranks (actor.tensor_parallel, pipeline_parallel)
    autocast: bool  # bf16 products under autocast over float32 weights (actor.precision=bf16-mixed)
    cpu: bool  # trains on CPU (actor.device=cpu)
    subgroup: bool  # trains on a subgroup of the job's ranks (the separated placement's actor ranks)


@dataclass(kw_only=True)
class ActorConfig:
    backend: Literal["torch", "deepspeed", "megatron"] = "torch"
    lr: float = 1e-6
    # The learning rate over the RL steps (common.optim.scheduled_lr): a linear warmup over
    # lr_warmup_steps, then "constant", or "cosine" down to lr * lr_min_ratio at step
    # lr_schedule_steps (null: trainer.steps), and there after it. A function of the step alone: a
    # resumed run, or a shorter one with lr_schedule_steps set, follows the same curve.
    lr_schedule: Literal["constant", "cosine"] = "constant"
    lr_warmup_steps: int = 0
    lr_min_ratio: float = 0.1
    lr_schedule_steps: int | None = None
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    micro_batch_tokens: int = 8192  # padded tokens (rows x longest row) per micro-batch
    # Tokens per chunk of the LM head + log-softmax (pipeline/actors/chunked_head.py; torch and deepspeed
    # backends, megatron computes whole logits): the forward holds one chunk's [head_chunk_tokens, V]
    # float32 logits instead of a micro-batch's, the backward that and two more of its size (the softmax,
    # the logits' gradient) plus the head weight's float32 gradient [V, H]. 512 x 152,064 (Qwen2.5's
    # vocabulary) x 4 bytes is 311 MB a buffer.
    head_chunk_tokens: int = 512
    gradient_checkpointing: bool = False
    dtype: Literal["float32", "bfloat16"] = "float32"  # parameters and activations
    # The model's attention in the update: "tailspec" the project's causal CPU kernels (float32 on CPU,
    # faster than torch's SDPA there: pipeline/actors/attention.py), "sdpa" torch's; "auto" picks
    # tailspec on CPU in float32 where the kernels build, else sdpa.
    attention: Literal["auto", "tailspec", "sdpa"] = "auto"
    # The update's products: "float32", or "bf16-mixed" (float32 weights and optimizer, matrix products
    # in bfloat16 under autocast, attention's in bf16 arithmetic where the kernels have AVX512_BF16,
    # its softmax and the LM head in float32; pipeline/actors/precision.py);
    # "auto" picks bf16-mixed for the torch backend on a CPU with bfloat16 dot products.
    precision: Literal["auto", "float32", "bf16-mixed"] = "float32"
    device: str = "cpu"  # "cuda" places each rank on cuda:LOCAL_RANK
    zero_stage: Literal[1, 2, 3] = 2  # deepspeed only
    offload_optimizer: bool = False  # deepspeed only: optimizer states in CPU memory
    offload_params: bool = False  # deepspeed only, ZeRO-3: parameters in CPU memory
    tensor_parallel: int = 1  # megatron only: ranks that split each layer's matrices
    pipeline_parallel: int = 1  # megatron only: ranks that split the layers into stages

    def schedule_summary(self, steps: int) -> str | None:
        """One line on the learning rate over a run of `steps` RL steps (None for a constant rate
        without warmup), naming the steps past the schedule's horizon that train at its floor."""
        if self.lr_schedule == "constant" and self.lr_warmup_steps == 0:
            return None
        horizon = self.lr_schedule_steps or steps
        warm = f"a linear warmup over {self.lr_warmup_steps} steps, then " if self.lr_warmup_steps else ""
        if self.lr_schedule == "constant":
            return f"actor.lr_schedule=constant: {warm}{self.lr:g}"
        line = f"actor.lr_schedule=cosine: {warm}{self.lr:g} -> {self.lr * self.lr_min_ratio:g} over steps 1-{horizon}"
        if steps > horizon:
            line += (f"; steps {horizon + 1}-{steps} at {self.lr * self.lr_min_ratio:g} (actor.lr_schedule_steps="
                     f"{horizon} < trainer.steps={steps}: raise it to stretch the curve)")
        return line

    def lr_at(self, step: int, steps: int) -> float:
        """The learning rate in 0-based RL step `step` of a run of `steps` steps (lr_schedule over
        lr_schedule_steps, else `steps`)."""
        return scheduled_lr(self.lr, self.lr_schedule, step, self.lr_schedule_steps or steps, self.lr_warmup_steps,
                            self.lr_min_ratio)

    def validate(self) -> None:
        """The section's own values; what needs a capability of actor.backend is checked with the run's
        other needs (launch.run.capabilities)."""
        if not self.lr > 0:
            raise ValueError(f"actor.lr must be > 0, got {self.lr}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"actor.betas must both be in [0, 1), got {self.betas}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"actor.lr_schedule must be constant or cosine, got {self.lr_schedule!r}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"actor.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if self.lr_schedule_steps is not None and self.lr_schedule_steps < 1:
            raise ValueError(f"actor.lr_schedule_steps must be >= 1 (or null: trainer.steps), got {self.lr_schedule_steps}")
        if not 0 <= self.lr_min_ratio <= 1:
            raise ValueError(f"actor.lr_min_ratio must be in [0, 1] (the cosine's end as a share of actor.lr), "
                             f"got {self.lr_min_ratio}")
        for key in ("weight_decay", "grad_clip"):
            if getattr(self, key) < 0:
                raise ValueError(f"actor.{key} must be >= 0, got {getattr(self, key)}")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"actor.micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.head_chunk_tokens < 1:
            raise ValueError(f"actor.head_chunk_tokens must be >= 1 (tokens per chunk of the LM head), "
                             f"got {self.head_chunk_tokens}")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"actor.device must be 'cpu' or 'cuda', got {self.device!r}")
        for key in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, key) < 1:
                raise ValueError(f"actor.{key} must be >= 1, got {getattr(self, key)}")
        if self.attention == "tailspec" and (self.device != "cpu" or self.dtype != "float32"):
            raise ValueError(f"actor.attention=tailspec runs on CPU in float32 only (here actor.device={self.device}, "
                             f"actor.dtype={self.dtype}): set actor.attention=auto or sdpa")
        if self.precision == "bf16-mixed" and self.dtype != "float32":
            raise ValueError(f"actor.precision=bf16-mixed is autocast over float32 weights, got actor.dtype={self.dtype}: "
                             "set actor.precision=float32, or actor.dtype=float32")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"actor.offload_params needs actor.zero_stage=3, got {self.zero_stage}")


@dataclass(kw_only=True)
class LogProbs:
    logprobs: torch.Tensor  # [B, T] token-aligned: column t = log p(ids[t] | ids[:t]); column 0 and padding are 0
    entropy: torch.Tensor | None = None  # [B, T] entropy of the distribution column t's token was drawn from
    hidden: torch.Tensor | None = None  # [B, T, H] final (post-norm) hidden states, detached
    hidden_layers: dict[int, torch.Tensor] | None = None  # layer index -> [B, T, H] its output, detached


class Actor(Protocol):
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, entropy: bool = False,
                 hidden_layers: tuple[int, ...] | None = None, hidden: bool = False) -> LogProbs:
        """No-grad forward, micro-batched by token budget; hidden states come back detached."""

    def update(self, batch: TrainBatch, loss_fn: LossFn, *, entropy: bool = False) -> dict[str, float]:
        """One optimizer step on this mini-batch (entropy: pass loss_fn the entropy, with grad).

        Returns train/loss (this rank's), train/grad_norm (global, before clipping) and loss_fn's
        metrics averaged over micro-batches by response tokens. Collective under torch.distributed.
        """

    def set_lr(self, lr: float) -> None:
        """The learning rate of the optimizer steps that follow (the learner sets it each RL step)."""

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor) for every parameter, for weight sync."""

    def save(self, path: str | Path) -> None:
        """Model, optimizer and RNG state into folder `path`, atomically (collective under DDP / DeepSpeed)."""

    def load(self, path: str | Path) -> None:
        """Restores what save wrote; a malformed folder raises FileNotFoundError naming it and what is missing."""
