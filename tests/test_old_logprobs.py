"""Old log-probs from the update's own forward (pipeline.update.old_logprobs): auto picks it where it holds,
it runs no actor pass over the rows it covers, and it learns what the separate pass learns (losses,
gradient norms and weights within float32 rounding, step by step), with speculation on or off alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.types import FinishReason, Rollout, RolloutBatch
from common.config import load_config
from launch.run.config import TrainConfig
from pipeline.algorithms import build_algorithm
from pipeline.config import TrainerSection
from pipeline.actors import ActorConfig, build_actor
from pipeline.dist import Ranks
from pipeline.update.learner import Learner
from pipeline.update.old_logprobs import UpdateLogprobs, old_logprobs_source
from pipeline.records import TrainBatch
from pipeline.update.reference import ReferencePolicy
from pipeline.rollout.stage import ScoredRollouts
from tests.conftest import make_hf_model
from tests.test_trainer import LEARNED, config, digits_task, step_rows, weights  # noqa: F401  (a fixture)

VOCAB = 101  # make_hf_model's
N = 4  # samples per prompt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("old-logprobs-model")
    make_hf_model("llama").save_pretrained(path)
    return path


@pytest.mark.parametrize("choice, engine_exact, async_steps, features, source", [
    ("auto", True, 0, False, "engine"),
    ("auto", False, 0, False, "update"),
    ("auto", False, 1, False, "actor"),  # the behaviour policy is one update behind
    ("auto", False, 0, True, "actor"),  # the DataBuffer wants the separate pass's hidden states
    ("update", False, 0, False, "update"),
    ("actor", False, 0, False, "actor"),
    ("actor", False, 0, True, "actor"),
])
def test_auto_takes_the_engines_where_exact_else_the_update_forward_else_the_actor_pass(
        choice, engine_exact, async_steps, features, source):
    tc = TrainerSection(old_logprobs=choice, async_steps=async_steps)
    assert old_logprobs_source(tc, engine_exact, features) == source


def test_update_with_async_steps_or_actor_features_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="trainer.old_logprobs=update .* trainer.async_steps=1"):
        load_config(TrainConfig, None, ["model.path=unused", "trainer.old_logprobs=update", "trainer.async_steps=1"])
    cfg = load_config(TrainConfig, None, ["model.path=unused", "trainer.old_logprobs=update"])
    with pytest.raises(ValueError, match="trainer.old_logprobs=update cannot fill the DataBuffer"):
        Learner(cfg.trainer, build_algorithm(cfg.algorithm, cfg.rollout.max_new_tokens), cfg.actor, Ranks(), actor=None,
                pad_id=0, engine_old_logprobs=False, actor_features=object())


def test_update_logprobs_finds_every_row_in_regrouped_trimmed_micro_batches_and_passes_over_fillers():
    ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 9, 0, 0], [5, 6, 7, 8, 0], [3, 4, 4, 4, 4]])  # rows 0 and 2 equal
    mask = (ids != 0).float()
    resp = mask.clone()
    resp[:, :2] = 0
    zeros = torch.zeros(4, 5)
    mb = TrainBatch(input_ids=ids, attention_mask=mask, response_mask=resp, old_logprobs=zeros, advantages=zeros,
                    loss_weights=zeros)
    kept = UpdateLogprobs(mb)
    values = -torch.arange(1, 21, dtype=torch.float).view(4, 5) * resp  # what the forward "computed" per row
    values[2] = values[0]  # equal rows, equal log-probs

    def micro(rows: list[int], length: int, filler: bool = False) -> tuple[TrainBatch, torch.Tensor]:
        sub = mb.select(torch.tensor(rows))
        cut = {name: getattr(sub, name)[:, :length] for name in ("input_ids", "attention_mask", "response_mask",
                                                                  "old_logprobs", "advantages", "loss_weights")}
        if filler:
            cut["response_mask"] = torch.zeros_like(cut["response_mask"])
        return TrainBatch(**cut), values[rows, :length] * (0 if filler else 1)

    kept.put(*micro([3, 0], 5))
    assert not kept.complete()
    kept.put(*micro([3], 5, filler=True))  # a zero-weight copy of row 3, without response tokens
    kept.put(*micro([2, 1], 4))
    assert kept.complete()
    assert torch.equal(kept.logprobs, values)


# -- the same update, with and without the separate pass -------------------------------------------

def scored_rollouts(seed: int, prompts: int = 4) -> ScoredRollouts:
    """`prompts` groups of N rollouts of random tokens and lengths; group 0's rewards are all equal
    (advantage 0), the others' differ."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = [torch.randint(3, VOCAB, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(prompts)]
    rollouts, rewards = [], []
    for p in range(prompts):
        for s in range(N):
            length = int(torch.randint(2, 14, (1,), generator=g))
            tokens = torch.randint(3, VOCAB, (length,), generator=g).tolist()
            logprobs = (-torch.rand(length, generator=g) * 3).tolist()
            rollouts.append(Rollout(prompt_id=f"p{p}", sample=s, prompt_tokens=len(prompt_ids[p]), tokens=tokens,
                                    logprobs=logprobs, finish_reason=FinishReason.LENGTH))
            rewards.append(0.0 if p == 0 else float(s == p % N))
    batch = RolloutBatch(rollouts=rollouts, steps=[], prefill_s=0.0, wall_s=0.0, policy_version=0)
    return ScoredRollouts(problems=[], prompts=prompt_ids, batch=batch, rewards=torch.tensor(rewards), n=N)


