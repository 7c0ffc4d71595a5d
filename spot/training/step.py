"""Training the EAGLE drafter on packed pairs: the step shared by warm-start and spot training.

`DrafterOptim` holds the optimiser and loss knobs (TLT's recipe: AdamW betas (0.9, 0.95), weight
decay 0.01 on matrices, grad clip 1.0, warmup then cosine, ce weight 0.1): the one declaration of
them; the config sections that expose them (`spot:`, the spot pool's, warm-start's) have keys of
the same names and build the record with `DrafterOptim.from_config`. `DrafterTrainer`
owns the optimiser and runs one step at a time (`step(idx, lr)`), so a caller decides when to
stop: warm-start by steps and a time budget (`train`), the spot trainer between preemption
checks. `evaluate` gives the held-out predictors of acceptance (spot.training.loss).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields

import torch

from common.optim import clip_and_step, make_adamw, set_lr, warmup_cosine
from engine.spec.config import SpecConfig
from spot.training.loss import acceptance_metrics, eagle_loss
from spot.training.pairs import PackedPairs

Reduce = Callable[[list[torch.nn.Parameter]], None]  # sets each parameter's .grad to the combined gradient


@dataclass(kw_only=True)
class DrafterOptim:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ce_weight: float = 0.1

    @classmethod
    def from_config(cls, section, where: str = "") -> DrafterOptim:
        """The knobs a config section declares under these names (a knob it lacks keeps the default
        above); ValueError naming the key (`where` + name, e.g. spot.lr) for a bad value."""
        knobs = {f.name for f in fields(cls)}
        optim = cls(**{k: v for k, v in asdict(section).items() if k in knobs})
        if not optim.lr > 0:
            raise ValueError(f"{where}lr must be > 0, got {optim.lr}")
        for key, value in asdict(optim).items():
            if key in ("warmup_steps", "weight_decay", "grad_clip", "ce_weight") and value < 0:
                raise ValueError(f"{where}{key} must be >= 0, got {value}")
        if not 0 <= optim.min_lr_ratio <= 1:
            raise ValueError(f"{where}min_lr_ratio must be in [0, 1], got {optim.min_lr_ratio}")
        return optim

    def lr_at(self, step: int, progress: float) -> float:
        """Linear warmup over warmup_steps, then cosine from lr to lr * min_lr_ratio as progress goes 0 -> 1."""
        return warmup_cosine(self.lr, step, self.warmup_steps, progress, self.min_lr_ratio)


def main_process() -> bool:
    """False on torchrun's ranks other than 0, whose warm-start lines would repeat rank 0's."""
    return os.environ.get("RANK", "0") == "0"


def log(msg: str) -> None:
    if main_process():
        print(msg, file=sys.stderr, flush=True)


def window_stream(num_windows: int, batch: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless batches of window indices: shuffled epochs, concatenated."""
    pending = torch.empty(0, dtype=torch.long)
    while True:
        while pending.numel() < batch:
            pending = torch.cat([pending, torch.randperm(num_windows, generator=generator)])
        yield pending[:batch]
        pending = pending[batch:]


def batch_loss(model, packed: PackedPairs, idx: torch.Tensor, ce_weight: float):
    """-> (loss, metrics, pred [M, F], targets [M, F]) over the loss pairs of windows idx."""
    b = packed.batch(idx).to(model.fc.weight.device, model.fc.weight.dtype)
    full = model(b.tokens, b.features, b.positions, attn_mask=b.attn_mask)  # [B, W, F]
    pred, targets = full[b.loss_mask], b.targets[b.loss_mask]  # [M, F]
    loss, metrics = pair_loss(model, pred, targets, ce_weight)
    if model.trains_fed_back:  # eagle3_vllm: one fed-back step too (engine.spec.eagle3_vllm)
        out2, valid = model.fed_back(b.tokens, b.features, full, b.positions, b.attn_mask)
        keep = b.loss_mask[:, 1:] & valid  # [B, W - 1]
        if bool(keep.any()):
            loss2, m2 = pair_loss(model, out2[keep], b.targets[:, 1:][keep], ce_weight)
            loss = loss + loss2
            metrics = metrics | {"spot/drafter_loss": loss.item(), "spot/top1_fed_back": m2["spot/top1_draft_vocab"]}
    return loss, metrics, pred, targets


def pair_loss(model, pred: torch.Tensor, targets: torch.Tensor, ce_weight: float):
    """The TLT loss of predictions [M, .] against the target's next features [M, F]."""
    goal = model.prediction_target(targets)  # [M, F] the target's f_{t+1} in the prediction's space
    with torch.no_grad():
        target_logits = model.target_logits(targets)  # [M, Vd]: the target's own head rows
    return eagle_loss(model.feature_view(pred), model.feature_view(goal), model.logits(pred), target_logits,
                      ce_weight=ce_weight)


