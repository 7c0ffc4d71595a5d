"""PregeneratedDrafter: the own draft while the row follows it, then suffix re-alignment within the
own draft and the request's other samples' drafts, nothing where nothing matches."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import SamplingParams
from engine.spec.drafter import DraftContext, DraftShape
from engine.spec.pregenerated import PregeneratedDrafter, sibling_corpus

T = torch.tensor


def ctx(responses: list[list[int]], drafts: list[list[int] | None], siblings: list[list[list[int]]] | None = None,
        depth: int = 4) -> DraftContext:
    b = len(responses)
    generated = T([len(r) for r in responses])
    padded = torch.zeros(b, int(generated.max()) + 4, dtype=torch.long)
    for r, resp in enumerate(responses):
        padded[r, : len(resp)] = T(resp)
    return DraftContext(
        roots=padded[torch.arange(b), generated - 1], positions=generated - 1, keys=torch.zeros(b, dtype=torch.long),
        responses=padded, generated=generated, prompts=[T([1, 2])] * b, prompt_ids=["p"] * b,
        samples=torch.arange(b), drafts=[T(d) if d is not None else None for d in drafts], params=SamplingParams(),
        shape=DraftShape(depth=depth, topk=1, verify_tokens=depth),
        siblings=[sibling_corpus([T(s) for s in row]) for row in siblings] if siblings is not None else [],
    )


def drafted(tree, r: int) -> list[int]:
    return tree.tokens[int(tree.offsets[r]) : int(tree.offsets[r + 1])].tolist()


def test_a_row_that_follows_its_own_draft_gets_its_continuation():
    tree = PregeneratedDrafter().propose(ctx([[10, 11]], [[10, 11, 12, 13, 14, 15, 16]]))
    assert drafted(tree, 0) == [12, 13, 14, 15]


def test_after_a_divergence_the_own_draft_is_re_aligned_by_suffix_nearest_the_position():
    own = [5, 6, 7, 8, 1, 2, 3, 20, 21, 1, 2, 3, 30, 31]
    # the row inserted a token (99) and then wrote 1 2 3 again: both occurrences match, the later is nearer
    tree = PregeneratedDrafter(realign=3).propose(ctx([[5, 6, 7, 8, 99, 20, 21, 1, 2, 3]], [own]))
    assert drafted(tree, 0) == [30, 31]


def test_when_the_own_draft_has_no_match_a_siblings_draft_is_used():
    own = [5, 6, 7, 8, 9]
    sibling = [40, 41, 42, 43, 44, 45, 46]
    tree = PregeneratedDrafter(realign=2).propose(ctx([[5, 6, 7, 42, 43]], [own], [[sibling]]))
    assert drafted(tree, 0) == [44, 45, 46]


def test_the_own_draft_is_preferred_to_a_sibling_that_also_matches():
    own = [1, 2, 3, 50, 51, 52]
    sibling = [1, 2, 3, 60, 61, 62]
    tree = PregeneratedDrafter(realign=2).propose(ctx([[9, 2, 3]], [own], [[sibling]]))
    assert drafted(tree, 0) == [50, 51, 52]


def test_a_row_without_its_own_draft_uses_siblings_only_once_it_has_a_full_window():
    sibling = [7, 8, 9, 10, 11, 12]
    d = PregeneratedDrafter(realign=3)
    early = d.propose(ctx([[8, 9]], [None], [[sibling]]))  # two tokens: not enough to place it in a sibling
    late = d.propose(ctx([[7, 8, 9]], [None], [[sibling]]))
    assert drafted(early, 0) == [] and drafted(late, 0) == [10, 11, 12]


def test_rows_without_any_match_get_no_draft_and_others_are_unaffected():
    tree = PregeneratedDrafter(realign=2).propose(
        ctx([[1, 2], [70, 71, 72], [3]], [[1, 2, 3, 4], [5, 6, 7], None], [[], [[8, 9]], []]))
    assert drafted(tree, 0) == [3, 4] and drafted(tree, 1) == [] and drafted(tree, 2) == []


def test_sibling_drafts_are_searched_together_but_a_match_never_spans_two_and_a_continuation_stops_at_its_end():
    a, b = [7, 8, 9, 1, 2], [3, 4, 40, 41]
    d = PregeneratedDrafter(realign=2)
    across = d.propose(ctx([[5, 6, 2, 3]], [None], [[a, b]]))  # 2 3 only occurs across a's end and b's start
    inside = d.propose(ctx([[5, 6, 1, 2]], [None], [[a, b]]))  # 1 2 ends a: nothing follows within a
    later = d.propose(ctx([[5, 6, 3, 4]], [None], [[a, b]]))
    assert drafted(across, 0) == [] and drafted(inside, 0) == [] and drafted(later, 0) == [40, 41]


def test_among_siblings_the_match_nearest_the_rows_position_wins():
    near, far = [9, 9, 9, 1, 2, 50], [1, 2, 60, 9, 9, 9]
    tree = PregeneratedDrafter(realign=2).propose(ctx([[5, 5, 5, 1, 2]], [None], [[far, near]]))
    assert drafted(tree, 0) == [50]  # near's 1 2 ends at position 5, as the row's does; far's at 2


def test_realign_must_be_positive():
    with pytest.raises(ValueError, match="realign"):
        PregeneratedDrafter(realign=0)
