"""The torch actor backend: one process, or DDP when torch.distributed runs with world size > 1.

Gradients accumulate over the micro-batches under DDP's `no_sync` and are all-reduced once, in
the last backward; the loss is multiplied by the world size so that DDP's mean becomes the sum
that globally normalised loss weights call for (pipeline.actors.base). Optimiser and step are
common.optim's. A checkpoint is the model as a Hugging Face folder (config.json and
safetensors, loadable by the engine), `optimizer.pt` and each rank's RNG state. Every rank holds
the whole model and optimizer, so a checkpoint resumes on any number of ranks (a rank the saving
run did not have restores rank 0's RNG state: pipeline.actors.checkpoint.load_rng).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.actors.base import ActorCapabilities, ActorConfig, LogProbs, LossFn
from pipeline.actors.checkpoint import collective_folder, load_rng, rank_and_world, require_files, rng_file, save_rng
from pipeline.actors.forward import accumulate, batched_logprobs, forward_in, load_policy
from common.optim import clip_and_step, make_adamw, set_lr
from pipeline.records import TrainBatch


def actor_device(cfg: ActorConfig) -> torch.device:
    """cpu, or this rank's GPU (cuda:LOCAL_RANK) when cfg.device is cuda."""
    if cfg.device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(cfg.device)


class TorchActor:
    """`group`: the data-parallel ranks (None: the default process group, every rank)."""

    CAPS = ActorCapabilities(offloads=False, model_parallel=False, autocast=True, cpu=True, subgroup=True)

    def __init__(self, cfg: ActorConfig, model_path: str | Path, group=None):
        cfg.validate()
        self.cfg, self.group = cfg, group
        self.device = actor_device(cfg)
        self.rank, self.world = rank_and_world(group)
        self.model = load_policy(model_path, cfg).to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.ddp = None
        if self.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids, process_group=group)
        self.optimizer = make_adamw(self.params, cfg.lr, cfg.betas, cfg.weight_decay)
        # The update's forward goes through DDP (its hooks all-reduce the gradients); log-probs need none.
        self.train_forward = forward_in(self.ddp or self.model, cfg)
        self.eval_forward = forward_in(self.model, cfg)

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, entropy: bool = False,
                 hidden_layers: tuple[int, ...] | None = None, hidden: bool = False) -> LogProbs:
        self.model.eval()
        return batched_logprobs(self.eval_forward, input_ids.to(self.device), attention_mask.to(self.device),
                                self.cfg.micro_batch_tokens, entropy=entropy, hidden=hidden, hidden_layers=hidden_layers)

    def update(self, batch: TrainBatch, loss_fn: LossFn, *, entropy: bool = False) -> dict[str, float]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)

        def context(last: bool):
            return contextlib.nullcontext() if last or self.ddp is None else self.ddp.no_sync()

        metrics = accumulate(self.train_forward, batch.to(self.device), loss_fn,
                             self.cfg.micro_batch_tokens, context=context,
                             backward=lambda loss: (loss * self.world).backward(), entropy=entropy,
                             group=self.group)
        metrics["train/grad_norm"] = clip_and_step(self.optimizer, self.params, self.cfg.grad_clip)
        return metrics

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    def save(self, path: str | Path) -> None:
        with collective_folder(path, self.group) as tmp:
            if self.rank == 0:
                self.model.save_pretrained(tmp)
                torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            save_rng(tmp, self.rank)

    def load(self, path: str | Path) -> None:
        from transformers import AutoModelForCausalLM

        path = require_files(path, ["config.json", "model.safetensors|model.safetensors.index.json", "optimizer.pt",
                                    rng_file(0)], "torch actor")
        saved = AutoModelForCausalLM.from_pretrained(path, dtype=self.model.dtype)
        with torch.no_grad():
            self.model.load_state_dict(saved.state_dict())
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location=self.device))
        load_rng(path, self.rank)
        if self.world > 1:
            dist.barrier(group=self.group)
