"""Offline drafter warm-start: the target writes its own training data, the drafter learns it.

    python -m spot.warmstart --target DIR --prompts FILE.jsonl --out DIR [--kind eagle|eagle3] ...

1. generate: the target samples `n` responses per prompt (RolloutEngine, no speculation, its
   eos as stop token; `--chat` applies the tokenizer's chat template);
2. features: one teacher-forced forward per prompt + response gives the target's features
   (spot.features) as HiddenStateRows;
3. draft vocabulary: the most frequent ids of that text (spot.draft_vocab), or the full one;
4. train: an EagleModel on the pairs (f_t, x_{t+1}) -> f_{t+1} (spot.pairs) with the TLT loss
   (spot.loss), AdamW, warmup + cosine; ~5% of the prompts are held out, and the held-out top-1
   agreement and expected acceptance are measured before and after;
5. save: the drafter folder (EagleModel.save) plus `warmstart_summary.json`, built in
   `OUT.tmp` and renamed over OUT.

`--max-minutes` bounds the whole run: training gets what generation and features left (less a
reserve for the final evaluation and save); when time binds, the cosine schedule follows the
elapsed fraction of that budget, so the LR still anneals, and the run says it stopped early.
The target is frozen throughout: forwards run under no_grad, its weights have requires_grad off,
and the drafter reads its embedding and LM head detached.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.checkpoint import load_checkpoint, parse_dtype, read_config
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.generate import encode, read_prompts
from engine.model import Transformer
from engine.sampling import SamplingParams
from engine.spec.eagle import EagleConfig, EagleModel
from engine.types import Request
from spot.draft_vocab import default_size, most_frequent
from spot.features import TokenSequence, capture_features
from spot.loss import acceptance_metrics, eagle_loss
from spot.pairs import PackedPairs
from spot.records import RowStore

KINDS = ("eagle", "eagle3")


@dataclass(kw_only=True)
class WarmstartConfig:
    kind: str = "eagle"
    # generation
    n: int = 4  # samples per prompt
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    chat: bool = False
    max_batch: int = 32  # engine decode slots
    # data
    draft_vocab: int | None = None  # None: full vocabulary if V <= 4096, else 8192; 0: full
    feature_dtype: str = "float32"  # float32 | bfloat16 (halves the cache)
    feature_batch_tokens: int = 4096  # padded tokens per teacher-forced forward
    holdout: float = 0.05  # fraction of prompts held out
    # training
    steps: int = 1000
    batch_windows: int = 4  # windows of `window` pairs per step
    window: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ce_weight: float = 0.1
    # run
    seed: int = 0
    threads: int = 2
    max_minutes: float | None = None
    log_every: int = 20

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.feature_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"feature_dtype must be float32 or bfloat16, got {self.feature_dtype!r}")
        for name in ("n", "max_new_tokens", "max_batch", "feature_batch_tokens", "steps", "batch_windows", "window",
                     "threads", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "weight_decay", "grad_clip", "ce_weight", "temperature"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.draft_vocab is not None and self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0 (0 = full vocabulary), got {self.draft_vocab}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 <= self.holdout < 1:
            raise ValueError(f"holdout must be in [0, 1), got {self.holdout}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"max_minutes must be > 0, got {self.max_minutes}")
        if self.n > self.max_batch:
            raise ValueError(f"n ({self.n}) must be <= max_batch ({self.max_batch}): a prompt's samples decode together")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def progress_bar(total: int, desc: str, unit: str) -> tqdm:
    """A tqdm bar on stderr; redirected to a file it updates every 30 s instead of flooding it."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, mininterval=1 if sys.stderr.isatty() else 30)


# -- 1. generation ---------------------------------------------------------------------------
def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"target folder {path} has no usable tokenizer ({type(e).__name__}: {e})") from None


