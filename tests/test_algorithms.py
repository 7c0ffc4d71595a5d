"""RL algorithms against hand-computed values and verl's formulas: advantages (exact zeros for
equal groups), aggregation, the clipped loss with dual clip, KL, dynamic sampling, overlong
shaping, the config section, and exact micro-batching."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common.config import from_dict
from pipeline.algorithms import (
    AlgorithmConfig, build_algorithm, fill_groups, grpo_advantages, informative_groups, kl_per_token, loss_weights,
    mismatch_kl, overlong_penalty, policy_loss, rloo_advantages, token_advantages,
)
from pipeline.records import TrainBatch

LN = math.log


def test_grpo_advantage_is_reward_minus_group_mean_over_unbiased_std():
    adv, m = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]), eps=0.0)
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> 0.5 / 0.57735 = 0.866025; group 1: all equal -> 0
    s = 0.866025
    assert torch.allclose(adv, torch.tensor([[s, -s, -s, s], [0.0, 0.0, 0.0, 0.0]]), atol=1e-6)
    assert m["train/zero_std_groups"] == 0.5
    assert m["train/reward_mean"] == pytest.approx(1.25)


def test_dr_grpo_advantage_does_not_divide_by_std():
    adv, _ = grpo_advantages(torch.tensor([3.0, 1.0, 0.0, 4.0, 2.0]), torch.tensor([7, 7, 9, 9, 9]),
                             normalize_std=False)
    # group 7: mean 2 -> [1, -1]; group 9: mean 2 -> [-2, 2, 0]
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -2.0, 2.0, 0.0]))


def test_grpo_flat_ragged_groups_match_per_group_computation():
    rewards, ids = torch.tensor([0.0, 1.0, 1.0, 0.5, 0.0]), torch.tensor([1, 0, 1, 0, 1])
    adv, _ = grpo_advantages(rewards, ids, eps=0.0)
    g1 = torch.tensor([0.0, 1.0, 0.0])  # rows 0, 2, 4
    g0 = torch.tensor([1.0, 0.5])  # rows 1, 3
    assert torch.allclose(adv[[0, 2, 4]], (g1 - g1.mean()) / g1.std())
    assert torch.allclose(adv[[1, 3]], (g0 - g0.mean()) / g0.std())


def test_rloo_baseline_is_the_mean_of_the_other_responses():
    adv, _ = rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    # r=1: 1 - (0 + 0 + 1) / 3 = 2/3; r=0: 0 - (1 + 0 + 1) / 3 = -2/3
    assert torch.allclose(adv, torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]))
    adv, _ = rloo_advantages(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0, 0, 0]))
    assert torch.allclose(adv, torch.tensor([3 - 1.5, 1 - 2.5, 2 - 2.0]))


def _float32_running_mean(value: float, n: int) -> np.float32:
    """The mean of n copies of float32(value), summed one at a time in float32."""
    total = np.float32(0.0)
    for _ in range(n):
        total += np.float32(value)
    return total / np.float32(n)


ESTIMATORS = {
    "grpo": grpo_advantages,
    "dr_grpo": lambda r, ids=None: grpo_advantages(r, ids, normalize_std=False),
    "rloo": rloo_advantages,
}


@pytest.mark.parametrize("value, n", [(-1.7, 13), (0.1, 8), (0.1, 16), (0.3, 7)])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage_when_float32_rounds_its_mean(value, n, estimator):
    # the case has power: summed in float32, the group's mean misses the reward by a rounding step
    assert _float32_running_mean(value, n) != np.float32(value)
    adv, m = ESTIMATORS[estimator](torch.full((2, n), value))
    assert torch.equal(adv, torch.zeros(2, n))
    assert m["train/zero_std_groups"] == 1.0


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_equal_groups_beside_mixed_groups_leave_the_mixed_groups_advantages_unchanged(estimator):
    mixed = [0.1, 0.3, -1.7, 0.1, 1.0]
    rewards = torch.tensor([-1.7] * 13 + mixed + [0.1] * 8)
    ids = torch.tensor([0] * 13 + [1] * 5 + [2] * 8)
    adv, m = ESTIMATORS[estimator](rewards, ids)
    assert adv.dtype == torch.float32
    assert torch.equal(adv[:13], torch.zeros(13)) and torch.equal(adv[18:], torch.zeros(8))
    alone, _ = ESTIMATORS[estimator](torch.tensor([mixed]))
    assert torch.equal(adv[13:18], alone[0])
    g = torch.tensor(mixed, dtype=torch.float32).double()  # the float32 rewards, reduced in float64
    expected = {"grpo": (g - g.mean()) / (g.std() + 1e-6), "dr_grpo": g - g.mean(),
                "rloo": (g - g.mean()) * 5 / 4}[estimator]
    assert torch.allclose(adv[13:18].double(), expected, rtol=1e-6, atol=1e-7)
    assert m["train/zero_std_groups"] == pytest.approx(2 / 3)


def test_a_group_of_one_is_refused():
    with pytest.raises(ValueError, match=">= 2 responses"):
        grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))


def test_token_advantages_broadcast_over_the_response_only():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])
    assert torch.equal(token_advantages(torch.tensor([2.0, -1.0]), mask),
                       torch.tensor([[0.0, 2.0, 2.0, 0.0], [0.0, 0.0, -1.0, -1.0]]))


MASK = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0]])  # response lengths 3 and 1, B = 2


def test_token_mean_weighs_every_response_token_equally():
    w = loss_weights(MASK, "token-mean")
    assert torch.allclose(w, MASK / 4.0)


def test_seq_mean_token_mean_weighs_each_response_equally():
    w = loss_weights(MASK, "seq-mean-token-mean")
    expected = torch.tensor([[0, 1 / 6, 1 / 6, 1 / 6, 0], [0, 0, 1 / 2, 0, 0]])
    assert torch.allclose(w, expected)
    assert torch.allclose(w.sum(-1), torch.tensor([0.5, 0.5]))


def test_seq_mean_token_sum_norm_divides_by_batch_and_max_length():
    w = loss_weights(MASK, "seq-mean-token-sum-norm", max_response_len=8)
    assert torch.allclose(w, MASK / 16.0)  # 1 / (B * max_response_len) = 1 / (2 * 8)
    with pytest.raises(ValueError, match="max_response_len"):
        loss_weights(MASK, "seq-mean-token-sum-norm")


# Four response tokens (columns 1, 2 of both rows; column 0 is prompt, column 3 padding):
#   row 0: ratio 1.5, A = +1 -> clipped high at 1.28: -1.28;  ratio 1.0, A = +1 -> -1.0
#   row 1: ratio 0.5, A = -1 -> clipped low at 0.8: +0.8;     ratio 0.5, A = +1 -> not clipped: -0.5
OLD = torch.full((2, 4), -1.0)
LP = OLD + torch.tensor([[0.0, LN(1.5), 0.0, 0.0], [0.0, LN(0.5), LN(0.5), 0.0]])
ADV = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, -1.0, 1.0, 0.0]])
RMASK = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0]])


def test_clipped_surrogate_on_hand_values_counts_each_clip_side():
    lp = LP.clone().requires_grad_()
    loss, m = policy_loss(lp, OLD, ADV, loss_weights(RMASK, "token-mean"), RMASK, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx((-1.28 - 1.0 + 0.8 - 0.5) / 4)
    assert m["train/pg_loss"] == pytest.approx(-0.495)
    assert m["train/pg_clipfrac_high"] == 0.25
    assert m["train/pg_clipfrac_low"] == 0.25
    assert m["train/pg_clipfrac"] == 0.5
    loss.backward()
    # d/dlp of -A * exp(lp - old) * w is -A * ratio * w where unclipped, 0 where clipped
    expected = torch.tensor([[0.0, 0.0, -1.0 / 4, 0.0], [0.0, 0.0, -0.5 / 4, 0.0]])
    assert torch.allclose(lp.grad, expected)


def test_symmetric_clip_also_clips_the_ratio_between_the_two_highs():
    # ratio 1.25 with A > 0: clipped by clip_high=0.2 (GRPO), not by 0.28 (DAPO's clip-higher)
    old, lp = torch.zeros(1, 2), torch.tensor([[0.0, LN(1.25)]])
    adv, mask = torch.tensor([[0.0, 1.0]]), torch.tensor([[0, 1]])
    w = loss_weights(mask, "token-mean")
    grpo, mg = policy_loss(lp, old, adv, w, mask, clip_high=0.2)
    dapo, md = policy_loss(lp, old, adv, w, mask, clip_high=0.28)
    assert grpo.item() == pytest.approx(-1.2) and mg["train/pg_clipfrac_high"] == 1.0
    assert dapo.item() == pytest.approx(-1.25) and md["train/pg_clipfrac_high"] == 0.0


def test_a_huge_log_ratio_gives_a_finite_loss_and_gradient():
    old, mask, w = torch.zeros(1, 2), torch.tensor([[0, 1]]), torch.tensor([[0.0, 1.0]])
    lp = torch.tensor([[0.0, 1000.0]], requires_grad=True)
    adv = torch.tensor([[0.0, -1.0]])
    loss, _ = policy_loss(lp, old, adv, w, mask, clip_ratio_c=None, log_ratio_clamp=20.0)
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-5)  # -A * exp(20): without dual clip, unbounded
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    dual, m = policy_loss(lp, old, adv, w, mask, clip_ratio_c=3.0, log_ratio_clamp=20.0)
    assert dual.item() == 3.0 and m["train/pg_clipfrac_dual"] == 1.0


# Four response tokens of one row, token-mean weights 1/4, clip_low = clip_high = 0.2:
#   ratio 5,   A = -1 -> PPO +5,   dual clip at 3: +3 (no gradient)
#   ratio 2,   A = -2 -> PPO +4,   under -A * 3 = 6: kept, gradient -A * ratio * w = 1
#   ratio 5,   A = +1 -> clipped high at 1.2: -1.2 (dual clip applies to A < 0 only)
#   ratio 0.5, A = -1 -> clipped low at 0.8: +0.8
DUAL_OLD = torch.zeros(1, 4)
DUAL_LP = torch.tensor([[LN(5.0), LN(2.0), LN(5.0), LN(0.5)]])
DUAL_ADV = torch.tensor([[-1.0, -2.0, 1.0, -1.0]])
DUAL_MASK = torch.ones(1, 4, dtype=torch.long)


def test_dual_clip_caps_the_loss_of_negative_advantages_on_hand_values():
    w = loss_weights(DUAL_MASK, "token-mean")
    lp = DUAL_LP.clone().requires_grad_()
    loss, m = policy_loss(lp, DUAL_OLD, DUAL_ADV, w, DUAL_MASK, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((3.0 + 4.0 - 1.2 + 0.8) / 4)
    assert m["train/pg_clipfrac_dual"] == 0.25
    assert (m["train/pg_clipfrac_high"], m["train/pg_clipfrac_low"]) == (0.25, 0.25)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    lp = DUAL_LP.clone().requires_grad_()
    off, m = policy_loss(lp, DUAL_OLD, DUAL_ADV, w, DUAL_MASK, clip_ratio_c=None)
    assert off.item() == pytest.approx((5.0 + 4.0 - 1.2 + 0.8) / 4)
    assert "train/pg_clipfrac_dual" not in m
    off.backward()
    assert torch.allclose(lp.grad, torch.tensor([[5.0 / 4, 1.0, 0.0, 0.0]]))


def _verl_vanilla_policy_loss(lp, old, adv, mask, clip_low, clip_high, clip_ratio_c):
    """verl's core_algos.compute_policy_loss_vanilla with token-mean aggregation, from its formula:
    -> (loss, pg_clipfrac, pg_clipfrac_lower)."""
    m = mask.float()
    ratio = (lp - old).clamp(-20.0, 20.0).exp()
    loss1, loss2 = -adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    ppo = torch.maximum(loss1, loss2)
    cap = -adv * clip_ratio_c
    per_token = torch.where(adv < 0, torch.minimum(cap, ppo), ppo)

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * m).sum() / m.sum()

    return token_mean(per_token), token_mean((loss2 > loss1).float()), token_mean(((ppo > cap) & (adv < 0)).float())


@pytest.mark.parametrize("clip_ratio_c", [1.5, 3.0, 10.0])
def test_dual_clip_matches_verls_formula_on_random_tokens(clip_ratio_c):
    g = torch.Generator().manual_seed(0)
    B, T = 8, 32
    old = -3.0 * torch.rand(B, T, generator=g)
    lp_init = old + 2.0 * torch.randn(B, T, generator=g)  # ratios from ~e^-6 to ~e^6: every clip side is hit
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.8).long()
    lp = lp_init.clone().requires_grad_()
    loss, m = policy_loss(lp, old, adv, loss_weights(mask, "token-mean"), mask,
                          clip_low=0.2, clip_high=0.28, clip_ratio_c=clip_ratio_c)
    loss.backward()
    ref_lp = lp_init.clone().requires_grad_()
    ref, clipfrac, clipfrac_lower = _verl_vanilla_policy_loss(ref_lp, old, adv, mask, 0.2, 0.28, clip_ratio_c)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(lp.grad, ref_lp.grad, atol=1e-7)
    assert m["train/pg_clipfrac"] == pytest.approx(clipfrac.item())
    assert m["train/pg_clipfrac_dual"] == pytest.approx(clipfrac_lower.item())
    assert m["train/pg_clipfrac_dual"] > 0.0  # the case exercises the dual clip




def test_padding_with_nan_or_inf_log_probs_does_not_leak_into_the_loss():
    old = torch.tensor([[0.0, -1.0, float("-inf")]])
    lp = torch.tensor([[0.0, -1.0, float("nan")]])
    mask = torch.tensor([[0, 1, 0]])
    loss, m = policy_loss(lp, old, torch.tensor([[0.0, 2.0, 0.0]]), loss_weights(mask, "token-mean"), mask)
    assert loss.item() == pytest.approx(-2.0)
    assert m["train/response_tokens"] == 1.0 and m["train/ratio_mean"] == 1.0


def test_kl_estimators_on_hand_values():
    lp, ref = torch.tensor([LN(0.5)]), torch.tensor([LN(0.25)])  # log r = ref - lp = -ln 2
    assert kl_per_token(lp, ref, "k1").item() == pytest.approx(LN(2))
    assert kl_per_token(lp, ref, "k2").item() == pytest.approx(0.5 * LN(2) ** 2)
    assert kl_per_token(lp, ref, "k3").item() == pytest.approx(0.5 + LN(2) - 1)  # exp(ref-lp) - (ref-lp) - 1
    assert kl_per_token(ref, ref, "k3").item() == 0.0


def test_kl_term_adds_its_weighted_sum_and_reports_train_kl():
    lp, old = torch.tensor([[0.0, LN(0.5)]]), torch.tensor([[0.0, LN(0.5)]])
    ref, mask = torch.tensor([[0.0, LN(0.25)]]), torch.tensor([[0, 1]])
    w, adv = loss_weights(mask, "token-mean"), torch.tensor([[0.0, 1.0]])
    loss, m = policy_loss(lp, old, adv, w, mask, ref_logprobs=ref, kl_coef=0.1, kl_estimator="k3")
    k3 = 0.5 + LN(2) - 1
    assert m["train/kl"] == pytest.approx(k3)
    assert loss.item() == pytest.approx(-1.0 + 0.1 * k3)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, old, adv, w, mask, kl_coef=0.1)


def test_mismatch_kl_is_zero_for_equal_log_probs_and_k3_otherwise():
    mask = torch.tensor([[0, 1, 1]])
    eng = torch.tensor([[0.0, LN(0.5), LN(0.25)]])
    assert mismatch_kl(eng, eng.clone(), mask)[1]["train/mismatch_kl"] == 0.0
    actor = torch.tensor([[5.0, LN(0.25), LN(0.25)]])  # column 0 is prompt: ignored
    # token 1: log r = log(0.25/0.5) = -ln 2 -> k3 = 0.5 + ln 2 - 1; token 2: 0
    assert mismatch_kl(eng, actor, mask)[1]["train/mismatch_kl"] == pytest.approx((0.5 + LN(2) - 1) / 2)


def test_informative_groups_are_those_with_differing_rewards():
    assert informative_groups(torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])).tolist() == [False, True, False]


def test_dynamic_sampling_refills_from_the_stream_and_stops_when_full():
    pulled = []

    def stream():
        for name, rewards in [("a", [1, 1]), ("b", [0, 1]), ("c", [0, 0]), ("d", [1, 0]), ("e", [0, 1]), ("f", [0, 1])]:
            pulled.append(name)
            yield name, rewards

    kept, m = fill_groups(stream(), target=2)
    assert kept == ["b", "d"]
    assert pulled == ["a", "b", "c", "d"]  # nothing drawn past the full batch
    assert (m["train/dynamic_sampling_drawn"], m["train/dynamic_sampling_dropped"]) == (4.0, 2.0)


def test_dynamic_sampling_that_runs_out_says_what_it_found():
    with pytest.raises(ValueError, match="only 1 of 3 groups .* in 3 drawn"):
        fill_groups(iter([(0, [1, 1]), (1, [0, 1]), (2, [0, 0])]), target=3)


def test_overlong_penalty_ramps_linearly_over_the_buffer():
    pen, m = overlong_penalty(torch.tensor([10, 16, 18, 20, 25]), max_response_len=20, buffer=4, factor=0.5)
    # free up to 20 - 4 = 16; then -0.5 * (L - 16) / 4; -0.5 at and beyond 20
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, -0.25, -0.5, -0.5]))
    assert m["train/overlong_penalized_frac"] == pytest.approx(0.6)
    assert torch.equal(overlong_penalty(torch.tensor([20]), 20, 0)[0], torch.tensor([0.0]))


def test_config_defaults_differ_per_algorithm():
    grpo, dapo, rloo = (from_dict(AlgorithmConfig, {"name": n}) for n in ("grpo", "dapo", "rloo"))
    assert (grpo.clip_high, grpo.aggregation, grpo.normalize_std, grpo.dynamic_sampling) == (
        0.2, "seq-mean-token-mean", True, False)
    assert (dapo.clip_low, dapo.clip_high, dapo.aggregation, dapo.dynamic_sampling) == (0.2, 0.28, "token-mean", True)
    assert rloo.normalize_std is False
    assert grpo.clip_ratio_c == dapo.clip_ratio_c == rloo.clip_ratio_c == 3.0  # dual clip on, as in verl
    assert from_dict(AlgorithmConfig, {"clip_ratio_c": None}).clip_ratio_c is None
    assert from_dict(AlgorithmConfig, {"name": "dapo", "clip_high": 0.3}).clip_high == 0.3


@pytest.mark.parametrize("data, key", [
    ({"clip_low": 1.0}, "algorithm.clip_low"),
    ({"clip_high": -0.1}, "algorithm.clip_high"),
    ({"clip_ratio_c": 1.0}, "algorithm.clip_ratio_c"),
    ({"clip_ratio_c": 0.5}, "algorithm.clip_ratio_c"),
    ({"kl_coef": -1.0}, "algorithm.kl_coef"),
    ({"max_sampling_rounds": 0}, "algorithm.max_sampling_rounds"),
    ({"name": "rloo", "normalize_std": True}, "algorithm.normalize_std"),
    ({"aggregation": "sum"}, "algorithm.aggregation"),
])
def test_config_errors_name_the_key(data, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        from_dict(AlgorithmConfig, data, "algorithm")


def test_built_algorithms_bind_their_estimator_and_clip():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    rloo = build_algorithm(AlgorithmConfig(name="rloo"), max_response_len=8)
    assert torch.allclose(rloo.advantages(rewards, None)[0], rloo_advantages(rewards)[0])
    dr = build_algorithm(AlgorithmConfig(name="grpo", normalize_std=False, aggregation="seq-mean-token-sum-norm"), 8)
    assert torch.allclose(dr.advantages(rewards, None)[0], torch.tensor([[0.5, -0.5, -0.5, 0.5]]))
    assert torch.allclose(dr.loss_weights(MASK), MASK / 16.0)
    dapo = build_algorithm(AlgorithmConfig(name="dapo", overlong_buffer=4), max_response_len=20)
    shaped, _ = dapo.shape_rewards(torch.tensor([1.0, 1.0]), torch.tensor([10, 18]))
    assert torch.allclose(shaped, torch.tensor([1.0, 0.5]))
    with pytest.raises(ValueError, match="overlong_buffer"):
        build_algorithm(AlgorithmConfig(name="dapo", overlong_buffer=40), max_response_len=20)
    batch = TrainBatch(input_ids=torch.zeros(1, 4, dtype=torch.long), attention_mask=DUAL_MASK, response_mask=DUAL_MASK,
                       old_logprobs=DUAL_OLD, advantages=DUAL_ADV, loss_weights=loss_weights(DUAL_MASK, "token-mean"))
    on, off = (build_algorithm(AlgorithmConfig(name="grpo", clip_ratio_c=c), 8) for c in (3.0, None))
    assert on.loss(DUAL_LP, batch)[0].item() == pytest.approx((3.0 + 4.0 - 1.2 + 0.8) / 4)
    assert off.loss(DUAL_LP, batch)[0].item() == pytest.approx((5.0 + 4.0 - 1.2 + 0.8) / 4)


def _tiny_policy_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[B, T] log p(ids[:, t] | ids[:, t-1]) from a bigram model (column 0: 0), as the records align them."""
    logits = model(ids[:, :-1])  # [B, T-1, V]
    lp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(ids.shape[0], 1), lp], dim=1)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_with_loss_weights_give_the_full_batch_gradient(mode):
    g = torch.Generator().manual_seed(0)
    B, T, V = 6, 7, 11
    model = torch.nn.Sequential(torch.nn.Embedding(V, 8), torch.nn.Linear(8, V))
    ids = torch.randint(V, (B, T), generator=g)
    lengths = torch.tensor([1, 5, 2, 4, 3, 5])  # response tokens at the end of the first 2 + lengths
    cols = torch.arange(T)[None, :]
    mask = ((cols >= 2) & (cols < 2 + lengths[:, None])).long()
    with torch.no_grad():
        old = _tiny_policy_logprobs(model, ids) + 0.3 * torch.randn(B, T, generator=g)
    adv = token_advantages(torch.randn(B, generator=g), mask)
    algo = build_algorithm(AlgorithmConfig(name="grpo", aggregation=mode), max_response_len=5)
    batch = TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=mask, old_logprobs=old,
                       advantages=adv, loss_weights=algo.loss_weights(mask))

    def grads(micro: int, reweigh: bool) -> list[torch.Tensor]:
        model.zero_grad()
        for start in range(0, B, micro):
            part = batch.select(slice(start, start + micro))
            if reweigh:  # the wrong way: aggregate inside each micro-batch
                part.loss_weights = algo.loss_weights(part.response_mask) * part.size / B
            loss, _ = algo.loss(_tiny_policy_logprobs(model, part.input_ids), part)
            loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    full = grads(B, reweigh=False)
    for micro in (1, 2, 4):
        for a, b in zip(full, grads(micro, reweigh=False)):
            assert torch.allclose(a, b, atol=1e-6)
    if mode == "token-mean":  # re-aggregating per micro-batch changes the gradient: the test has power
        assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(full, grads(2, reweigh=True)))
