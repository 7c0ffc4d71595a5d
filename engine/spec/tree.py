"""DraftTree: a ragged batch of draft trees, and the pure functions that verification needs.

A row's tree is a list of nodes in topological order (a parent precedes its children); node i
holds a candidate token and the index of its parent within the row (-1: the root). A chain is a
tree whose node i has parent i - 1. The record is ragged (flat tensors plus per-row offsets, as
vLLM's spec-decode metadata); `padded()` lays it out as [B, N] for a batched verify pass.

Verification runs the target on [root, node_0, ..., node_{N-1}] per row. Root and nodes occupy
cache slots L, L+1, ..., L+N (L = the row's committed length) and RoPE positions L + depth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch


@dataclass
class PaddedTree:
    tokens: torch.Tensor  # [B, N] candidate tokens (0 where invalid)
    parents: torch.Tensor  # [B, N] parent node index, -1 = root (-1 where invalid)
    depth: torch.Tensor  # [B, N] 1-based depth (0 where invalid)
    valid: torch.Tensor  # [B, N] bool
    q_logits: torch.Tensor | None  # [B, N, V] drafter logits each node was drawn from, or None
    chain: bool = False  # every row is a chain: the plain causal mask is the tree mask

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def cut_chains(self, limit: torch.Tensor) -> PaddedTree:
        """Chains only: row b keeps its first limit[b] nodes ([B]); the width shrinks to the longest kept."""
        assert self.chain, "cut_chains cuts chains (node i at depth i + 1)"
        keep = self.valid & (torch.arange(self.width, device=limit.device) < limit.unsqueeze(1))  # [B, N]
        W = int(keep.sum(1).max()) if keep.numel() else 0
        keep = keep[:, :W]
        q = None if self.q_logits is None else torch.where(keep.unsqueeze(-1), self.q_logits[:, :W], 0.0)
        return PaddedTree(torch.where(keep, self.tokens[:, :W], 0), torch.where(keep, self.parents[:, :W], -1),
                          torch.where(keep, self.depth[:, :W], 0), keep, q, True)


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [T] all rows' nodes, row-major
    parents: torch.Tensor  # [T] parent index within the row, -1 = root
    offsets: torch.Tensor  # [B + 1] row b's nodes are [offsets[b], offsets[b+1])
    # For `rejection` verification: the drafter's (masked, temperature-scaled) logits of the
    # distribution each node was drawn from, i.e. the drafter at the node's parent. [T, V]
    q_logits: torch.Tensor | None = None
    chain: bool = False  # built by `chains`: node i's parent is i - 1 in every row
    source: torch.Tensor | None = None  # [B] which drafter of a composition drafted each row (compose)
    # The padded layout, when the builder had it (`chains`): `padded()` returns it instead of
    # rebuilding it from the flat nodes (a dozen ops a decode step).
    layout: PaddedTree | None = field(default=None, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_nodes(self) -> torch.Tensor:  # [B]
        return self.offsets[1:] - self.offsets[:-1]

    @classmethod
    def empty(cls, batch: int, device="cpu") -> DraftTree:
        z = torch.zeros(0, dtype=torch.long, device=device)
        return cls(z, z.clone(), torch.zeros(batch + 1, dtype=torch.long, device=device))

    @classmethod
    def from_padded(cls, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
                    q_logits: torch.Tensor | None = None) -> DraftTree:
        """tokens, parents, valid [B, N]; each row's valid nodes must come first."""
        counts = valid.sum(1)
        offsets = torch.zeros(valid.shape[0] + 1, dtype=torch.long, device=valid.device)
        offsets[1:] = counts.cumsum(0)
        return cls(tokens[valid], parents[valid], offsets, None if q_logits is None else q_logits[valid])

    @classmethod
    def chains(cls, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> DraftTree:
        """tokens [B, D] linear drafts; lengths [B] how many of each row's D are real (default D)."""
        B, D = tokens.shape
        N = int(lengths.max()) if lengths is not None and B else D
        tokens = tokens[:, :N]
        idx = torch.arange(N, device=tokens.device).expand(B, N)
        if lengths is None:
            parents, depth, valid, flat_parents, offsets = _full_chains(B, N, tokens.device)
            tree = cls(tokens.reshape(-1), flat_parents, offsets, chain=True)
            tree.layout = PaddedTree(tokens, parents, depth, valid, None, True)
            return tree
        valid = idx < lengths.unsqueeze(1)
        tree = cls.from_padded(tokens, idx - 1, valid)
        tree.chain = True
        tree.layout = PaddedTree(torch.where(valid, tokens, 0), torch.where(valid, idx - 1, -1), torch.where(valid, idx + 1, 0),
                                 valid, None, True)
        return tree

    @classmethod
    def make_dummy(cls, batch: int = 3, vocab: int = 50, seed: int = 0) -> DraftTree:
        """A small random batch of valid trees with ragged sizes (for tests)."""
        g = torch.Generator().manual_seed(seed)
        tokens, parents, offsets = [], [], [0]
        for b in range(batch):
            n = b + 2
            tokens += torch.randperm(vocab, generator=g)[:n].tolist()
            parents += [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]
            offsets.append(offsets[-1] + n)
        return cls(torch.tensor(tokens), torch.tensor(parents), torch.tensor(offsets))

    def padded(self, width: int | None = None) -> PaddedTree:
        if self.layout is not None and width in (None, self.layout.width):
            return self.layout
        B = self.batch_size
        counts = self.num_nodes
        N = int(counts.max()) if width is None and B and self.tokens.numel() else (width or 0)
        device = self.tokens.device
        idx = torch.arange(N, device=device).expand(B, N)
        valid = idx < counts.unsqueeze(1)
        flat = (self.offsets[:-1].unsqueeze(1) + idx).clamp(max=max(self.tokens.numel() - 1, 0))
        if self.tokens.numel() == 0:
            tokens = torch.zeros(B, N, dtype=torch.long, device=device)
            parents = torch.full((B, N), -1, dtype=torch.long, device=device)
        else:
            tokens = torch.where(valid, self.tokens[flat], 0)
            parents = torch.where(valid, self.parents[flat], -1)
        q = None
        if self.q_logits is not None and self.tokens.numel():
            q = torch.where(valid.unsqueeze(-1), self.q_logits[flat], 0.0)
        depth = torch.where(valid, idx + 1, 0) if self.chain else node_depths(parents, valid)
        return PaddedTree(tokens, parents, depth, valid, q, self.chain)


def jump_rounds(n: int) -> int:
    """Pointer-jumping rounds that cover paths of up to n edges."""
    return max(1, (n).bit_length())


def parent_pointers(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, N] -> [B, 1+N] index of each entry's parent in [root, nodes]; root and padding point to themselves."""
    B, N = parents.shape
    own = torch.arange(N + 1, device=parents.device).expand(B, N + 1)
    return torch.cat([own[:, :1], torch.where(valid, parents + 1, own[:, 1:])], 1)


@lru_cache(maxsize=64)
def _full_chains(B: int, N: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The fixed part of B full chains of N nodes (parents, depth, valid [B, N]; flat parents
    [B*N]; offsets [B + 1]), built once per shape: a chain draft's every step has the same.
    Shared read-only by the trees built from it (nothing writes a tree's layout in place)."""
    idx = torch.arange(N, device=device).expand(B, N)
    parents = idx - 1
    return (parents, idx + 1, torch.ones(B, N, dtype=torch.bool, device=device), parents.reshape(-1),
            torch.arange(B + 1, device=device) * N)


def node_depths(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """parents [B, N] (-1 = root) -> 1-based depth [B, N], 0 where invalid (list ranking)."""
    B, N = parents.shape
    jump = parent_pointers(parents, valid)  # [B, 1+N]
    depth = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=parents.device), valid.long()], 1)
    for _ in range(jump_rounds(N)):  # after r rounds, depth counts up to 2^r edges
        depth = depth + depth.gather(1, jump)
        jump = jump.gather(1, jump)
    return depth[:, 1:]


def ancestors(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, N] -> [B, 1+N, 1+N] bool: entry (i, j) is True when j is i or an ancestor of i.

    Index 0 is the root; node n is index n + 1. Invalid nodes see only themselves.
    """
    B, N = parents.shape
    eye = torch.eye(N + 1, device=parents.device).expand(B, N + 1, N + 1)
    step = eye + torch.zeros_like(eye).scatter(2, parent_pointers(parents, valid).unsqueeze(-1), 1.0)  # self and parent
    anc = step.clamp(max=1)
    for _ in range(jump_rounds(N)):  # paths double in length each round
        anc = (anc @ anc).clamp(max=1)
    return anc > 0


def tree_mask(parents: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor, visible: int) -> torch.Tensor:
    """Attention mask for a verify pass over [root, nodes]: [B, 1+N, visible] bool.

    A query sees the row's committed slots (< L) and, among slots L..L+N, itself and its
    ancestors. lengths [B] are the committed lengths L.
    """
    anc = ancestors(parents, valid)  # [B, 1+N, 1+N]
    N1 = anc.shape[1]
    rel = torch.arange(visible, device=lengths.device) - lengths.unsqueeze(1)  # [B, S]
    in_tree = (rel >= 0) & (rel < N1)
    tree_part = anc.gather(2, rel.clamp(0, N1 - 1).unsqueeze(1).expand(-1, N1, -1))  # [B, 1+N, S]
    return (rel < 0).unsqueeze(1) | (in_tree.unsqueeze(1) & tree_part)


def tree_positions(depth: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE positions and cache slots of [root, nodes]: both [B, 1+N]."""
    B, N = depth.shape
    pos = lengths.unsqueeze(1) + torch.cat([torch.zeros(B, 1, dtype=torch.long, device=depth.device), depth], 1)
    slots = lengths.unsqueeze(1) + torch.arange(N + 1, device=depth.device)
    return pos, slots
