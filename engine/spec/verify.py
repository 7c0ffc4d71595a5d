"""Coupled verification: accept the draft child that equals the target's own sample.

The target's token at every tree node is computed with the noise-indexed sampler (same keys as
autoregressive decoding). Walking from the root, a node is *accepted* when its token equals the
target's sample at its parent and its parent was accepted; siblings carry distinct tokens, so
the accepted nodes form one path. The target's sample after the deepest accepted node is
emitted too: the *bonus* token when the path ends in an accepted leaf, the *correction* when a
node had no matching child. Every emitted token is exactly the token autoregressive decoding
would have produced, so speculation changes speed, never tokens.

Pure functions of tensors; the sampler and the model live elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.spec.tree import jump_rounds, parent_pointers


@dataclass
class Verdict:
    accepted: torch.Tensor  # [B, N] bool: nodes on the accepted path
    num_accepted: torch.Tensor  # [B]
    last_index: torch.Tensor  # [B] index in [root, nodes] of the deepest accepted entry (0 = root)
    path: torch.Tensor  # [B, N] accepted node indices in depth order, then -1
    tokens: torch.Tensor  # [B, N + 1] emitted tokens: accepted nodes, then bonus / correction
    num_emitted: torch.Tensor  # [B] = num_accepted + 1
    # Every row is a chain: path[b, :num] = 0..num-1, so [root, path] is the pass's entries in
    # order and a consumer may skip gathering by the path (the entries past num are not emitted).
    chain: bool = False


def accepted_nodes(match: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """match [B, N] (node agrees with the verifier at its parent) -> accepted [B, N].

    A node is accepted when it and all its ancestors match: an AND along the path, by pointer
    jumping (log N rounds).
    """
    B, N = match.shape
    ok = torch.cat([torch.ones(B, 1, dtype=torch.bool, device=match.device), match], 1)  # [B, 1+N], root ok
    # Nodes that do not match point to themselves: they stay rejected and stop every walk through them.
    jump = parent_pointers(parents, match)  # [B, 1+N]
    for _ in range(jump_rounds(N)):
        ok = ok & ok.gather(1, jump)
        jump = jump.gather(1, jump)
    return ok[:, 1:]


def verdict_from_accepted(accepted: torch.Tensor, tokens: torch.Tensor, next_token_at: torch.Tensor) -> Verdict:
    """accepted [B, N]; tokens [B, N] node tokens; next_token_at [B, 1+N] the token emitted
    after each entry of [root, nodes] if it is the deepest accepted one."""
    B, N = accepted.shape
    idx = torch.arange(N, device=accepted.device).expand(B, N)
    num = accepted.sum(1)
    # Topological order: accepted nodes in index order are the path in depth order.
    path = torch.where(accepted, idx, N + idx).argsort(1)
    path = torch.where(idx < num.unsqueeze(1), path, -1)
    last = torch.zeros_like(num)  # [B] entry index of the deepest accepted node, 0 = root
    if N:
        last = torch.where(num > 0, path.gather(1, (num - 1).clamp(min=0).unsqueeze(1)).squeeze(1) + 1, 0)
    out = torch.zeros(B, N + 1, dtype=torch.long, device=accepted.device)
    out[:, :N] = torch.where(path >= 0, tokens.gather(1, path.clamp(min=0)), 0)
    out.scatter_(1, num.unsqueeze(1), next_token_at.gather(1, last.unsqueeze(1)))
    return Verdict(accepted, num, last, path, out, num + 1)


def coupled_chain_verdict(tokens: torch.Tensor, valid: torch.Tensor, target: torch.Tensor) -> Verdict:
    """`coupled_verify` of chains in fewer ops: node i's parent is entry i, so it matches when it
    equals target[:, i], and the emitted tokens (the accepted nodes, then the bonus / correction)
    are target[:, :num + 1] itself. tokens, valid [B, N]; target [B, 1+N]."""
    B, N = tokens.shape
    accepted = (valid & (tokens == target[:, :N])).cumprod(1).bool()
    num = accepted.sum(1)
    idx = torch.arange(N + 1, device=tokens.device)
    out = torch.where(idx <= num.unsqueeze(1), target, 0)
    return Verdict(accepted, num, num, torch.where(accepted, idx[:N], -1), out, num + 1, chain=True)


def coupled_verify(
    tokens: torch.Tensor,  # [B, N] draft tokens
    parents: torch.Tensor,  # [B, N] parent index, -1 = root
    valid: torch.Tensor,  # [B, N] bool
    target: torch.Tensor,  # [B, 1+N] the target's sample at the root and at every node
    chain: bool = False,  # every row is a chain (DraftTree.chains): the shortcut applies
) -> Verdict:
    if chain:
        return coupled_chain_verdict(tokens, valid, target)
    at_parent = target.gather(1, parents + 1)  # [B, N] target's sample where the node's parent is
    match = valid & (tokens == at_parent)
    return verdict_from_accepted(accepted_nodes(match, parents), tokens, target)
