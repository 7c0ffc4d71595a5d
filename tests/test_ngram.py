"""NgramDrafter: suffix-match drafts from a row's own text, its active and finished siblings."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import SamplingParams
from engine.spec.drafter import DraftContext, DraftShape
from engine.spec.ngram import NgramDrafter
from engine.spec.tree import DraftTree


def make_ctx(prompts: list[list[int]], responses: list[list[int]], prompt_ids: list[str],
             depth: int = 4, topk: int = 1, verify_tokens: int = 8) -> DraftContext:
    b = len(responses)
    generated = torch.tensor([len(r) for r in responses])
    padded = torch.zeros(b, int(generated.max()) + 3, dtype=torch.long)
    for r, resp in enumerate(responses):
        padded[r, :len(resp)] = torch.tensor(resp)
    return DraftContext(
        roots=padded[torch.arange(b), generated - 1], positions=generated - 1,
        keys=torch.zeros(b, dtype=torch.long), responses=padded, generated=generated,
        prompts=[torch.tensor(p) for p in prompts], prompt_ids=prompt_ids, samples=torch.zeros(b, dtype=torch.long),
        drafts=[None] * b, params=SamplingParams(), shape=DraftShape(depth=depth, topk=topk, verify_tokens=verify_tokens),
    )


def row_nodes(tree: DraftTree, r: int) -> tuple[list[int], list[int]]:
    lo, hi = int(tree.offsets[r]), int(tree.offsets[r + 1])
    return tree.tokens[lo:hi].tolist(), tree.parents[lo:hi].tolist()


def assert_valid_trees(tree: DraftTree, shape: DraftShape) -> None:
    assert tree.q_logits is None
    assert tree.num_nodes.le(shape.verify_tokens).all()
    for r in range(tree.batch_size):
        tokens, parents = row_nodes(tree, r)
        assert all(-1 <= p < i for i, p in enumerate(parents)), "a parent precedes its children"
        children: dict[int, list[int]] = {}
        for t, p in zip(tokens, parents):
            children.setdefault(p, []).append(t)
        assert all(len(c) == len(set(c)) for c in children.values()), "siblings carry distinct tokens"
        assert all(len(c) <= shape.topk for c in children.values())
    padded = tree.padded()
    assert padded.depth.le(shape.depth).all()


def test_continues_a_repeated_pattern_in_the_rows_own_text():
    ctx = make_ctx([[5, 6]], [[10, 11, 12, 13, 10, 11]], ["p"])
    tree = NgramDrafter(max_ngram=4, min_ngram=2).propose(ctx)
    assert row_nodes(tree, 0) == ([12, 13, 10, 11], [-1, 0, 1, 2])


def test_uses_a_finished_siblings_response_for_the_exact_continuation():
    drafter = NgramDrafter()
    drafter.finish("p", [20, 21, 22, 23, 24, 25, 26])
    ctx = make_ctx([[1, 2, 3], [1, 2, 3]], [[20, 21, 22], [20]], ["p", "p"])
    tree = drafter.propose(ctx)
    assert row_nodes(tree, 0)[0] == [23, 24, 25, 26]
    # A match ending in the prompt continues into the sibling's response: a response's first drafts.
    assert row_nodes(tree, 1)[0] == [21, 22, 23, 24]


def test_uses_an_active_sibling_row_of_the_same_prompt():
    ctx = make_ctx([[1, 2], [1, 2]], [[30, 31, 32, 33, 34, 35], [30, 31]], ["p", "p"])
    tree = NgramDrafter(min_ngram=2).propose(ctx)
    assert row_nodes(tree, 1)[0] == [32, 33, 34, 35]
    assert row_nodes(tree, 0)[0] == []  # its own suffix is not a match of itself


def test_rows_of_other_prompts_are_not_siblings():
    ctx = make_ctx([[1, 2], [7, 8]], [[30, 31, 32, 33, 34], [30, 31]], ["p", "q"])
    tree = NgramDrafter(min_ngram=1).propose(ctx)
    assert tree.num_nodes.tolist() == [0, 0]


def test_prompt_text_counts_once_however_many_rows_share_the_prompt():
    # [5, 6] is followed by 8 twice and by 7 once in the prompt; 7 is in the prompt's tail, which
    # opens every row's corpus segment, and must not gain a vote per row.
    prompt = [5, 6, 8, 5, 6, 8, 1, 5, 6, 7, 2]
    ctx = make_ctx([prompt] * 3, [[9, 5, 6], [9], [9]], ["p"] * 3, depth=1)
    tree = NgramDrafter().propose(ctx)
    assert row_nodes(tree, 0)[0] == [8]


def test_rows_without_a_match_get_zero_nodes_while_others_draft():
    responses = [[40, 41, 42], [10, 11, 12, 10, 11], [50, 51], [7, 8, 9, 7, 8, 9, 7]]
    ctx = make_ctx([[1], [2], [3], [4]], responses, ["a", "b", "c", "d"], depth=3)
    tree = NgramDrafter(min_ngram=1).propose(ctx)
    assert tree.num_nodes.tolist() == [0, 3, 0, 3]
    assert tree.offsets.tolist() == [0, 0, 3, 3, 6]
    assert row_nodes(tree, 1)[0] == [12, 10, 11]
    assert row_nodes(tree, 3)[0] == [8, 9, 7]


@pytest.mark.parametrize("depth,verify_tokens", [(1, 8), (3, 8), (6, 8), (6, 2)])
def test_chain_length_is_at_most_depth_and_verify_tokens(depth, verify_tokens):
    ctx = make_ctx([[1, 2]], [[5, 6, 7] * 6], ["p"], depth=depth, verify_tokens=verify_tokens)
    tree = NgramDrafter().propose(ctx)
    tokens, parents = row_nodes(tree, 0)
    assert len(tokens) == min(depth, verify_tokens)
    assert tokens == ([5, 6, 7] * 3)[:len(tokens)]
    assert parents == list(range(-1, len(tokens) - 1))


def test_chain_follows_the_continuation_most_siblings_agree_on():
    drafter = NgramDrafter()
    for resp in ([10, 11, 12], [10, 11, 12], [10, 13, 14]):  # the newest one disagrees
        drafter.finish("p", resp)
    tree = drafter.propose(make_ctx([[1, 2]], [[10]], ["p"], depth=2))
    assert row_nodes(tree, 0)[0] == [11, 12]


def test_tree_keeps_the_heaviest_nodes_with_distinct_siblings():
    drafter = NgramDrafter()
    for resp in ([10, 11, 12, 13], [10, 11, 14, 15], [10, 16, 17], [10, 11, 12, 18]):
        drafter.finish("p", resp)
    shape = DraftShape(depth=3, topk=2, verify_tokens=5)
    tree = drafter.propose(make_ctx([[1, 2]], [[10]], ["p"], depth=3, topk=2, verify_tokens=5))
    assert_valid_trees(tree, shape)
    # Weights: 11 (3), 12 (2), then weight-1 nodes shallowest first, ties to the newer response.
    assert row_nodes(tree, 0) == ([11, 12, 16, 17, 14], [-1, 0, -1, 2, 0])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("depth,topk,verify_tokens", [(4, 1, 8), (3, 3, 10), (5, 2, 6), (2, 4, 16)])
def test_tree_mode_siblings_distinct_size_bounded_parents_first_depth_bounded(seed, depth, topk, verify_tokens):
    g = torch.Generator().manual_seed(seed)
    vocab = 5  # small, so suffixes recur and tries branch
    drafter = NgramDrafter(min_ngram=1, max_ngram=3)
    for _ in range(6):
        drafter.finish("p", torch.randint(vocab, (30,), generator=g).tolist())
    responses = [torch.randint(vocab, (int(n),), generator=g).tolist() for n in (1, 7, 20)]
    ctx = make_ctx([[0, 1, 2]] * 3, responses, ["p"] * 3, depth=depth, topk=topk, verify_tokens=verify_tokens)
    tree = drafter.propose(ctx)
    assert_valid_trees(tree, ctx.shape)
    assert tree.num_nodes.gt(0).all()


def test_finished_siblings_are_kept_within_an_rl_step_and_forgotten_at_the_next():
    drafter = NgramDrafter()
    ctx = make_ctx([[1, 2]], [[20, 21]], ["p"])
    limits = ctx.shape
    drafter.reset(4, 64, SamplingParams(seed=1, step=3), limits)
    drafter.finish("p", [20, 21, 22, 23])
    assert row_nodes(drafter.propose(ctx), 0)[0] == [22, 23]
    drafter.reset(4, 64, SamplingParams(seed=1, step=3), limits)  # another generate() call of the same step
    assert row_nodes(drafter.propose(ctx), 0)[0] == [22, 23]
    drafter.reset(4, 64, SamplingParams(seed=1, step=4), limits)
    assert drafter.propose(ctx).num_nodes.tolist() == [0]


def test_keeps_only_the_newest_finished_responses():
    drafter = NgramDrafter(max_finished=1)
    drafter.finish("p", [20, 21, 22])
    drafter.finish("p", [30, 31])
    assert drafter.propose(make_ctx([[1, 2]], [[20, 21]], ["p"])).num_nodes.tolist() == [0]
    assert row_nodes(drafter.propose(make_ctx([[1, 2]], [[30]], ["p"])), 0)[0] == [31]


@pytest.mark.parametrize("kwargs", [dict(min_ngram=0), dict(max_ngram=1, min_ngram=2), dict(max_matches=0),
                                    dict(max_finished=-1)])
def test_bad_options_raise(kwargs):
    with pytest.raises(ValueError):
        NgramDrafter(**kwargs)
