"""Greedy exact-answer accuracy of a model on a list of problems.

A deliberately plain greedy decoder over the engine's `Transformer` and `KVCache`, used to check
a pretrained model (and as a reference that the engine's decoder must agree with). Prompts are
right-padded and prefilled together; each decode step feeds every unfinished row its last token
at its own position, and finished rows are compacted away so the work shrinks with the batch.
No sampling, no speculation, no batching policy beyond "all problems at once".

Prompt encoding follows `pipeline.tasks.tokenizer`: [bos] + chars(prompt); a response ends at
`<eos>` (not part of the decoded text) or after `max_new_tokens`.
"""

from __future__ import annotations

import torch

from engine.kv_cache import KVCache
from engine.model import Transformer, causal_mask
from pipeline.tasks.arith import Problem, reward


@torch.no_grad()
def greedy_generate(model: Transformer, prompts: list[list[int]], eos_id: int, max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of token-id prompts, each cut at (and without) `eos_id`."""
    cfg, device = model.config, model.device
    B = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # [B]
    max_len = min(int(lengths.max()) + max_new_tokens, cfg.max_position_embeddings)
    if int(lengths.max()) >= max_len:
        raise ValueError(f"a prompt of {int(lengths.max())} tokens leaves no room in a context of {max_len}")
    cache = KVCache.for_model(cfg, B, max_len, model.dtype, device)
    ids = torch.full((B, int(lengths.max())), eos_id, dtype=torch.long, device=device)  # [B, P]
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    positions = torch.arange(ids.shape[1], device=device).expand(B, -1)  # [B, P]
    logits = model(ids, positions, cache=cache).logits  # [B, P, V]
    next_tok = logits[torch.arange(B), lengths - 1].argmax(-1)  # [B]
    cache.lengths[:B] = lengths

    outputs: list[list[int]] = [[] for _ in range(B)]
    rows = list(range(B))  # rows[slot] = index of the prompt decoded in that cache slot
    for _ in range(max_new_tokens):
        done = []
        for row, tok, length in zip(rows, next_tok.tolist(), cache.lengths.tolist()):
            done.append(tok == eos_id or length >= max_len)
            if tok != eos_id:
                outputs[row].append(tok)
        keep = [slot for slot, d in enumerate(done) if not d]
        if not keep:
            break
        n = len(keep)
        if keep != list(range(n)):
            cache.move_rows(torch.tensor(keep, device=device), torch.arange(n, device=device))
        rows = [rows[s] for s in keep]
        slots = cache.lengths[:n].unsqueeze(1).clone()  # [n, 1] each row's next position
        tokens = next_tok[keep].unsqueeze(1)  # [n, 1]
        mask = causal_mask(slots, length=int(slots.max()) + 1)  # [n, 1, S]
        logits = model(tokens, slots, cache=cache, attn_mask=mask).logits  # [n, 1, V]
        cache.lengths[:n] += 1
        next_tok = logits[:, -1].argmax(-1)  # [n]
    return outputs


def evaluate(model: Transformer, tokenizer, problems: list[Problem], max_new_tokens: int = 384) -> float:
    """Fraction of problems whose greedy response has exactly the right final answer."""
    if not problems:
        raise ValueError("evaluate needs at least one problem")
    was_training = model.training
    model.eval()
    prompts = [tokenizer(p.prompt).input_ids for p in problems]
    outputs = greedy_generate(model, prompts, tokenizer.eos_token_id, max_new_tokens)
    model.train(was_training)
    texts = tokenizer.batch_decode(outputs)
    return sum(reward(t, p.answer) for t, p in zip(texts, problems)) / len(problems)
