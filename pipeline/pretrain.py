"""Pretrain a tiny Llama-style model from scratch on a synthetic task, on CPU, in minutes.

The result is the starting policy of the tiny RL config: a Hugging Face folder (config.json,
model.safetensors, tokenizer files) plus `pretrain_summary.json`, written atomically (built in
`OUT.tmp`, then renamed). Training is supervised next-token prediction on the task's reference
responses: the loss counts response tokens (and `<eos>`), not the prompt, whose digits are
random. Batches hold up to `batch_tokens` padded tokens; problems are drawn in pools, sorted by
length and cut into batches of similar lengths, so the long tail costs little padding.

    python -m pipeline.pretrain --out checkpoints/tiny [--task T --steps N --seed S --careless-share P ...]

`--careless-share P` replaces a share P of the responses by the task's careless teacher's
(`Task.careless`: arith never writes the last column's carry, mult drops the carry of its last
addition), as SFT data from imperfect demonstrators would: the policy then makes the slip greedily but
avoids it in part of its samples, a gap an exact-answer reward can close in a few RL steps. With
clean data alone the tiny arith model's sampled pass@8 is one point above its greedy accuracy:
nothing for a reward to select within the RL run's budget.

`--check-share P` (mult) makes a share P of the responses check their answer by working the problem
a second time, carefully (`Task.checking`): the policy then checks in part of its samples, which
doubles their length and repairs a careless first pass.

Every field of `PretrainConfig` is a flag (`hidden_size` -> `--hidden-size`). On a machine whose
cores are busy, set OMP_WAIT_POLICY=PASSIVE in the environment: spinning OpenMP threads that
share a core with another process make steps many times slower. This module knows nothing about
RL; accuracy is measured with the plain greedy decoder of `pipeline.tasks.eval`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.checkpoint import save_checkpoint
from engine.model import Transformer
from engine.model_config import ModelConfig
from pipeline.tasks import TASKS, Problem, get_task
from common.optim import make_adamw, set_lr, train_step, warmup_cosine
from pipeline.tasks.eval import EVAL_SEED, evaluate
from pipeline.tasks.tokenizer import build_tokenizer

IGNORE = -100  # target id that the loss skips


@dataclass(kw_only=True)
class PretrainConfig:
    task: str = "arith"
    seed: int = 0
    steps: int = 800
    batch_tokens: int = 2048  # rows x longest row, padding included
    pool_size: int = 1024  # problems sorted by length together to form batches
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    init_std: float = 0.02
    threads: int = 2
    # Share of the training examples demonstrated by the task's careless teacher (`Task.careless`).
    # Like SFT data from imperfect demonstrators, it leaves a policy whose flaw a verifiable
    # reward can remove.
    careless_share: float = 0.0
    # Share of the examples whose response checks its answer by working the problem again
    # (`Task.checking`, the first pass careless as drawn above): the samples of one prompt then
    # differ in length, and checking earns reward that RL can select.
    check_share: float = 0.0
    eval_problems: int = 200  # held-out test problems for the final greedy accuracy
    eval_max_new_tokens: int = 384  # the greedy decoder's budget per held-out response
    log_every: int = 50

    def validate(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task: unknown task {self.task!r}; available: {', '.join(sorted(TASKS))}")
        positive = (
            "steps", "batch_tokens", "pool_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "threads", "log_every",
            "eval_max_new_tokens",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.careless_share <= 1:
            raise ValueError(f"careless_share must be in [0, 1], got {self.careless_share}")
        if self.careless_share and TASKS[self.task].careless is None:
            raise ValueError(f"careless_share: task {self.task!r} has no careless teacher; set it to 0")
        if not 0 <= self.check_share <= 1:
            raise ValueError(f"check_share must be in [0, 1], got {self.check_share}")
        if self.check_share and TASKS[self.task].checking is None:
            raise ValueError(f"check_share: task {self.task!r} has no checking teacher (mult has); set it to 0")
        for name in ("warmup_steps", "weight_decay", "grad_clip", "eval_problems"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not self.init_std > 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.batch_tokens < self.max_position_embeddings:
            raise ValueError(
                f"batch_tokens ({self.batch_tokens}) must be >= max_position_embeddings "
                f"({self.max_position_embeddings}) so that any one problem fits in a batch"
            )


def build_model(cfg: PretrainConfig, tokenizer) -> Transformer:
    model_cfg = ModelConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Transformer(model_cfg)
    for name, p in model.named_parameters():
        if p.dim() == 2:  # Linear and (tied) embedding weights; norms keep their ones
            torch.nn.init.normal_(p, std=cfg.init_std)
    return model


def encode_example(tokenizer, problem: Problem) -> tuple[list[int], int]:
    """[bos] + prompt + response + [eos] as ids, and the prompt's length in tokens (with bos)."""
    prompt = tokenizer(problem.prompt).input_ids
    response = tokenizer(problem.response, add_special_tokens=False).input_ids
    return prompt + response + [tokenizer.eos_token_id], len(prompt)


