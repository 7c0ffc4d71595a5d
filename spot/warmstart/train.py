"""Offline drafter warm-start: the target writes its own training data, the drafter learns it.

    python -m spot.warmstart --target DIR --prompts FILE.jsonl --out DIR [--kind eagle|eagle3|mtp|eagle3_vllm] ...
    torchrun --nproc-per-node=R -m spot.warmstart ...   (the same run over R ranks: spot.warmstart.ranks)

1-3. data (spot.warmstart.data): the target's own responses (n per prompt, `--chat` applies the
   tokenizer's chat template), their features, a draft vocabulary;
4. train (spot.training.step): an EagleModel on the pairs (f_t, x_{t+1}) -> f_{t+1}
   (spot.training.pairs) with the TLT loss (spot.training.loss), AdamW, warmup + cosine; ~5% of the prompts are
   held out, and the held-out top-1 agreement, expected acceptance and the accept length they
   imply for a depth-`accept_depth` chain (the tokens per step a user should expect) are
   measured before and after;
5. save: the drafter folder (EagleModel.save) plus `warmstart_summary.json`, written atomically
   (common.atomic) by rank 0.

Under torchrun each rank generates its share of the prompts and keeps their features; the
drafter is trained data-parallel on the 1-rank run's batches, so R ranks write the 1-rank
drafter up to float rounding (spot.warmstart.ranks says how).

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
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from common.atomic import atomic_folder
from common.text import load_tokenizer, read_prompts
from engine.checkpoint import load_checkpoint, read_config
from engine.spec.config import SpecConfig
from engine.spec.eagle import KINDS as DRAFTER_KINDS, EagleConfig, EagleModel
from spot.training.step import DrafterOptim, Step, evaluate, log, train
from spot.training.pairs import PackedPairs
from spot.training.records import RowStore
from spot.warmstart.data import Prompt, choose_draft_vocab, collect_rows, encode_prompts
from spot.warmstart.ranks import (Ranks, ShardedPairs, clock, evaluate_sharded, gather_layout, gather_stats, join, leave,
                                  local_part, rank_device, shard)

KINDS = DRAFTER_KINDS  # engine.spec.eagle: eagle, eagle3, mtp, eagle3_vllm


@dataclass(kw_only=True)
class WarmstartConfig:
    kind: str = "eagle"
    # generation
    n: int = 4  # samples per prompt
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0  # 0: off
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
    # the drafter's optimiser (`optim()`): DrafterOptim's defaults, warmup then cosine
    lr: float = DrafterOptim.lr
    min_lr_ratio: float = DrafterOptim.min_lr_ratio
    warmup_steps: int = DrafterOptim.warmup_steps
    weight_decay: float = DrafterOptim.weight_decay
    grad_clip: float = DrafterOptim.grad_clip
    ce_weight: float = DrafterOptim.ce_weight
    # run
    seed: int = 0
    threads: int = 2
    device: str = "cpu"  # the target, its rollouts, the feature pass and the drafter's training ("cuda" on a GPU)
    max_minutes: float | None = None
    log_every: int = 20
    accept_depth: int = SpecConfig.depth  # the chain the held-out accept-length estimate is for (the engine's default)

    def validate(self) -> None:
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.feature_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"feature_dtype must be float32 or bfloat16, got {self.feature_dtype!r}")
        for name in ("n", "max_new_tokens", "max_batch", "feature_batch_tokens", "steps", "batch_windows", "window",
                     "threads", "log_every", "accept_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.draft_vocab is not None and self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0 (0 = full vocabulary), got {self.draft_vocab}")
        if self.kind == "mtp" and self.draft_vocab:
            raise ValueError("an mtp head predicts over the full vocabulary (vLLM's mtp method has no draft-vocab map): "
                             "drop --draft-vocab or pass --draft-vocab 0")
        self.optim()  # ValueError naming a bad optimiser key
        if not 0 <= self.holdout < 1:
            raise ValueError(f"holdout must be in [0, 1), got {self.holdout}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"max_minutes must be > 0, got {self.max_minutes}")

    def optim(self) -> DrafterOptim:
        return DrafterOptim.from_config(self)


def save(model: EagleModel, out: Path, summary: dict) -> None:
    with atomic_folder(out) as tmp:
        model.save(tmp, extra={"warmstart": {k: v for k, v in summary.items() if k != "config"}})
        (tmp / "warmstart_summary.json").write_text(json.dumps(summary, indent=2) + "\n")



@dataclass
class Prepared:
    """The training and held-out data as the loop sees them: one process's, or a rank's share."""

    packed: PackedPairs  # the windows drawn from (on several ranks: the layout every rank shares)
    vocab: torch.Tensor | None
    rows: RowStore  # every row (several ranks: featureless), for the counts
    train_sequences: int
    held_sequences: int
    evaluate: Callable[[EagleModel], dict] | None  # held-out metrics; None without held-out rows
    step: Step | None = None  # DrafterTrainer.step on `packed` when None
    clock: Callable[[float], float] | None = None


def prepare(rows: RowStore, cfg: WarmstartConfig, vocab_size: int) -> Prepared:
    """One process: the draft vocabulary, the held-out split by prompt, the packed pairs."""
    vocab = choose_draft_vocab(rows, vocab_size, 0 if cfg.kind == "mtp" else cfg.draft_vocab)
    train_rows, held_rows = rows.split_by_prompt(cfg.holdout, torch.Generator().manual_seed(cfg.seed))
    held = PackedPairs(held_rows.rows, cfg.window) if len(held_rows) else None
    return Prepared(
        PackedPairs(train_rows.rows, cfg.window), vocab, rows, len(train_rows), len(held_rows),
        (lambda m: evaluate(m, held, cfg.ce_weight, cfg.accept_depth)) if held else None,
    )


def prepare_sharded(rows: RowStore, prompts: list[Prompt], cfg: WarmstartConfig, vocab_size: int, r: Ranks,
                    device) -> Prepared:
    """Several ranks: the same choices as `prepare` from every rank's token ids; features stay (spot.warmstart.ranks)."""
    layout = gather_layout(rows, prompts, r)
    vocab = choose_draft_vocab(layout, vocab_size, 0 if cfg.kind == "mtp" else cfg.draft_vocab)
    train_layout, held_layout = layout.split_by_prompt(cfg.holdout, torch.Generator().manual_seed(cfg.seed))
    packed = PackedPairs(train_layout.rows, cfg.window)
    sharded = ShardedPairs(packed, *local_part(train_layout, rows), device)
    held_rows, _ = local_part(held_layout, rows)
    return Prepared(
        packed, vocab, layout, len(train_layout), len(held_layout),
        (lambda m: evaluate_sharded(m, held_rows, cfg.window, cfg.ce_weight, cfg.accept_depth, device))
        if len(held_layout) else None,
        step=sharded.step, clock=lambda elapsed: clock(elapsed, device),
    )


