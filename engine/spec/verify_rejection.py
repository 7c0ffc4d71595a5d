"""Rejection verification: speculative sampling that is lossless in distribution.

The alternative to coupled verification (verify.py) for drafters that provide the distribution
they drew from, or that propose deterministically. Its tokens are not those autoregressive
decoding would produce with the same noise keys, but they have the same distribution; its
randomness is still explicit and keyed, so the same inputs give the same verdict.

Vocabulary (as in vLLM's `rejection_sampler.py`), at an entry of [root, nodes] with target
distribution p (the masked, temperature-scaled softmax of `p_logits` there):

- *accepted* token: a child's token x, drafted from q, kept with probability min(1, p(x) / q(x)).
- *recovered* token: emitted when every child of the deepest accepted entry was rejected; drawn
  from the residual norm(max(p - q, 0)): exactly the mass the drafter under-proposed.
- *bonus* token: emitted when the deepest accepted entry has no children; drawn from p.

A verify step emits the accepted path, then one recovered or bonus token.

Chains are Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding".
Trees use multi-candidate (recursive) rejection sampling, as in Miao et al. 2024, "SpecInfer":
the children c_1..c_k of an entry are tried in index order, each against the residual that the
previous ones left:

    p_1 = p;  accept c_j w.p. min(1, p_j(c_j) / q_j(c_j));  else p_{j+1} = norm(max(p_j - q_j, 0))

and if all are rejected the recovered token is drawn from p_{k+1}. An accepted child restarts
the walk with the target's distribution at that child. Each try is one Leviathan step whose
fallback (the later tries) samples from p_{j+1}, so the walk samples from p exactly.

Requirement: each child c_j is drawn from its q_j independently of its earlier siblings and of
this module's noise. The usual case: siblings i.i.d. from the drafter's distribution at their
parent (duplicates allowed; the engine's rejection-mode tree builder draws them so). Top-k
siblings, or coupled mode's noise-matched first child, break this: verify those coupled.
A deterministic drafter (`q_logits` None, e.g. n-gram) proposes point masses, q_j = delta(c_j):
accept w.p. p_j(c_j), and the residual is p_j without c_j. That is lossless for any drafts fixed
before verification; siblings should be distinct (a rejected token is never accepted again).

Temperature 0 is not this module's job: the target is then a point mass, and coupled
verification (accept the child equal to the argmax) is exact and cheaper; the engine uses it.

Noise: the coin of node n is `uniform(derive_keys(key, COIN_SALT), position of its parent, id n)`;
the recovered / bonus token after entry e is the Gumbel-max of log(residual) with
`gumbel(derive_keys(key, SAMPLE_SALT), positions[e])`. The positions a row uses grow strictly
from one verify step to the next, so no draw is reused, and a row's verdict does not depend on
the other rows of its batch.

Pure functions of tensors; the model and the drafter live elsewhere.
"""

from __future__ import annotations

import torch

from engine.sampling import derive_keys, gumbel, uniform
from engine.spec.tree import PaddedTree
from engine.spec.verify import Verdict, verdict_from_accepted

COIN_SALT = 0x7A11_C014  # stream of accept / reject coins
SAMPLE_SALT = 0x7A11_5A3B  # stream of Gumbel noise for recovered and bonus tokens


