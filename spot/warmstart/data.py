"""Warm-start data: the target's own responses, their features, and a draft vocabulary.

1. generate: the target samples `n` responses per prompt (RolloutEngine, no speculation, its
   eos as stop token), prompts given as token ids (`encode_prompts`: text, or with `chat` the
   user turn of the tokenizer's chat template; launch.warmstart: as the RL run renders them);
2. features: one teacher-forced forward per prompt + response gives the target's features
   (spot.training.features) as HiddenStateRows;
3. draft vocabulary: the most frequent ids of that text (spot.warmstart.draft_vocab), or the full one.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from engine.checkpoint import parse_dtype
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.model import Transformer
from engine.sampling import SamplingParams
from engine.spec.eagle import EagleConfig
from engine.types import FinishReason, Request
from common.text import encode, stop_tokens
from spot.warmstart.draft_vocab import default_size, most_frequent
from spot.training.step import log, main_process
from spot.training.features import TokenSequence, capture_features
from spot.training.records import RowStore


def progress_bar(total: int, desc: str, unit: str) -> tqdm:
    """A tqdm bar on stderr (rank 0's only); redirected to a file it updates every 30 s instead of flooding it."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, mininterval=1 if sys.stderr.isatty() else 30,
                disable=not main_process())


@dataclass(frozen=True)
class Prompt:
    """A prompt as the target sees it: its id (which keys the sampling noise) and its token ids."""

    id: str
    tokens: list[int]


def encode_prompts(tokenizer, rows: list[dict], chat: bool) -> list[Prompt]:
    """`{"id", "prompt"}` rows (common.text.read_prompts) as Prompts; `chat`: the user turn of the chat template."""
    return [Prompt(str(r["id"]), encode(tokenizer, r["prompt"], chat)) for r in rows]


def generate(engine: RolloutEngine, tokenizer, prompts: list[Prompt], cfg) -> tuple[list[TokenSequence], dict]:
    """The target's own responses: n per prompt; -> sequences (prompt + response) and generation stats."""
    requests = [Request(prompt_id=p.id, prompt=p.tokens, n=cfg.n) for p in prompts]
    stops = stop_tokens(engine.model.config, tokenizer)
    if not stops:
        log("warning: the target has no eos token id: every response runs to --max-new-tokens")
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                            top_p=cfg.top_p, stop_token_ids=stops, seed=cfg.seed)
    bar = progress_bar(len(requests) * cfg.n, "generate", "seq")
    batch = engine.generate(requests, params, progress=lambda done: bar.update(done - bar.n))
    bar.close()
    prompt_of = {r.prompt_id: r.prompt for r in requests}
    seqs = [TokenSequence(ro.prompt_id, ro.sample, prompt_of[ro.prompt_id] + ro.tokens, ro.prompt_tokens) for ro in batch]
    s = batch.stats
    stats = {
        "seconds": round(s.wall_s, 1), "response_tokens": s.new_tokens, "tokens_per_s": round(s.tokens_per_s, 1),
        "stopped": sum(ro.finish_reason == FinishReason.STOP for ro in batch),
        "truncated": sum(ro.finish_reason == FinishReason.LENGTH for ro in batch),
    }
    log(f"generated {len(seqs)} responses, {s.new_tokens} tokens in {s.wall_s:.1f}s ({s.tokens_per_s:.0f} tok/s), "
        f"{stats['truncated']} cut at --max-new-tokens")
    return seqs, stats


def collect_rows(target: Transformer, tokenizer, prompts: list[Prompt], cfg, longest: int) -> tuple[RowStore, dict]:
    """Steps 1-2: the target's responses, then its features over prompt + response (both through
    the engine's runtime: packed layers, compiled kernels). `longest`: the longest prompt of the
    whole run in tokens (every rank's engine is then the same shape)."""
    engine = RolloutEngine(target, EngineConfig(max_batch=cfg.max_batch, max_len=longest + cfg.max_new_tokens, threads=cfg.threads,
                                                device=str(target.device)))
    seqs, gen_stats = generate(engine, tokenizer, prompts, cfg)
    t0 = time.perf_counter()
    aux_layers = EagleConfig.for_target(target.config, cfg.kind).aux_layers
    bar = progress_bar(sum(len(s.tokens) for s in seqs), "features", "tok")
    rows = RowStore(capture_features(engine.runtime, seqs, aux_layers, batch_tokens=cfg.feature_batch_tokens,
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
