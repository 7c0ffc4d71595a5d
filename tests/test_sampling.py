"""The noise-indexed sampler: keyed determinism, greedy, and the distributions it samples."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from engine.sampling import SamplingParams, mask_logits, prompt_key, row_keys, sample

LOGITS = torch.tensor([2.0, 1.5, 0.3, 0.0, -0.5, -1.0, -2.0, 1.0])


def draw(params: SamplingParams, n: int = 20000, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    """n samples of one row's next token: each at a different (sample index) key."""
    keys = row_keys(params.seed, params.step, torch.full((n,), 7), torch.arange(n))
    tokens, _ = sample(logits.expand(n, -1), keys, torch.zeros(n, dtype=torch.long), params)
    return tokens


def test_same_keys_give_same_tokens():
    p = SamplingParams(temperature=1.0)
    assert torch.equal(draw(p, 500), draw(p, 500))


def test_different_sample_indices_give_different_tokens():
    tokens = draw(SamplingParams(temperature=1.0), 200)
    assert len(set(tokens.tolist())) > 4


def test_seed_and_step_change_the_samples():
    a = draw(SamplingParams(seed=0, step=0), 300)
    assert not torch.equal(a, draw(SamplingParams(seed=1, step=0), 300))
    assert not torch.equal(a, draw(SamplingParams(seed=0, step=1), 300))


def test_prompt_key_is_stable_and_distinct():
    assert prompt_key("q-17") == prompt_key("q-17") != prompt_key("q-18")
    assert 0 <= prompt_key("x") < 2**63


def test_greedy_equals_argmax():
    logits = torch.randn(64, 1000)
    tokens, logprobs = sample(logits, torch.arange(64), torch.zeros(64, dtype=torch.long), SamplingParams(temperature=0))
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logprobs, logits.log_softmax(-1).max(-1).values)


def test_logprobs_are_those_of_the_sampling_distribution():
    p = SamplingParams(temperature=0.7, top_k=5)
    n = 50
    keys = row_keys(0, 0, torch.zeros(n, dtype=torch.long), torch.arange(n))
    tokens, logprobs = sample(LOGITS.expand(n, -1), keys, torch.zeros(n, dtype=torch.long), p)
    expected = mask_logits(LOGITS[None], 0.7, 5, 1.0).log_softmax(-1)[0, tokens]
    assert torch.allclose(logprobs, expected)


@pytest.mark.parametrize(
    "params,unmasked,plain,samples_policy",
    [
        (SamplingParams(temperature=1.0), True, True, True),
        (SamplingParams(temperature=0.7), True, True, False),
        (SamplingParams(temperature=0.0, top_k=5, top_p=0.9), False, True, False),
        (SamplingParams(temperature=1.0, top_k=5), False, False, False),
        (SamplingParams(temperature=1.0, top_p=0.9), False, False, False),
    ],
)
def test_plain_sampling_is_greedy_or_masks_nothing(params, unmasked, plain, samples_policy):
    assert (params.unmasked, params.plain, params.samples_policy) == (unmasked, plain, samples_policy)
    if params.temperature > 0:  # unmasked: mask_logits is logits / T exactly, so the kernels may skip it
        masked = mask_logits(LOGITS[None], params.temperature, params.top_k, params.top_p)
        assert torch.equal(masked, LOGITS[None] / params.temperature) == unmasked


def test_policy_sampling_returns_the_policys_logprobs():
    p = SamplingParams(temperature=1.0)
    assert p.samples_policy
    n = 50
    keys = row_keys(0, 0, torch.zeros(n, dtype=torch.long), torch.arange(n))
    tokens, logprobs = sample(LOGITS.expand(n, -1), keys, torch.zeros(n, dtype=torch.long), p)
    assert torch.allclose(logprobs, LOGITS.log_softmax(-1)[tokens])


def target_distribution(temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    return mask_logits(LOGITS[None], temperature, top_k, top_p).softmax(-1)[0]


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.3, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8), (0.8, 5, 0.9)],
)
def test_empirical_frequencies_match_the_masked_softmax(temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=11)
    n = 20000
    counts = torch.bincount(draw(params, n), minlength=len(LOGITS)).double()
    probs = target_distribution(temperature, top_k, top_p).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the top-k / top-p set"
    expected = probs[support] / probs[support].sum() * counts.sum()
    _, pvalue = chisquare(counts[support].numpy(), expected.numpy())
    assert pvalue > 1e-3


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = target_distribution(1.0, 0, 1.0)
    kept = target_distribution(1.0, 0, 0.8) > 0
    order = probs.argsort(descending=True)
    k = int(kept.sum())
    assert probs[order[: k - 1]].sum() < 0.8 <= probs[order[:k]].sum()
    assert kept[order[:k]].all()


def test_top_p_on_a_large_vocabulary_matches_a_full_sort():
    logits = torch.randn(4, 5000) * 3
    masked = mask_logits(logits, 1.0, 0, 0.95)
    probs = logits.softmax(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < 0.95
    expected = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    assert torch.equal(torch.isfinite(masked), expected)


@pytest.mark.parametrize("bad", [dict(top_p=0.0), dict(top_p=1.5), dict(temperature=-1), dict(top_k=-2), dict(max_new_tokens=0)])
def test_bad_sampling_params_are_rejected(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
