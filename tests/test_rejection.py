"""Rejection verification is lossless in distribution (engine/spec/verify_rejection.py).

A synthetic Markov language over V = 6 tokens: the target emits x1 ~ P[START], then
x_{t+1} ~ P[x_t]; the drafter proposes from Q, which differs from P (it has mass where P has
none and none where P has some). Draft trees are sampled from Q with a seeded torch.Generator
(siblings i.i.d., as the requirement says; distinct for point-mass drafts), laid out through
`DraftTree.padded` as the engine does, and verified for 40,000 rows in one batched call, each
row with its own key. Everything is seeded, so each test gives the same result every run.

"The first two emitted tokens": a verify step emits its accepted path, then one recovered or
bonus token. A row whose first step emitted one token only (every first-level child rejected)
takes its second token from the next verify step, as the engine would: a fresh draft rooted at
x1, with positions advanced by what was emitted. So the check covers the step boundary too.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from engine.sampling import row_keys
from engine.spec.tree import DraftTree, PaddedTree
from engine.spec.verify_rejection import rejection_verify


@pytest.fixture(autouse=True)
def one_thread():
    """40,000-row verifications are faster on one thread than on two spinning ones on a shared
    machine; the previous thread count is restored after each test."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


V, START = 6, 6  # tokens 0..5; state 6 is the start of the response


def _markov(base: list[float], shift: int) -> torch.Tensor:
    """[V + 1, V] next-token table: row s is `base` rotated by shift * s (row START included)."""
    b = torch.tensor(base, dtype=torch.float64)
    return torch.stack([b.roll(shift * s) for s in range(V + 1)])


P = _markov([0.35, 0.25, 0.15, 0.15, 0.10, 0.0], 1)  # target
Q = _markov([0.10, 0.15, 0.0, 0.25, 0.25, 0.25], 2)  # drafter: differs, zeros in other places
Q_FAR = _markov([0.02, 0.02, 0.02, 0.04, 0.45, 0.45], 1)  # mass on the target's unlikely tokens
CHAIN2 = [(1, 1), (1, 1)]  # children per node at each depth: (min, max), drawn per node per row
TREE = [(2, 3), (1, 2)]


def draft(q: torch.Tensor, states: torch.Tensor, widths, gen, *, point_mass=False) -> tuple[PaddedTree, torch.Tensor]:
    """Draft trees under states [B] and the target's logits at [root, nodes] (NaN on padding)."""
    B = states.numel()
    tokens, parents, valid, q_state = [], [], [], []  # one [B] tensor (or int) per node, BFS order
    frontier = [(-1, states, torch.ones(B, dtype=torch.bool))]
    for lo, hi in widths:
        nxt = []
        for parent, state, ok in frontier:
            count = torch.randint(lo, hi + 1, (B,), generator=gen)
            probs = q[state] + (1e-3 if point_mass else 0.0)  # distinct point masses need support
            kids = torch.multinomial(probs, hi, replacement=not point_mass, generator=gen)  # [B, hi]
            for j in range(hi):
                tokens.append(kids[:, j]), parents.append(parent), q_state.append(state)
                valid.append(ok & (j < count))
                nxt.append((len(tokens) - 1, kids[:, j], valid[-1]))
        frontier = nxt
    tokens, valid, q_state = torch.stack(tokens, 1), torch.stack(valid, 1), torch.stack(q_state, 1)
    parents = torch.tensor(parents).expand(B, -1)
    compact = valid.long().cumsum(1) - 1  # index of each valid node once padding is squeezed out
    parents = torch.where(parents >= 0, compact.gather(1, parents.clamp(min=0)), -1)
    q_logits = None if point_mass else q[q_state].log().float()
    pt = DraftTree.from_padded(tokens, parents, valid, q_logits).padded()
    p_logits = P.log().float()[torch.cat([states[:, None], pt.tokens], 1)]  # [B, 1+N, V]
    p_logits[:, 1:][~pt.valid] = float("nan")  # padding must never be read
    return pt, p_logits


def verify_step(q, states, widths, keys, base, gen, **kw):
    pt, p_logits = draft(q, states, widths, gen, **kw)
    positions = base[:, None] + torch.cat([torch.zeros_like(base)[:, None], pt.depth], 1)
    return rejection_verify(pt, p_logits, keys, positions)