def warmstart(cfg: WarmstartConfig, target_path: str | Path, prompts_path: str | Path, out: str | Path,
              r: Ranks = Ranks()) -> dict:
    """The whole run on a `{"id", "prompt"}` JSONL file's prompts (`cfg.chat`: as user turns of the
    chat template); returns the summary written next to the drafter (by rank 0 of `r`)."""
    cfg.validate()
    rows = read_prompts(prompts_path)
    read_config(target_path)  # a missing or broken target fails here, before anything slow
    prompts = encode_prompts(load_tokenizer(target_path), rows, cfg.chat)
    return warmstart_prompts(cfg, target_path, prompts, out, r, source=str(prompts_path))


def warmstart_prompts(cfg: WarmstartConfig, target_path: str | Path, prompts: list[Prompt], out: str | Path,
                      r: Ranks = Ranks(), source: str = "") -> dict:
    """The whole run on prompts given as token ids (launch.warmstart: the RL run's own); `source`
    says where they came from in the summary."""
    cfg.validate()
    if not prompts:
        raise ValueError(f"no prompts to warm-start on ({source or 'none given'})")
    t0 = time.perf_counter()
    target_path, out = Path(target_path), Path(out)
    torch.set_num_threads(cfg.threads)
    device = rank_device(cfg.device, r)
    read_config(target_path)  # a missing or broken target fails here, before anything slow
    tokenizer = load_tokenizer(target_path)
    target = load_checkpoint(target_path, torch.float32, device).requires_grad_(False)
    out.parent.mkdir(parents=True, exist_ok=True)

    longest = max(len(p.tokens) for p in prompts)
    mine = shard(prompts, r) if r.world > 1 else prompts
    rows, data_stats = collect_rows(target, tokenizer, mine, cfg, longest)
    if r.world > 1:
        data_stats = gather_stats(data_stats, r)
        data = prepare_sharded(rows, prompts, cfg, target.config.vocab_size, r, device)
    else:
        data = prepare(rows, cfg, target.config.vocab_size)
    packed, vocab = data.packed, data.vocab
    log(f"train: {data.train_sequences} rows, {packed.num_pairs} loss pairs in {len(packed)} windows of {cfg.window}; "
        f"held out: {data.held_sequences} rows" + (f" on {r.world} ranks" if r.world > 1 else ""))

    torch.manual_seed(cfg.seed)  # the drafter's initial weights
    ecfg = EagleConfig.for_target(target.config, cfg.kind, None if vocab is None else len(vocab))
    model = EagleModel(ecfg, target, vocab).to(target.device)
    before = data.evaluate(model) if data.evaluate else None
    budget = None
    if cfg.max_minutes is not None:
        total = cfg.max_minutes * 60
        budget = total - (time.perf_counter() - t0) - max(10.0, 0.05 * total)  # reserve: evaluation and save
        budget = data.clock(budget) if data.clock else budget  # rank 0's, on every rank
        if budget <= 0:
            log("warning: generation and features used up --max-minutes; training one step only")
    stats = train(model, packed, cfg.optim(), steps=cfg.steps, batch_windows=cfg.batch_windows, seed=cfg.seed,
                  seconds=None if budget is None else max(budget, 0.0), log_every=cfg.log_every, step=data.step,
                  clock=data.clock)
    model.eval()
    after = data.evaluate(model) if data.evaluate else None
    if after:
        log(f"held out: top-1 agreement {before['top1_agreement']:.3f} -> {after['top1_agreement']:.3f}, "
            f"expected acceptance {before['expected_acceptance']:.3f} -> {after['expected_acceptance']:.3f}, "
            f"{accept_len_phrase(after, cfg.accept_depth)}")
    summary = {
        "kind": cfg.kind, "target": str(target_path), "prompts": len(prompts), "prompt_source": source, "ranks": r.world,
        "sequences": len(data.rows), "train_sequences": data.train_sequences, "heldout_sequences": data.held_sequences,
        "tokens": data.rows.num_tokens, "response_tokens": data_stats["generation"]["response_tokens"],
        "train_pairs": packed.num_pairs,
        "draft_vocab_size": target.config.vocab_size if vocab is None else len(vocab), **data_stats,
        "steps": stats["steps"], "stopped_early": stats["stopped_early"], "train_seconds": stats["seconds"],
        "train_loss_start": round(stats["loss_start"], 4), "train_loss_end": round(stats["loss_end"], 4),
        "heldout_before": before, "heldout": after,
        "heldout_top1_agreement": after["top1_agreement"] if after else None,
        "heldout_expected_acceptance": after["expected_acceptance"] if after else None,
        "accept_depth": cfg.accept_depth,
        "heldout_expected_accept_len": after["accept_len"] if after else None,
        "heldout_expected_accept_len_greedy": after["accept_len_greedy"] if after else None,
        "seconds": round(time.perf_counter() - t0, 1),
        "config": dataclasses.asdict(cfg),
    }
    if r.main:
        save(model, out, summary)
    return summary