def generate(target: Transformer, tokenizer, prompts: list[dict], cfg: WarmstartConfig) -> tuple[list[TokenSequence], dict]:
    """The target's own responses: n per prompt; -> sequences (prompt + response) and generation stats."""
    requests = [Request(prompt_id=str(r["id"]), prompt=encode(tokenizer, r["prompt"], cfg.chat), n=cfg.n) for r in prompts]
    longest = max(len(r.prompt) for r in requests)
    engine = RolloutEngine(target, EngineConfig(max_batch=cfg.max_batch, max_len=longest + cfg.max_new_tokens, threads=cfg.threads))
    stops = tuple(target.config.eos_ids) or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    if not stops:
        log("warning: the target has no eos token id: every response runs to --max-new-tokens")
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                            stop_token_ids=stops, seed=cfg.seed)
    bar = progress_bar(len(requests) * cfg.n, "generate", "seq")
    rollouts = engine.generate(requests, params, progress=lambda done: bar.update(done - bar.n))
    bar.close()
    prompt_of = {r.prompt_id: r.prompt for r in requests}
    seqs = [TokenSequence(ro.prompt_id, ro.sample, prompt_of[ro.prompt_id] + ro.tokens, ro.prompt_tokens) for ro in rollouts]
    s = engine.last_stats
    stats = {
        "seconds": round(s.wall_s, 1), "response_tokens": s.new_tokens, "tokens_per_s": round(s.tokens_per_s, 1),
        "stopped": sum(ro.finish_reason == "stop" for ro in rollouts), "truncated": sum(ro.finish_reason == "length" for ro in rollouts),
    }
    log(f"generated {len(seqs)} responses, {s.new_tokens} tokens in {s.wall_s:.1f}s ({s.tokens_per_s:.0f} tok/s), "
        f"{stats['truncated']} cut at --max-new-tokens")
    return seqs, stats