def first_two(n: int, widths, q=Q, seed: int = 0, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x1, x2, first step's num_accepted) for n rows, each its own key."""
    gen = torch.Generator().manual_seed(seed)
    keys = row_keys(seed, 0, torch.arange(n), torch.zeros(n, dtype=torch.long))
    v1 = verify_step(q, torch.full((n,), START), widths, keys, torch.zeros(n, dtype=torch.long), gen, **kw)
    x1, x2 = v1.tokens[:, 0], v1.tokens[:, 1].clone()
    short = v1.num_emitted < 2
    if bool(short.any()):
        v2 = verify_step(q, x1[short], widths, keys[short], v1.num_emitted[short], gen, **kw)
        x2[short] = v2.tokens[:, 0]
    return x1, x2, v1.num_accepted


def joint_target() -> torch.Tensor:
    return (P[START][:, None] * P[:V]).flatten()  # [V * V] p(x1) p(x2 | x1)


def counts(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    return torch.bincount(x1 * V + x2, minlength=V * V).double()


def chi2_pvalue(x1: torch.Tensor, x2: torch.Tensor) -> float:
    """Goodness of fit of the pairs to the target's joint; 0 if a pair it never emits occurs."""
    obs, p = counts(x1, x2), joint_target()
    if obs[p == 0].sum() > 0:
        return 0.0
    return float(chisquare(obs[p > 0], obs.sum() * p[p > 0]).pvalue)


def total_variation(x1: torch.Tensor, x2: torch.Tensor) -> float:
    obs = counts(x1, x2)
    return 0.5 * float((obs / obs.sum() - joint_target()).abs().sum())


N_ROWS = 40_000


def test_chi_square_detects_the_drafter_distribution():
    """The check has power: the drafter's own pairs fail it."""
    gen = torch.Generator().manual_seed(1)
    x1 = torch.multinomial(Q[START], N_ROWS, replacement=True, generator=gen)
    x2 = torch.multinomial(Q[x1], 1, generator=gen)[:, 0]
    assert chi2_pvalue(x1, x2) < 1e-6


def test_chain_output_matches_target_joint():
    x1, x2, _ = first_two(N_ROWS, CHAIN2)
    assert chi2_pvalue(x1, x2) > 1e-3


def test_tree_with_iid_children_output_matches_target_joint():
    x1, x2, _ = first_two(N_ROWS, TREE)
    assert chi2_pvalue(x1, x2) > 1e-3


@pytest.mark.parametrize("widths", [CHAIN2, TREE], ids=["chain", "tree"])
def test_point_mass_drafts_output_matches_target_joint(widths):
    x1, x2, _ = first_two(N_ROWS, widths, point_mass=True)
    assert chi2_pvalue(x1, x2) > 1e-3


def test_deeper_ragged_tree_output_matches_target_joint():
    x1, x2, _ = first_two(N_ROWS, [(1, 3), (0, 2), (1, 2)], seed=3)
    assert chi2_pvalue(x1, x2) > 1e-3


def test_distance_to_target_shrinks_with_samples():
    small = total_variation(*first_two(1_000, TREE, seed=5)[:2])
    large = total_variation(*first_two(N_ROWS, TREE, seed=5)[:2])
    assert large < small / 3 and large < 0.02


@pytest.mark.parametrize("q", [Q, Q_FAR], ids=["near", "far"])
def test_first_draft_is_accepted_with_probability_one_minus_tv(q):
    """Leviathan's rate: a chain's first node is accepted w.p. sum_x min(p(x), q(x))."""
    _, _, accepted = first_two(N_ROWS, CHAIN2, q=q, seed=7)
    rate = float((accepted >= 1).double().mean())
    expected = float(torch.minimum(P[START], q[START]).sum())
    se = (expected * (1 - expected) / N_ROWS) ** 0.5
    assert abs(rate - expected) < 4 * se


def test_far_drafter_keeps_the_distribution_and_only_loses_acceptance():
    x1, x2, far_accepted = first_two(N_ROWS, TREE, q=Q_FAR, seed=11)
    assert chi2_pvalue(x1, x2) > 1e-3
    _, _, near_accepted = first_two(N_ROWS, TREE, q=Q, seed=11)
    assert far_accepted.double().mean() < near_accepted.double().mean() - 0.2


@pytest.mark.parametrize("widths", [[(1, 1)] * 4, [(2, 2), (2, 2)]], ids=["chain", "tree"])
def test_drafter_equal_to_target_accepts_every_row_fully(widths):
    """p / q = 1 at every node, so the first child at each level is always accepted."""
    gen = torch.Generator().manual_seed(0)
    n = 2_000
    keys = row_keys(0, 0, torch.arange(n), torch.zeros(n, dtype=torch.long))
    v = verify_step(P, torch.full((n,), START), widths, keys, torch.zeros(n, dtype=torch.long), gen)
    assert torch.equal(v.num_accepted, torch.full((n,), len(widths)))


def test_point_mass_on_a_certain_target_token_is_accepted():
    n = 1_000
    pt, p_logits = draft(P, torch.full((n,), START), [(1, 1)], torch.Generator().manual_seed(0), point_mass=True)
    p_logits[:, 0] = float("-inf")
    p_logits[torch.arange(n), 0, pt.tokens[:, 0]] = 0.0  # the target is sure of the drafted token
    keys = row_keys(0, 0, torch.arange(n), torch.zeros(n, dtype=torch.long))
    v = rejection_verify(pt, p_logits, keys, torch.zeros(n, 2, dtype=torch.long))
    assert bool(v.accepted[:, 0].all())


def test_same_keys_give_identical_verdicts_and_rows_do_not_depend_on_the_batch():
    n = 500
    pt, p_logits = draft(Q, torch.full((n,), START), TREE, torch.Generator().manual_seed(2))
    keys = row_keys(4, 1, torch.arange(n), torch.zeros(n, dtype=torch.long))
    positions = torch.cat([torch.zeros(n, 1, dtype=torch.long), pt.depth], 1) + 9
    a, b = rejection_verify(pt, p_logits, keys, positions), rejection_verify(pt, p_logits, keys, positions)
    for field in ("accepted", "num_accepted", "last_index", "path", "tokens", "num_emitted"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    rows = torch.arange(0, n, 7)
    sub = PaddedTree(pt.tokens[rows], pt.parents[rows], pt.depth[rows], pt.valid[rows], pt.q_logits[rows])
    c = rejection_verify(sub, p_logits[rows], keys[rows], positions[rows])
    assert torch.equal(c.tokens, a.tokens[rows]) and torch.equal(c.accepted, a.accepted[rows])
    other = rejection_verify(pt, p_logits, row_keys(5, 1, torch.arange(n), torch.zeros(n, dtype=torch.long)), positions)
    assert not torch.equal(other.tokens, a.tokens)


def test_padding_nodes_are_never_accepted():
    """Padding that would be accepted for sure if it were tried (its token is the target's
    certain one, its parent the root) is skipped; the valid child is rejected, the target's
    token comes out as the recovered token."""
    n = 300
    tokens = torch.tensor([[3, 2, 2]]).expand(n, 3)
    parents = torch.tensor([[-1, -1, 0]]).expand(n, 3)
    valid = torch.tensor([[True, False, False]]).expand(n, 3)
    depth = torch.tensor([[1, 0, 0]]).expand(n, 3)
    sure = torch.full((V,), float("-inf")).index_fill(0, torch.tensor([2]), 0.0)  # p = delta(2)
    p_logits = sure.expand(n, 4, V).clone()
    q_logits = sure.expand(n, 3, V).clone()
    q_logits[:, 0] = torch.zeros(V)  # the valid node was drafted from uniform q
    q_logits[:, 1:] = float("nan")  # as DraftTree.padded leaves masked logits on padding
    keys = row_keys(0, 0, torch.arange(n), torch.zeros(n, dtype=torch.long))
    positions = torch.zeros(n, 4, dtype=torch.long)
    for q in (q_logits, None):
        v = rejection_verify(PaddedTree(tokens, parents, depth, valid, q), p_logits, keys, positions)
        assert not bool(v.accepted.any())
        assert torch.equal(v.tokens[:, 0], torch.full((n,), 2)) and bool((v.num_emitted == 1).all())


def test_bad_shapes_raise_value_error():
    pt, p_logits = draft(Q, torch.full((4,), START), CHAIN2, torch.Generator().manual_seed(0))
    keys, positions = torch.arange(4), torch.zeros(4, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="p_logits"):
        rejection_verify(pt, p_logits[:, :2], keys, positions)
    with pytest.raises(ValueError, match="positions"):
        rejection_verify(pt, p_logits, keys, positions[:, :2])