def collate(examples: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> inputs [B, T-1] (right-padded) and targets [B, T-1]: the next token, IGNORE outside responses."""
    T = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)  # [B, T]
    targets = torch.full((len(examples), T), IGNORE, dtype=torch.long)  # [B, T]
    for b, (seq, prompt_len) in enumerate(examples):
        ids[b, : len(seq)] = torch.tensor(seq)
        targets[b, prompt_len : len(seq)] = ids[b, prompt_len : len(seq)]
    return ids[:, :-1], targets[:, 1:]


def length_bucketed(examples: list[tuple[list[int], int]], batch_tokens: int) -> list[list[tuple[list[int], int]]]:
    """Cut examples, sorted by length, into batches of at most batch_tokens padded tokens."""
    batches: list[list[tuple[list[int], int]]] = [[]]
    for ex in sorted(examples, key=lambda e: len(e[0])):
        if batches[-1] and (len(batches[-1]) + 1) * len(ex[0]) > batch_tokens:
            batches.append([])
        batches[-1].append(ex)
    return batches


def demonstrated(problems: list[Problem], share: float, rng: random.Random, careless: Callable[[Problem], str] | None,
                 check_share: float = 0.0, checking: Callable[[Problem, bool], str] | None = None) -> list[Problem]:
    """The problems with a `share` of their responses replaced by `careless(problem)` and, drawn
    independently, a `check_share` by `checking(problem, careless)` (seeded). With check_share 0
    the draws are those of the careless share alone, so the data is unchanged by the option."""
    if share and careless is None:
        raise ValueError("a careless share needs a careless teacher")
    if check_share and checking is None:
        raise ValueError("a check share needs a checking teacher")
    out = []
    for p in problems:
        slip = bool(share) and rng.random() < share
        if check_share and rng.random() < check_share:
            p = dataclasses.replace(p, response=checking(p, slip))
        elif slip:
            p = dataclasses.replace(p, response=careless(p))
        out.append(p)
    return out


def train_batches(cfg: PretrainConfig, tokenizer) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless stream of (inputs, targets) from the task's train split, in a seeded order."""
    task, rng, start = get_task(cfg.task), random.Random(f"pretrain:{cfg.seed}"), 0
    careless_rng = random.Random(f"careless:{cfg.seed}")
    while True:
        problems = task.make_problems("train", cfg.pool_size, cfg.seed, start=start)
        start += cfg.pool_size
        problems = demonstrated(problems, cfg.careless_share, careless_rng, task.careless, cfg.check_share,
                                task.checking)
        examples = [encode_example(tokenizer, p) for p in problems]
        longest = max(len(ids) for ids, _ in examples)
        if longest > cfg.max_position_embeddings:
            raise ValueError(f"a {cfg.task} example has {longest} tokens, more than max_position_embeddings "
                             f"({cfg.max_position_embeddings}); raise it")
        batches = length_bucketed(examples, cfg.batch_tokens)
        rng.shuffle(batches)
        for batch in batches:
            yield collate(batch, tokenizer.pad_token_id)


def lr_at(cfg: PretrainConfig, step: int) -> float:
    """Linear warmup, then cosine from lr down to lr * min_lr_ratio at the last step."""
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return warmup_cosine(cfg.lr, step, cfg.warmup_steps, progress, cfg.min_lr_ratio)


def train(cfg: PretrainConfig, model: Transformer, tokenizer) -> list[float]:
    """Runs cfg.steps optimizer steps; returns the loss of each step."""
    params = list(model.parameters())
    opt = make_adamw(params, cfg.lr, (0.9, 0.95), cfg.weight_decay)
    model.train()
    losses: list[float] = []
    batches = train_batches(cfg, tokenizer)
    t0 = t_log = time.perf_counter()
    tokens = 0
    for step in range(cfg.steps):
        inputs, targets = next(batches)  # [B, T]
        set_lr(opt, lr_at(cfg, step))
        positions = torch.arange(inputs.shape[1]).expand_as(inputs)  # [B, T]
        logits = model(inputs, positions).logits  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        train_step(loss, opt, params, cfg.grad_clip)
        losses.append(loss.item())
        tokens += int((inputs != tokenizer.pad_token_id).sum())
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            now = time.perf_counter()
            window = losses[-cfg.log_every :]
            print(
                f"step {step + 1}/{cfg.steps} loss {sum(window) / len(window):.4f} lr {lr_at(cfg, step):.2e} "
                f"tokens/s {tokens / (now - t_log):.0f} elapsed {now - t0:.0f}s",
                file=sys.stderr,
                flush=True,
            )
            t_log, tokens = now, 0
    return losses


def pretrain(cfg: PretrainConfig, out: str | Path) -> dict:
    """Trains, evaluates and writes the model folder `out` atomically; returns the summary."""
    cfg.validate()
    out = Path(out)
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    tokenizer = build_tokenizer()
    model = build_model(cfg, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}", file=sys.stderr)
    losses = train(cfg, model, tokenizer)
    train_s = time.perf_counter() - t0

    accuracy = None
    if cfg.eval_problems:
        problems = get_task(cfg.task).make_problems("test", cfg.eval_problems, EVAL_SEED)
        accuracy = evaluate(model, tokenizer, problems, cfg.eval_max_new_tokens)
        print(f"held-out greedy accuracy: {accuracy:.3f} on {len(problems)} {cfg.task}/test problems", file=sys.stderr)

    tail = losses[-min(len(losses), cfg.log_every) :]
    summary = {
        "steps": cfg.steps,
        "parameters": n_params,
        "initial_loss": losses[0],
        "final_loss": sum(tail) / len(tail),  # mean over the last log window
        "heldout_accuracy": accuracy,
        "heldout_problems": cfg.eval_problems,
        "train_seconds": round(train_s, 1),
        "seconds": round(time.perf_counter() - t0, 1),
        "config": dataclasses.asdict(cfg),
    }
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(model, tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "pretrain_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return summary


def parse_args(argv: list[str] | None = None) -> tuple[PretrainConfig, Path]:
    parser = argparse.ArgumentParser(prog="python -m pipeline.pretrain", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="model folder to write")
    for f in dataclasses.fields(PretrainConfig):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, metavar=f.name.upper())
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    cfg = PretrainConfig(**args)
    try:
        cfg.validate()
    except ValueError as e:
        parser.error(str(e))
    return cfg, out


def main(argv: list[str] | None = None) -> None:
    cfg, out = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    summary = pretrain(cfg, out)
    print(
        f"wrote {out}: {summary['parameters'] / 1e6:.2f}M parameters, {summary['steps']} steps, "
        f"final loss {summary['final_loss']:.4f}, held-out accuracy {summary['heldout_accuracy']}, "
        f"{summary['seconds']:.0f}s"
    )


if __name__ == "__main__":
    main()
