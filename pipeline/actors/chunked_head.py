"""Log-probs and entropies through the LM head, a chunk of tokens at a time (pure math).

`chunked_token_logprobs(hidden [N, H], weight [V, H], targets [N])` gives, for every token n,
log p(targets[n]) and optionally the entropy of p, where p = softmax(hidden[n] @ weight.T), the
distribution the LM head's logits define. It computes what `log_softmax(hidden @ weight.T)` followed
by a gather gives, without ever holding the [N, V] logits: the tokens are cut into chunks of
`chunk_tokens`, and only one chunk's [chunk, V] logits (and, in the backward, their gradient) exist
at a time. A policy's head over a 152k vocabulary and 32k tokens would otherwise hold ~20 GB of
float32 logits, as much again for their log-softmax, and their gradients in the backward.

The forward keeps only its inputs and two numbers per token (the log-sum-exp, the entropy); the
backward recomputes each chunk's logits and applies the closed forms of the gradients with respect
to the logits z (p = softmax(z), y the target, H the entropy, E[z] = sum_j p_j z_j = lse - H):

    d log p_y / d z_j = [j = y] - p_j
    d H / d z_j       = -p_j (z_j - E[z])

then the chunk's gradient reaches the hidden states (grad_z @ weight) and the weight (grad_z.T @
hidden, summed over chunks in float32). This is the shape of Liger-Kernel's fused linear
cross-entropy and of verl's fused PPO head, with the loss left outside: the caller's loss gives
any gradient per token of the log-probs and entropies.

Precision: `float32=True` computes the head's product in float32 whatever the inputs' dtype (the
bf16-mixed actor's rule, pipeline/actors/precision.py); otherwise in the weight's dtype, the
logits then cast to float32, as a plain `nn.Linear` head followed by `.float()` does. Log-softmax,
entropy and the gradients with respect to the logits are float32 either way; autocast is off
inside, so the product's dtype is this rule's and not the caller's context.

What it does not know: models, padding, token alignment, distributed wrappers (pipeline/actors/head.py).
"""

from __future__ import annotations

import torch


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[c, H] x [V, H] (same dtype) -> [c, V] logits in float32 (float64 for float64 inputs)."""
    return (hidden @ weight.T).to(_wide(hidden.dtype))


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the logits' softmax and of the results: float32, or float64 for float64 inputs (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


class ChunkedHead(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) -> (log-probs [N], entropies [N]) in float32.

    When `with_entropy` is false the entropies are zeros and their gradient is ignored.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                with_entropy: bool, float32: bool) -> tuple[torch.Tensor, torch.Tensor]:
        device = hidden.device.type
        dtype = torch.float32 if float32 else weight.dtype
        with torch.autocast(device, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            N = h.shape[0]
            logprobs = torch.empty(N, dtype=_wide(dtype), device=hidden.device)  # [N]
            lse = torch.empty_like(logprobs)  # [N]
            entropy = torch.zeros_like(logprobs)  # [N]
            for s in range(0, N, chunk_tokens):
                e = min(N, s + chunk_tokens)
                z = _logits(h[s:e], w)  # [c, V]
                lse[s:e] = torch.logsumexp(z, dim=-1)
                logprobs[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
                if with_entropy:
                    # H = lse - sum_j p_j z_j
                    entropy[s:e] = lse[s:e] - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.chunk_tokens, ctx.with_entropy, ctx.dtype = chunk_tokens, with_entropy, dtype
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype, c = ctx.dtype, ctx.chunk_tokens
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            N = h.shape[0]
            grad_hidden = torch.empty_like(h) if want_hidden else None  # [N, H]
            # The weight's gradient is a sum over every chunk: float32, whatever the product's dtype.
            grad_weight = torch.zeros(w.shape, dtype=_wide(dtype), device=w.device) if want_weight else None  # [V, H]
            for s in range(0, N, c):
                e = min(N, s + c)
                rows = torch.arange(e - s, device=h.device)
                z = _logits(h[s:e], w)  # [c, V]
                p = (z - lse[s:e, None]).exp_()  # [c, V] softmax
                g_lp = grad_logprobs[s:e, None]  # [c, 1]
                if ctx.with_entropy:
                    mean_z = (lse[s:e] - entropy[s:e])[:, None]  # [c, 1] E[z]
                    grad_z = z.sub_(mean_z).mul_(p).mul_(-grad_entropy[s:e, None])  # -g_H p (z - E[z]), in z's storage
                    grad_z.addcmul_(p, g_lp, value=-1.0)
                else:
                    grad_z = p.mul_(-g_lp)
                grad_z[rows, targets[s:e]] += grad_logprobs[s:e]  # the [j = y] term
                grad_z = grad_z.to(dtype)
                if want_hidden:
                    grad_hidden[s:e] = grad_z @ w
                if want_weight:
                    if dtype == grad_weight.dtype:
                        grad_weight.addmm_(grad_z.T, h[s:e])
                    else:
                        grad_weight += grad_z.T @ h[s:e]
        grad_hidden = None if grad_hidden is None else grad_hidden.to(hidden.dtype)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_tokens: int,
                           entropy: bool = False, float32: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [N, H], weight [V, H], targets [N] -> (log p(targets) [N], entropy [N] or None), float32.

    Differentiable in hidden and weight; at most `chunk_tokens` tokens' logits exist at once.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"chunked_token_logprobs needs hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"chunked_token_logprobs needs one target per hidden row: targets {tuple(targets.shape)}, "
                         f"hidden {tuple(hidden.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    logprobs, ent = ChunkedHead.apply(hidden, weight, targets, chunk_tokens, entropy, float32)
    return logprobs, ent if entropy else None