def accept_len_phrase(held: dict, depth: int) -> str:
    """The accept length a user should expect, in words (evaluate_sums says how it is estimated)."""
    return (f"expected accept length {held['accept_len']:.2f} tokens per step at T = 1 ({held['accept_len_greedy']:.2f} "
            f"greedy) for a depth-{depth} chain (teacher-forced: an estimate from above)")


def build_parser(prog: str = "python -m spot.warmstart", paths: bool = True) -> argparse.ArgumentParser:
    """The warm start's flags; `paths`: with --target and --prompts (launch.warmstart takes both from a run config)."""
    d = WarmstartConfig()
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    if paths:
        p.add_argument("--target", required=True, help="the target's HF folder (config.json, safetensors, tokenizer)")
        p.add_argument("--prompts", required=True, help='JSONL with {"id": ..., "prompt": "..."} lines')
    p.add_argument("--out", required=True, help="drafter folder to write (replaced atomically)")
    p.add_argument("--kind", choices=KINDS, default=d.kind)
    p.add_argument("--samples", "--n", dest="n", type=int, default=d.n,
                   help="samples per prompt (under torchrun write --samples: its parser reads --n as one of its flags)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-k", type=int, default=d.top_k)
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
    p.add_argument("--device", default=d.device, help="cpu, or cuda for a large target (minutes instead of hours)")
    p.add_argument("--max-minutes", type=float, default=None, help="wall-time budget of the whole run")
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--accept-depth", type=int, default=d.accept_depth,
                   help="draft depth the held-out accept-length estimate is for (engine.spec.depth)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    paths = {k: args.pop(k) for k in ("target", "prompts", "out")}
    try:
        cfg = WarmstartConfig(**args)
        cfg.validate()
        r = join(cfg.device)
        try:
            s = warmstart(cfg, paths["target"], paths["prompts"], paths["out"], r)
        finally:
            leave()
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not r.main:
        return 0
    print(result_line(paths["out"], s))
    return 0


def result_line(out: str, s: dict) -> str:
    """The run's last line: what was written and the held-out accept estimate a user should expect."""
    held = (f"held-out top-1 agreement {s['heldout_top1_agreement']:.3f}, expected acceptance "
            f"{s['heldout_expected_acceptance']:.3f}, {accept_len_phrase(s['heldout'], s['accept_depth'])}"
            if s["heldout"] else "no held-out rows: no accept estimate (--holdout)")
    return (f"wrote {out}: {s['kind']} drafter, {s['sequences']} sequences / {s['tokens']} tokens, {s['steps']} steps, "
            f"loss {s['train_loss_start']:.3f} -> {s['train_loss_end']:.3f}, {s['seconds']:.0f}s; {held}")