class CountingActor:
    """An actor that records the rows of every no-grad log-prob pass it runs."""

    def __init__(self, actor) -> None:
        self.inner, self.passes = actor, []

    def logprobs(self, input_ids, attention_mask, **kw):
        self.passes.append(input_ids.clone())
        return self.inner.logprobs(input_ids, attention_mask, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def learner(model_dir, source: str, mini_batches: int, epochs: int, *overrides: str) -> tuple[Learner, CountingActor]:
    cfg = load_config(TrainConfig, None, ["model.path=unused", f"trainer.old_logprobs={source}",
                                          f"trainer.mini_batches={mini_batches}", f"trainer.ppo_epochs={epochs}",
                                          "rollout.max_new_tokens=16", "rollout.temperature=0.8", *overrides])
    actor_cfg = ActorConfig(lr=1e-3, grad_clip=0.5, micro_batch_tokens=48)
    actor = CountingActor(build_actor(actor_cfg, model_dir))
    reference = ReferencePolicy(actor_cfg, model_dir) if cfg.algorithm.kl_coef > 0 else None
    algo = build_algorithm(cfg.algorithm, cfg.rollout.max_new_tokens)
    return Learner(cfg.trainer, algo, cfg.actor, Ranks(), actor, pad_id=0, engine_old_logprobs=False,
                   reference=reference), actor


@pytest.mark.parametrize("mini_batches, epochs", [(1, 1), pytest.param(2, 1, marks=pytest.mark.slow),
                                                  pytest.param(1, 2, marks=pytest.mark.slow), (2, 2)])
def test_the_update_forwards_old_logprobs_learn_what_the_actor_pass_learns_step_by_step(
        model_dir, mini_batches, epochs):
    (today, a_today), (short, a_short) = (learner(model_dir, s, mini_batches, epochs) for s in ("actor", "auto"))
    assert (today.old_source, short.old_source) == ("actor", "update")
    for step in range(3):
        scored = scored_rollouts(seed=step)
        a_today.passes.clear()
        a_short.passes.clear()
        m_today, _, _ = today.train(scored, step)
        m_short, _, _ = short.train(scored, step)
        for key in ("train/loss", "train/pg_loss", "train/grad_norm"):
            assert m_short[key] == pytest.approx(m_today[key], rel=1e-5, abs=1e-7), (step, key)
        for (name, p), q in zip(a_today.model.named_parameters(), a_short.model.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7, msg=f"step {step}: {name}")
        assert m_today["train/grad_norm"] > 0
        # The separate pass covers every row; the shortcut only the rows of the second mini-batch
        # (rows 8-15: groups 2 and 3), and no row of group 0 (advantage 0: it never reaches the actor).
        assert [len(ids) for ids in a_today.passes] == [len(scored.batch)]
        batch = short.train_batch(scored)[0]
        later = list(range(8, 16)) if mini_batches == 2 else []
        assert [ids.tolist() for ids in a_short.passes] == ([batch.input_ids[later].tolist()] if later else [])
        if (mini_batches, epochs) == (1, 1):
            assert m_short["train/ratio_mean"] == 1.0 and m_short["train/approx_kl_old"] == 0.0


@pytest.mark.slow
def test_with_a_kl_term_the_update_forwards_old_logprobs_learn_what_the_actor_pass_learns(model_dir):
    # kl_coef > 0: every row reaches the actor (group 0's too), and the reference's log-probs are unchanged.
    (today, a_today), (short, a_short) = (learner(model_dir, s, 2, 1, "algorithm.kl_coef=0.1") for s in ("actor", "auto"))
    for step in range(2):
        scored = scored_rollouts(seed=10 + step)
        a_short.passes.clear()
        m_today, m_short = today.train(scored, step)[0], short.train(scored, step)[0]
        for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/kl"):
            assert m_short[key] == pytest.approx(m_today[key], rel=1e-5, abs=1e-7), (step, key)
        assert m_short["train/kl"] > 0 or step == 0
        assert [len(ids) for ids in a_short.passes] == [8]  # the second mini-batch, group 2's and 3's rows
    for (name, p), q in zip(a_today.model.named_parameters(), a_short.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7, msg=name)


def test_the_update_forward_measures_the_engine_mismatch_the_actor_pass_measures_over_the_same_rows(model_dir):
    # Every row through the actor in one mini-batch: the same rows as the separate pass.
    (today, _), (short, _) = (learner(model_dir, s, 1, 1, "trainer.skip_zero_advantage=false") for s in ("actor", "auto"))
    scored = scored_rollouts(seed=7)
    m_today, m_short = today.train(scored, 0)[0], short.train(scored, 0)[0]
    assert m_today["train/mismatch_kl"] > 0.1
    assert m_short["train/mismatch_kl"] == pytest.approx(m_today["train/mismatch_kl"], rel=1e-5)


# -- whole runs ----------------------------------------------------------------------------------

SHORTCUT = ["rollout.temperature=0.8"]  # T != 1: the engine's log-probs are not the policy's, auto takes the update's


@pytest.mark.slow
def test_with_the_update_forwards_old_logprobs_speculation_on_and_off_learn_exactly_the_same_run(
        char_model_dir, digits_task, tmp_path):
    from launch.run.build import run

    off = run(config(char_model_dir, tmp_path / "off", *SHORTCUT, "engine.spec.enabled=false"), Ranks())
    on = run(config(char_model_dir, tmp_path / "on", *SHORTCUT, "engine.spec.enabled=true", "engine.spec.drafter=ngram",
                    "engine.spec.max_active_batch=null"), Ranks())
    rows_off, rows_on = step_rows(off["run_dir"]), step_rows(on["run_dir"])
    assert len(rows_on) == len(rows_off) == 3
    for a, b in zip(rows_off, rows_on):
        assert {k: a[k] for k in (*LEARNED, "train/mismatch_kl")} == {k: b[k] for k in (*LEARNED, "train/mismatch_kl")}
        assert a["train/mismatch_kl"] > 0  # T = 0.8: the engine's sampling distribution is not the policy
    w_off, w_on = weights(off["run_dir"], 3), weights(on["run_dir"], 3)
    assert all(torch.equal(w_off[k], w_on[k]) for k in w_off)


@pytest.mark.slow
def test_a_run_with_the_update_forwards_old_logprobs_equals_the_actor_pass_run_within_float32_rounding(
        char_model_dir, digits_task, tmp_path):
    from launch.run.build import run

    runs = {s: run(config(char_model_dir, tmp_path / s, *SHORTCUT, "engine.spec.enabled=false",
                          f"trainer.old_logprobs={s}"), Ranks()) for s in ("actor", "auto")}
    rows = {s: step_rows(out["run_dir"]) for s, out in runs.items()}
    assert len(rows["actor"]) == len(rows["auto"]) == 3
    for a, b in zip(rows["actor"], rows["auto"]):
        assert a["reward/mean"] == b["reward/mean"]
        for key in ("train/pg_loss", "train/loss", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    wa, wb = weights(runs["actor"]["run_dir"], 3), weights(runs["auto"]["run_dir"], 3)
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-7) for k in wa)
