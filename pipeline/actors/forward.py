"""The actor's model, forward pass and micro-batching, shared by every backend.

`policy_forward` runs a Hugging Face causal LM on right-padded rows and returns token-aligned
log-probs (pipeline.records' rule: column t = log p(ids[t] | ids[:t]), column 0 is 0), the
entropy of each of those distributions, and hidden states (HF's `hidden_states` indexing:
0 = the embeddings, i = the output of decoder layer i; `hidden` is the final, post-norm one that
feeds the LM head), always detached: a loss on them cannot reach the policy. The log-probs and
entropies come out of the model's LM head itself, computed `actor.head_chunk_tokens` tokens at a
time (pipeline/actors/head.py, chunked_head.py): no [tokens, V] logits of a micro-batch exist.
`token_logprobs` / `token_entropy` are the same quantities from whole logits, for a model that
computes its logits itself (megatron's GPTModel).

`micro_batches` cuts a mini-batch into groups of rows of at most `budget` padded tokens (rows x
longest row), longest rows first; each group is trimmed to its longest row, which changes no
real token's result since rows are right-padded and attention is causal. Backends differ only
in how a micro-batch's backward and the step are done (`accumulate`'s `context` and `backward`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.actors import precision
from pipeline.actors.attention import implementation
from pipeline.actors.base import ADDITIVE_METRICS, DTYPES, ActorConfig, LogProbs, LossFn
from pipeline.actors.head import install_head, picking
from pipeline.records import TrainBatch


def load_policy(path: str | Path, cfg: ActorConfig):
    """The transformers AutoModelForCausalLM in folder `path` (the one the engine serves), in cfg.dtype,
    with cfg.attention's implementation (pipeline/actors/attention.py) and an LM head that computes
    log-probs cfg.head_chunk_tokens tokens at a time (pipeline/actors/head.py); under bf16-mixed
    precision that head computes in float32 (pipeline/actors/precision.py)."""
    from transformers import AutoModelForCausalLM

    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"actor model folder {path} has no config.json: expected a Hugging Face model folder")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[cfg.dtype], attn_implementation=implementation(cfg))
    model.config.use_cache = False
    install_head(model, cfg.head_chunk_tokens, float32=precision.resolve(cfg) == "bf16-mixed")
    if cfg.gradient_checkpointing:
        # transformers 5 renamed it; both take the checkpoint kwargs first.
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    return model


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V] (position t predicts t + 1), ids [B, T] -> [B, T] log p(ids[t] | ids[:t]), column 0 = 0."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, T-1, V]
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    return torch.nn.functional.pad(picked, (1, 0))


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V] -> [B, T] entropy of the distribution that column t's token was drawn from, column 0 = 0."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, T-1, V]
    return torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))


def policy_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, entropy: bool = False,
                   hidden: bool = False, hidden_layers: tuple[int, ...] | None = None,
                   scored: torch.Tensor | None = None) -> LogProbs:
    """One forward of `model` (an HF causal LM, or a DDP / DeepSpeed wrapper of one) on [b, T] rows.

    The model gets no padding mask: rows are right-padded and attention is causal, so no real token
    sees a pad, and the causal kernels (actor.attention's: tailspec's or SDPA's) skip the masked half
    of each score matrix where an explicit mask makes SDPA compute all of it.
    The model's head returns the log-probs and entropies (`picking`) of the tokens `scored` [b, T]
    marks (None: every real token) and 0 elsewhere, and computes nothing for the others: the update
    scores only response tokens, the tokens its loss reads. Hidden states at pads mean nothing. A
    model not loaded by `load_policy` gets that head here, with actor.head_chunk_tokens' default.
    """
    if bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
        raise ValueError("policy_forward needs right-padded rows (every row's real tokens first, then pads); "
                         "a row has a real token after a pad: build rows with pipeline.update.train_batch")
    want_states = hidden or bool(hidden_layers)
    scored = attention_mask if scored is None else scored * attention_mask
    with picking(model, input_ids, scored, entropy, ActorConfig.head_chunk_tokens):
        out = model(input_ids=input_ids, attention_mask=None, output_hidden_states=want_states, use_cache=False)
    picked = out.logits  # [b, T, 1 or 2]: log-prob (and entropy) per token, not logits (pipeline/actors/head.py)
    states = out.hidden_states if want_states else None
    return LogProbs(
        logprobs=picked[..., 0],
        entropy=picked[..., 1] if entropy else None,
        hidden=states[-1].detach() if hidden else None,
        hidden_layers={i: states[i].detach() for i in hidden_layers} if hidden_layers else None,
    )


def forward_in(model, cfg: ActorConfig) -> Callable[..., LogProbs]:
    """`policy_forward` on `model` (or a wrapper of it) in cfg's precision: under bf16 autocast for
    bf16-mixed (pipeline/actors/precision.py), as is for float32."""
    context = precision.autocast(precision.resolve(cfg), torch.device(cfg.device).type)

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw) -> LogProbs:
        with context():
            return policy_forward(model, input_ids, attention_mask, **kw)

    return forward


def micro_batches(attention_mask: torch.Tensor, budget: int) -> list[tuple[torch.Tensor, int]]:
    """attention_mask [B, T] -> [(rows [b], length)]: groups of at most budget padded tokens, longest first.

    A row longer than the budget is a micro-batch of its own.
    """
    lengths = attention_mask.sum(-1).clamp(min=1)  # [B]
    order = torch.argsort(lengths, descending=True, stable=True)
    groups: list[tuple[torch.Tensor, int]] = []
    start = 0
    for i in range(1, len(order) + 1):
        longest = int(lengths[order[start]])
        if i == len(order) or (i - start + 1) * longest > budget:
            groups.append((order[start:i], longest))
            start = i
    return groups


def trimmed(batch: TrainBatch, rows: torch.Tensor, length: int) -> TrainBatch:
    """The micro-batch of these rows, cut to its first `length` columns."""
    sub = batch.select(rows)
    cut = lambda t: None if t is None else t[:, :length]  # noqa: E731
    return TrainBatch(**{name: cut(getattr(sub, name)) for name in sub.__dataclass_fields__})


def batched_logprobs(forward: Callable[..., LogProbs], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     budget: int, **kw) -> LogProbs:
    """`forward` (policy_forward bound to a model) over token-budget micro-batches, put back as [B, T] tensors."""
    B, T = input_ids.shape
    parts = [(rows, L, forward(input_ids[rows, :L], attention_mask[rows, :L], **kw))
             for rows, L in micro_batches(attention_mask, budget)]

    def gather(get) -> torch.Tensor | None:
        first = get(parts[0][2])
        if first is None:
            return None
        full = first.new_zeros((B, T, *first.shape[2:]))
        for rows, L, part in parts:
            full[rows, :L] = get(part)
        return full

    layers = parts[0][2].hidden_layers
    return LogProbs(
        logprobs=gather(lambda p: p.logprobs),
        entropy=gather(lambda p: p.entropy),
        hidden=gather(lambda p: p.hidden),
        hidden_layers=None if layers is None else {i: gather(lambda p, i=i: p.hidden_layers[i]) for i in layers},
    )


def equal_count(groups: list[tuple[torch.Tensor, int]], n: int) -> list[tuple[torch.Tensor, int]]:
    """Splits the largest groups in halves until there are n (rows allowing); see `accumulate`."""
    groups = list(groups)
    while len(groups) < n:
        k = max(range(len(groups)), key=lambda i: len(groups[i][0]))
        rows, length = groups[k]
        if len(rows) < 2:
            break
        groups[k : k + 1] = [(rows[: len(rows) // 2], length), (rows[len(rows) // 2 :], length)]
    return groups


def accumulate(forward: Callable[..., LogProbs], batch: TrainBatch, loss_fn: LossFn, budget: int, *,
               context: Callable[[bool], contextlib.AbstractContextManager], backward: Callable[[torch.Tensor], None],
               entropy: bool = False, group=None) -> dict[str, float]:
    """Forward and backward over the micro-batches, each inside the backend's context(is_last).

    Under torch.distributed every rank of `group` (None: the default process group) runs the same number of micro-batches (the largest count
    of any rank), since ZeRO-2 / 3 reduce gradients in every backward: a rank with fewer splits
    its largest micro-batches, or runs zero-weight copies of a row when it has too few rows.
    loss_fn gets log-probs and entropies at the micro-batch's response tokens, 0 elsewhere: the
    head computes no others (policy_forward's `scored`).
    Returns train/loss (the sum of the micro-batches' losses: this rank's share of the mini-batch
    loss) and loss_fn's metrics: the additive ones (ADDITIVE_METRICS) summed over micro-batches, the
    others averaged over micro-batches weighted by their response tokens.
    """
    groups = micro_batches(batch.attention_mask, budget)
    n = len(groups)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        count = torch.tensor([n])
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        n = int(count)
    micros = [trimmed(batch, rows, length) for rows, length in equal_count(groups, n)]
    while len(micros) < n:
        micros.append(filler(micros[-1]))
    total_tokens = max(1.0, float(batch.response_mask.sum()))
    loss_sum, sums = 0.0, {}
    for k, micro in enumerate(micros):
        with context(k == n - 1):
            out = forward(micro.input_ids, micro.attention_mask, entropy=entropy, scored=micro.response_mask)
            loss, metrics = loss_fn(out.logprobs, out.entropy, micro)
            backward(loss)
        loss_sum += float(loss.detach())
        share = float(micro.response_mask.sum()) / total_tokens
        for key, value in metrics.items():
            part = float(value) if key in ADDITIVE_METRICS else (share * float(value) if share else 0.0)
            sums[key] = sums.get(key, 0.0) + part
    return {"train/loss": loss_sum, **sums}


def filler(micro: TrainBatch) -> TrainBatch:
    """One row of micro with zero loss weight and no response: a backward that adds nothing."""
    row = trimmed(micro, torch.tensor([0]), micro.input_ids.shape[1])
    row.loss_weights = torch.zeros_like(row.loss_weights)
    row.response_mask = torch.zeros_like(row.response_mask)
    return row