# -- 4. training -----------------------------------------------------------------------------
def window_stream(num_windows: int, batch: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless batches of window indices: shuffled epochs, concatenated."""
    pending = torch.empty(0, dtype=torch.long)
    while True:
        while pending.numel() < batch:
            pending = torch.cat([pending, torch.randperm(num_windows, generator=generator)])
        yield pending[:batch]
        pending = pending[batch:]


def lr_at(cfg: WarmstartConfig, step: int, progress: float) -> float:
    """Linear warmup over warmup_steps, then cosine from lr to lr * min_lr_ratio as progress goes 0 -> 1."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batch_loss(model: EagleModel, packed: PackedPairs, idx: torch.Tensor, ce_weight: float):
    """-> (loss, metrics, pred [M, F], targets [M, F]) over the loss pairs of windows idx."""
    b = packed.batch(idx).to(model.fc.weight.device, model.fc.weight.dtype)
    pred = model(b.tokens, b.features, b.positions, attn_mask=b.attn_mask)  # [B, W, F]
    pred, targets = pred[b.loss_mask], b.targets[b.loss_mask]  # [M, F]
    with torch.no_grad():
        target_logits = model.logits(targets)  # [M, Vd]: the target's own head rows
    loss, metrics = eagle_loss(pred, targets, model.logits(pred), target_logits, ce_weight=ce_weight)
    return loss, metrics, pred, targets


def train(model: EagleModel, packed: PackedPairs, cfg: WarmstartConfig, seconds: float | None) -> dict:
    """Runs up to cfg.steps steps, or until `seconds` have passed; returns losses and timings."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    batches = window_stream(len(packed), min(cfg.batch_windows, len(packed)), torch.Generator().manual_seed(cfg.seed))
    model.train()
    losses: list[float] = []
    t0 = t_log = time.perf_counter()
    pairs = step = 0
    stopped_early = False
    for step in range(cfg.steps):
        elapsed = time.perf_counter() - t0
        if seconds is not None and elapsed >= seconds and step > 0:
            stopped_early = True
            log(f"stopping early at step {step}/{cfg.steps}: the --max-minutes budget ({cfg.max_minutes} min) is spent")
            break
        progress = max(step / cfg.steps, elapsed / seconds if seconds else 0.0)
        lr = lr_at(cfg, step, progress)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = next(batches)
        loss, metrics, _, _ = batch_loss(model, packed, idx, cfg.ce_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(loss.item())
        pairs += int(packed.loss[idx].sum())
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            now = time.perf_counter()
            w = losses[-cfg.log_every :]
            log(f"step {step + 1}/{cfg.steps} loss {sum(w) / len(w):.4f} (feature {metrics['spot/feature_loss']:.4f} "
                f"ce {metrics['spot/ce_loss']:.3f}) top1 {metrics['spot/top1_draft_vocab']:.3f} lr {lr:.2e} "
                f"pairs/s {pairs / (now - t_log):.0f} elapsed {now - t0:.0f}s")
            t_log, pairs = now, 0
    else:
        step = cfg.steps
    model.eval()
    k = min(10, len(losses))
    return {
        "steps": step, "stopped_early": stopped_early, "seconds": round(time.perf_counter() - t0, 1),
        "loss_start": sum(losses[:k]) / k, "loss_end": sum(losses[-k:]) / k, "losses": losses,
    }


@torch.no_grad()
def evaluate(model: EagleModel, packed: PackedPairs, cfg: WarmstartConfig) -> dict:
    """Held-out loss, top-1 agreement and expected acceptance at T = 1, weighted by pairs."""
    W_full = model.target.lm_head.weight.detach()  # [V, H]
    H = model.config.hidden_size
    sums = {"loss": 0.0, "top1_agreement": 0.0, "expected_acceptance": 0.0}
    total = 0
    for w in range(len(packed)):  # one window at a time: [M, V] full-vocabulary logits are large
        loss, _, pred, targets = batch_loss(model, packed, torch.tensor([w]), cfg.ce_weight)
        M = pred.shape[0]
        _, acc = acceptance_metrics(model.logits(pred), targets[:, -H:] @ W_full.t(), model.vocab_ids)
        sums["loss"] += loss.item() * M
        sums["top1_agreement"] += acc["spot/top1_agreement"] * M
        sums["expected_acceptance"] += acc["spot/expected_acceptance"] * M
        total += M
    return {k: round(v / total, 4) for k, v in sums.items()} | {"pairs": total}


# -- 5. saving -------------------------------------------------------------------------------
def save(model: EagleModel, out: Path, summary: dict) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save(tmp, extra={"warmstart": {k: v for k, v in summary.items() if k != "config"}})
    (tmp / "warmstart_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def collect_rows(target: Transformer, tokenizer, prompts: list[dict], cfg: WarmstartConfig) -> tuple[RowStore, dict]:
    """Steps 1-2: the target's responses, then its features over prompt + response."""
    seqs, gen_stats = generate(target, tokenizer, prompts, cfg)
    t0 = time.perf_counter()
    aux_layers = EagleConfig.for_target(target.config, cfg.kind).aux_layers
    bar = progress_bar(sum(len(s.tokens) for s in seqs), "features", "tok")
    rows = RowStore(capture_features(target, seqs, aux_layers, batch_tokens=cfg.feature_batch_tokens,
                                     dtype=parse_dtype(cfg.feature_dtype), progress=lambda d: bar.update(d - bar.n)))
    bar.close()
    stats = {"generation": gen_stats, "feature_seconds": round(time.perf_counter() - t0, 1)}
    log(f"features: {len(rows)} rows, {rows.num_tokens} tokens, F={rows.feature_size}, "
        f"{rows.nbytes / 2**20:.0f} MiB in {stats['feature_seconds']}s")
    return rows, stats


def choose_draft_vocab(rows: RowStore, vocab_size: int, size: int | None) -> torch.Tensor | None:
    """Step 3: the most frequent ids of the rows (None: the full vocabulary)."""
    vocab = most_frequent((r.tokens for r in rows), vocab_size, default_size(vocab_size) if size is None else size)
    if vocab is not None:
        inside = torch.zeros(vocab_size, dtype=torch.bool)
        inside[vocab] = True
        covered = sum(int(inside[r.tokens].sum()) for r in rows) / rows.num_tokens
        log(f"draft vocabulary: {len(vocab)} of {vocab_size} ids, covering {covered:.1%} of the tokens")
    return vocab


def warmstart(cfg: WarmstartConfig, target_path: str | Path, prompts_path: str | Path, out: str | Path) -> dict:
    """The whole run; returns the summary written next to the drafter."""
    cfg.validate()
    t0 = time.perf_counter()
    target_path, out = Path(target_path), Path(out)
    torch.set_num_threads(cfg.threads)
    prompts = read_prompts(prompts_path)
    read_config(target_path)  # a missing or broken target fails here, before anything slow
    tokenizer = load_tokenizer(target_path)
    target = load_checkpoint(target_path, torch.float32).requires_grad_(False)
    out.parent.mkdir(parents=True, exist_ok=True)

    rows, data_stats = collect_rows(target, tokenizer, prompts, cfg)
    vocab = choose_draft_vocab(rows, target.config.vocab_size, cfg.draft_vocab)
    train_rows, held_rows = rows.split_by_prompt(cfg.holdout, torch.Generator().manual_seed(cfg.seed))
    packed = PackedPairs(train_rows.rows, cfg.window)
    held = PackedPairs(held_rows.rows, cfg.window) if len(held_rows) else None
    log(f"train: {len(train_rows)} rows, {packed.num_pairs} loss pairs in {len(packed)} windows of {cfg.window}; "
        f"held out: {len(held_rows)} rows ({held.num_pairs if held else 0} pairs)")

    torch.manual_seed(cfg.seed)  # the drafter's initial weights
    ecfg = EagleConfig.for_target(target.config, cfg.kind, None if vocab is None else len(vocab))
    model = EagleModel(ecfg, target, vocab)
    before = evaluate(model, held, cfg) if held else None
    budget = None
    if cfg.max_minutes is not None:
        total = cfg.max_minutes * 60
        budget = total - (time.perf_counter() - t0) - max(10.0, 0.05 * total)  # reserve: evaluation and save
        if budget <= 0:
            log("warning: generation and features used up --max-minutes; training one step only")
    stats = train(model, packed, cfg, None if budget is None else max(budget, 0.0))
    after = evaluate(model, held, cfg) if held else None
    if after:
        log(f"held out: top-1 agreement {before['top1_agreement']:.3f} -> {after['top1_agreement']:.3f}, "
            f"expected acceptance {before['expected_acceptance']:.3f} -> {after['expected_acceptance']:.3f}")
    summary = {
        "kind": cfg.kind, "target": str(target_path), "prompts": len(prompts),
        "sequences": len(rows), "train_sequences": len(train_rows), "heldout_sequences": len(held_rows),
        "tokens": rows.num_tokens, "response_tokens": data_stats["generation"]["response_tokens"],
        "train_pairs": packed.num_pairs,
        "draft_vocab_size": target.config.vocab_size if vocab is None else len(vocab), **data_stats,
        "steps": stats["steps"], "stopped_early": stats["stopped_early"], "train_seconds": stats["seconds"],
        "train_loss_start": round(stats["loss_start"], 4), "train_loss_end": round(stats["loss_end"], 4),
        "heldout_before": before, "heldout": after,
        "heldout_top1_agreement": after["top1_agreement"] if after else None,
        "heldout_expected_acceptance": after["expected_acceptance"] if after else None,
        "seconds": round(time.perf_counter() - t0, 1),
        "config": dataclasses.asdict(cfg),
    }
    save(model, out, summary)
    return summary


def build_parser() -> argparse.ArgumentParser:
    d = WarmstartConfig()
    p = argparse.ArgumentParser(prog="python -m spot.warmstart", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="the target's HF folder (config.json, safetensors, tokenizer)")
    p.add_argument("--prompts", required=True, help='JSONL with {"id": ..., "prompt": "..."} lines')
    p.add_argument("--out", required=True, help="drafter folder to write (replaced atomically)")
    p.add_argument("--kind", choices=KINDS, default=d.kind)
    p.add_argument("--n", type=int, default=d.n, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to prompts")
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="decode slots while generating")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft vocabulary size; 0 = full; default: full if vocab <= 4096, else 8192")
    p.add_argument("--feature-dtype", choices=("float32", "bfloat16"), default=d.feature_dtype)
    p.add_argument("--holdout", type=float, default=d.holdout, help="fraction of prompts held out")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-windows", type=int, default=d.batch_windows, help="windows per step")
    p.add_argument("--window", type=int, default=d.window, help="pairs per packed window")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--ce-weight", type=float, default=d.ce_weight)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--max-minutes", type=float, default=None, help="wall-time budget of the whole run")
    p.add_argument("--log-every", type=int, default=d.log_every)
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    paths = {k: args.pop(k) for k in ("target", "prompts", "out")}
    try:
        cfg = WarmstartConfig(**args)
        s = warmstart(cfg, paths["target"], paths["prompts"], paths["out"])
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    held = (f"held-out top-1 agreement {s['heldout_top1_agreement']:.3f}, expected acceptance "
            f"{s['heldout_expected_acceptance']:.3f}" if s["heldout"] else "no held-out rows")
    print(f"wrote {paths['out']}: {s['kind']} drafter, {s['sequences']} sequences / {s['tokens']} tokens, {s['steps']} steps, "
          f"loss {s['train_loss_start']:.3f} -> {s['train_loss_end']:.3f}, {held}, {s['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