def rejection_verify(
    tree: PaddedTree,  # tokens, parents, valid [B, N]; q_logits [B, N, V] or None (point masses)
    p_logits: torch.Tensor,  # [B, 1+N, V] target's masked, temperature-scaled logits at [root, nodes]
    keys: torch.Tensor,  # [B] row noise keys
    positions: torch.Tensor,  # [B, 1+N] noise position of the token sampled after each entry
) -> Verdict:
    """Walks each row's tree from the root, trying the children of the current entry in index
    order (topological order puts an entry's children after it); returns the accepted path and
    the recovered or bonus token after it."""
    _check_inputs(tree, p_logits, keys, positions)
    B, N = tree.tokens.shape
    V = p_logits.shape[-1]
    coin_keys = derive_keys(keys, COIN_SALT)
    parent_pos = positions.gather(1, tree.parents + 1)  # [B, N] position each node's token sits at
    cur = torch.zeros(B, dtype=torch.long, device=keys.device)  # [B] deepest accepted entry
    resid = p_logits[:, 0].float().softmax(-1)  # [B, V] p at cur, less the rejected children's q
    accepted = torch.zeros(B, N, dtype=torch.bool, device=keys.device)
    for n in range(N):
        tried = tree.valid[:, n] & (tree.parents[:, n] + 1 == cur)  # [B]
        q = _proposal(tree, n, V)  # [B, V]
        x = tree.tokens[:, n : n + 1]  # [B, 1]
        coin = uniform(coin_keys, parent_pos[:, n], torch.tensor([n], device=keys.device))[:, 0]  # [B]
        # u < p/q without the division: q(x) > 0 for a drawn x, and p(x) = 0 never accepts.
        ok = tried & (coin * q.gather(1, x)[:, 0] < resid.gather(1, x)[:, 0])
        rejected = tried & ~ok
        accepted[:, n] = ok
        cur = torch.where(ok, n + 1, cur)
        at_child = p_logits[:, n + 1].float().softmax(-1)
        resid = torch.where(ok[:, None], at_child, torch.where(rejected[:, None], residual(resid, q), resid))
    token = sample_from(resid, derive_keys(keys, SAMPLE_SALT), positions.gather(1, cur[:, None])[:, 0])
    # Only the entry that ends the path has a token to emit; the rest are never read.
    next_token_at = torch.full((B, N + 1), -1, dtype=torch.long, device=keys.device)
    next_token_at.scatter_(1, cur[:, None], token[:, None])
    return verdict_from_accepted(accepted, tree.tokens, next_token_at)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p, q [B, V] probabilities -> norm(max(p - q, 0)) [B, V].

    Where that is empty (p <= q everywhere) rejection had probability 0; p is kept so that
    a rounding-error rejection still samples from something sensible.
    """
    r = (p - q).clamp(min=0)
    mass = r.sum(-1, keepdim=True)  # [B, 1]
    return torch.where(mass > 0, r / mass, p)


def sample_from(probs: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """probs [B, V] -> [B] tokens by Gumbel-max over log(probs) with keyed noise at positions [B]."""
    return (probs.log() + gumbel(keys, positions, probs.shape[-1])).argmax(-1)


def _proposal(tree: PaddedTree, n: int, V: int) -> torch.Tensor:
    """[B, V] the distribution node n was drawn from: the drafter's, or a point mass on its token.

    Rows where node n is padding may hold NaN (`DraftTree.padded` scales -inf logits by 0);
    the caller never lets them through.
    """
    if tree.q_logits is not None:
        return tree.q_logits[:, n].float().softmax(-1)
    B = tree.tokens.shape[0]
    point = torch.zeros(B, V, device=tree.tokens.device)
    return point.scatter_(1, tree.tokens[:, n : n + 1], 1.0)


def _check_inputs(tree: PaddedTree, p_logits: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> None:
    B, N = tree.tokens.shape
    if p_logits.dim() != 3 or tuple(p_logits.shape[:2]) != (B, N + 1):
        raise ValueError(f"p_logits must be [B, 1+N, V] = [{B}, {N + 1}, V] (root then the tree's "
                         f"{N} nodes), got {list(p_logits.shape)}")
    if tuple(positions.shape) != (B, N + 1):
        raise ValueError(f"positions must be [B, 1+N] = [{B}, {N + 1}], got {list(positions.shape)}")
    if tuple(keys.shape) != (B,):
        raise ValueError(f"keys must be [B] = [{B}], got {list(keys.shape)}")
    if tree.q_logits is not None and tuple(tree.q_logits.shape) != (B, N, p_logits.shape[-1]):
        raise ValueError(f"tree.q_logits must be [B, N, V] = [{B}, {N}, {p_logits.shape[-1]}], "
                         f"got {list(tree.q_logits.shape)}")