class DrafterTrainer:
    """AdamW over an EagleModel; `step` is one optimiser step on some windows of packed pairs."""

    def __init__(self, model, optim: DrafterOptim) -> None:
        self.model, self.optim = model, optim
        self.params = list(model.parameters())
        self.opt = make_adamw(self.params, optim.lr, (0.9, 0.95), optim.weight_decay)

    def step(self, packed: PackedPairs, idx: torch.Tensor, lr: float, abort: Callable[[], bool] | None = None,
             chunk: int | None = None, keep_cut: bool = False,
             reduce: Reduce | None = None) -> tuple[float, dict[str, float]] | None:
        """One optimiser step on the loss pairs of windows idx [B], taken `chunk` windows at a time
        (all at once when None): each chunk's forward and backward in turn, the gradients summed
        weighted by the chunk's pairs, so the step is the one-batch step up to float rounding
        while the activations held are one chunk's (the working set a spot trainer shares with
        the rank still generating, and the unit it can be stopped in).

        With `abort`, asked after each chunk's forward and after its backward: when it says stop,
        no further chunk runs and the step is dropped (no weight or optimiser state changes) and
        None returned, so that a preempted job resumes to the weights of an uninterrupted one. With
        `keep_cut` (an idle window's end: the work done in the window counts) the step is instead
        taken on the chunks done, a smaller batch (a chunk stopped after its forward is dropped,
        one stopped after its backward is done), and dropped only when no chunk is done. The
        metrics are means over the step's pairs, plus `spot/cut` (1 when abort cut the step short),
        `spot/dropped_s` (the time of a dropped chunk) and `spot/step_pairs`.

        `reduce(params)`, when given, replaces the gradients with their combination across the
        processes that train together (the spot pool's members, spot.pool.elastic) before clipping and
        the optimiser step."""
        set_lr(self.opt, lr)
        chunks = list(idx.split(chunk)) if chunk is not None else [idx]
        self.model.train()
        sums: dict[str, float] = {}
        pairs, cut, dropped_s = 0, False, 0.0
        try:
            self.opt.zero_grad(set_to_none=True)
            for c in chunks:
                t = time.perf_counter()
                loss, metrics, pred, _ = batch_loss(self.model, packed, c, self.optim.ce_weight)
                if abort is not None and abort():
                    cut, dropped_s = True, time.perf_counter() - t
                    break
                m = pred.shape[0]  # the chunk's loss pairs: loss is their mean
                (loss if len(chunks) == 1 else loss * m).backward()
                pairs += m
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v * m
                if abort is not None and abort():
                    cut = True
                    break
            if not pairs or (cut and not keep_cut):
                self.opt.zero_grad(set_to_none=True)
                return None
            if len(chunks) > 1:  # sum_c m_c grad(loss_c) / sum_c m_c: the mean over the pairs done
                for p in self.params:
                    if p.grad is not None:
                        p.grad.div_(pairs)
            if reduce is not None:
                reduce(self.params)
            clip_and_step(self.opt, self.params, self.optim.grad_clip)
        finally:
            self.model.eval()
        metrics = {k: v / pairs for k, v in sums.items()}
        metrics |= {"spot/cut": float(cut), "spot/dropped_s": dropped_s, "spot/step_pairs": float(pairs)}
        return metrics["spot/drafter_loss"], metrics


    def reduced_step(self, lr: float, reduce: Reduce) -> None:
        """An optimiser step without data of its own: zero gradients go into `reduce` with the
        other processes' (a spot-pool member whose node is generating contributes nothing), and the
        combined gradients are clipped and stepped as in `step`, so every process takes the same step."""
        set_lr(self.opt, lr)
        self.opt.zero_grad(set_to_none=True)
        reduce(self.params)
        clip_and_step(self.opt, self.params, self.optim.grad_clip)


Step = Callable[["DrafterTrainer", torch.Tensor, float], tuple[float, dict[str, float]]]


