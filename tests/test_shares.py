import pytest

from pipeline.shares import shard_shares, token_shares


def test_shard_shares_are_the_loaders_contiguous_shards():
    assert shard_shares(6, 3) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="prompts_per_step"):
        shard_shares(5, 2)


def test_token_shares_cover_every_group_once_in_global_order():
    tokens = [5, 900, 30, 40, 800, 10, 20, 60]
    shares = token_shares(tokens, 3)
    assert sorted(g for s in shares for g in s) == list(range(len(tokens)))
    assert all(s == sorted(s) for s in shares)


def test_token_shares_balance_a_long_tail_better_than_shards():
    tokens = [900, 800, 30, 40, 5, 10, 20, 60]
    load = lambda shares: max(sum(tokens[g] for g in s) for s in shares)
    assert load(token_shares(tokens, 2)) < load(shard_shares(len(tokens), 2))
    assert load(token_shares(tokens, 2)) == 935