def train(model, packed: PackedPairs, optim: DrafterOptim, *, steps: int, batch_windows: int, seed: int,
          seconds: float | None, log_every: int, step: Step | None = None,
          clock: Callable[[float], float] | None = None) -> dict:
    """Runs up to `steps` steps, or until `seconds` have passed; returns losses and timings. When
    time binds, the cosine schedule follows the elapsed fraction of the budget.

    Each step draws `batch_windows` of `packed`'s windows (a seeded stream) and takes
    `trainer.step(packed, idx, lr)`, or `step(trainer, idx, lr)` when given (the warm start over
    several ranks, spot.warmstart.ranks, where `packed` is the layout every rank shares and the
    data lives on the ranks); `clock(elapsed)` makes the ranks agree on the time."""
    trainer = DrafterTrainer(model, optim)
    take = step or (lambda tr, idx, lr: tr.step(packed, idx, lr))
    batches = window_stream(len(packed), min(batch_windows, len(packed)), torch.Generator().manual_seed(seed))
    losses: list[float] = []
    t0 = t_log = time.perf_counter()
    pairs = step_i = 0
    stopped_early = False
    for step_i in range(steps):
        elapsed = time.perf_counter() - t0
        if clock is not None and seconds is not None:
            elapsed = clock(elapsed)
        if seconds is not None and elapsed >= seconds and step_i > 0:
            stopped_early = True
            log(f"stopping early at step {step_i}/{steps}: the time budget is spent")
            break
        lr = optim.lr_at(step_i, max(step_i / steps, elapsed / seconds if seconds else 0.0))
        idx = next(batches)
        loss, metrics = take(trainer, idx, lr)
        losses.append(loss)
        pairs += int(packed.loss[idx].sum())
        if (step_i + 1) % log_every == 0 or step_i + 1 == steps:
            now = time.perf_counter()
            w = losses[-log_every:]
            log(f"step {step_i + 1}/{steps} loss {sum(w) / len(w):.4f} (feature {metrics['spot/feature_loss']:.4f} "
                f"ce {metrics['spot/ce_loss']:.3f}) top1 {metrics['spot/top1_draft_vocab']:.3f} lr {lr:.2e} "
                f"pairs/s {pairs / (now - t_log):.0f} elapsed {now - t0:.0f}s")
            t_log, pairs = now, 0
    else:
        step_i = steps
    k = min(10, len(losses))
    return {
        "steps": step_i, "stopped_early": stopped_early, "seconds": round(time.perf_counter() - t0, 1),
        "loss_start": sum(losses[:k]) / k, "loss_end": sum(losses[-k:]) / k, "losses": losses,
    }


def chain_expectation(p: torch.Tensor, seg: torch.Tensor, depth: int) -> torch.Tensor:
    """p [B, W] each pair's chance that its draft token is accepted (0 off the loss pairs), seg [B, W]
    the pairs' segments (a row's pairs in order of position) -> [B, W]: the expected accepted
    tokens of a `depth`-level chain drafted at each pair, sum_{k=1..depth} prod_{j<k} p[i + j]
    within i's segment (acceptances taken as independent; the chain stops where the row does)."""
    W = p.shape[1]
    run, total = torch.ones_like(p), torch.zeros_like(p)
    for k in range(min(depth, W)):
        ahead = torch.zeros_like(p)  # [B, W] p[i + k] where pair i + k is in i's segment
        same = seg[:, k:] == seg[:, : W - k]
        ahead[:, : W - k] = torch.where(same, p[:, k:], 0.0)
        run = run * ahead
        total += run
    return total


EVAL_SUMS = ("loss", "top1_agreement", "expected_acceptance", "accept_len", "accept_len_greedy")


@torch.no_grad()
def evaluate_sums(model, packed: PackedPairs, ce_weight: float, depth: int) -> dict[str, float]:
    """EVAL_SUMS summed over the loss pairs of `packed` (their means' numerators), and `pairs`:
    what ranks add up (spot.warmstart.ranks). `accept_len`: 1 + the expected accepted tokens of a
    depth-`depth` chain drafted at each pair at T = 1 (from the per-pair expected acceptance),
    `accept_len_greedy` the same from top-1 agreement; both teacher-forced (deeper levels see the
    target's features, not the drafter's own), so they estimate from above."""
    W_full = model.target.lm_head.weight.detach()  # [V, H]
    H = model.config.hidden_size
    sums = dict.fromkeys(EVAL_SUMS, 0.0)
    total = 0
    for w in range(len(packed)):  # one window at a time: [M, V] full-vocabulary logits are large
        idx = torch.tensor([w])
        loss, _, pred, targets = batch_loss(model, packed, idx, ce_weight)
        M = pred.shape[0]
        target_logits = targets[:, -H:] @ W_full.t()  # [M, V]
        draft_logits = model.logits(pred)  # [M, Vd]
        accept, acc = acceptance_metrics(draft_logits, target_logits, model.vocab_ids)
        ids = draft_logits.argmax(-1)
        top1 = ((model.vocab_ids[ids] if model.vocab_ids is not None else ids) == target_logits.argmax(-1)).float()
        mask, seg = packed.loss[idx], packed.seg[idx]  # [1, W]
        for key, p in (("accept_len", accept), ("accept_len_greedy", top1)):
            grid = torch.zeros(mask.shape, dtype=torch.float32)
            grid[mask] = p.float().cpu()
            sums[key] += float((1 + chain_expectation(grid, seg, depth))[mask].sum())
        sums["loss"] += loss.item() * M
        sums["top1_agreement"] += acc["spot/top1_agreement"] * M
        sums["expected_acceptance"] += acc["spot/expected_acceptance"] * M
        total += M
    return sums | {"pairs": total}


def means(sums: dict[str, float]) -> dict:
    """evaluate_sums' (or their sum over ranks') means over the pairs, rounded."""
    return {k: round(sums[k] / sums["pairs"], 4) for k in EVAL_SUMS} | {"pairs": int(sums["pairs"])}


def evaluate(model, packed: PackedPairs, ce_weight: float, depth: int = SpecConfig.depth) -> dict:
    """Held-out loss, top-1 agreement, expected acceptance at T = 1 and the chain accept-length
    estimates (evaluate_sums), means over the pairs."""
    return means(evaluate_sums(model, packed, ce_weight, depth))
