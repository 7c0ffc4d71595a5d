"""common.optim's training step and schedules, and the RL actor's learning rate over its steps
(the schedule, the run's log line, set_lr on the actor, the learner's per-step rate)."""

from __future__ import annotations

import pytest
import torch

from common.optim import make_adamw, scheduled_lr, train_step, warmup_cosine
from pipeline.actors import ActorConfig
from tests.mp.actor_worker import make_batch, pg_loss
from tests.test_actors import actor, model_dir  # noqa: F401 (a fixture)


def test_train_step_is_the_pretrain_step_and_warmup_cosine_its_schedule():
    from pipeline.pretrain import PretrainConfig, lr_at

    cfg = PretrainConfig(steps=100, warmup_steps=10)
    for step in (0, 9, 10, 55, 99):
        progress = (step - cfg.warmup_steps) / (cfg.steps - cfg.warmup_steps)
        assert warmup_cosine(cfg.lr, step, cfg.warmup_steps, progress, cfg.min_lr_ratio) == lr_at(cfg, step)
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    x = torch.randn(5, 4)
    opt = make_adamw(nets[0].parameters(), lr=0.1, weight_decay=0.1)
    norm = train_step(nets[0](x).pow(2).sum(), opt, list(nets[0].parameters()), grad_clip=0.5)
    decay = [p for p in nets[1].parameters() if p.dim() >= 2]
    ref = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [p for p in nets[1].parameters() if p.dim() < 2], "weight_decay": 0.0}],
                            lr=0.1, betas=(0.9, 0.95))
    nets[1](x).pow(2).sum().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(nets[1].parameters(), 0.5)
    ref.step()
    assert norm == float(ref_norm) and norm > 0.5
    assert all(torch.equal(a, b) for a, b in zip(nets[0].parameters(), nets[1].parameters()))


def test_the_rl_schedule_warms_up_linearly_then_holds_or_falls_by_cosine_to_its_floor_at_the_last_step():
    lr, steps = 1e-4, 30
    constant = [scheduled_lr(lr, "constant", s, steps, 0, 0.1) for s in range(steps)]
    assert constant == [lr] * steps
    cosine = [scheduled_lr(lr, "cosine", s, steps, 0, 0.1) for s in range(steps)]
    assert cosine[0] == lr and cosine[-1] == pytest.approx(0.1 * lr, rel=1e-12)
    assert all(a > b for a, b in zip(cosine, cosine[1:]))  # falls every step
    assert scheduled_lr(lr, "cosine", 15, 31, 0, 0.1) == pytest.approx(0.55 * lr, rel=1e-12)  # half way at mid-run
    warm = [scheduled_lr(lr, "cosine", s, steps, 4, 0.0) for s in range(steps)]
    assert warm[:5] == pytest.approx([lr / 4, lr / 2, 3 * lr / 4, lr, lr])  # 4 warmup steps, then the cosine's top
    assert warm[-1] == pytest.approx(0.0, abs=1e-20)
    assert [scheduled_lr(lr, "constant", s, steps, 2, 0.1) for s in range(3)] == [lr / 2, lr, lr]
    assert scheduled_lr(lr, "cosine", 0, 1, 0, 0.1) == lr  # a 1-step run trains at lr
    assert scheduled_lr(lr, "cosine", 45, steps, 0, 0.1) == pytest.approx(0.1 * lr)  # past its end: the floor
    with pytest.raises(ValueError, match="linear"):
        scheduled_lr(lr, "linear", 0, steps, 0, 0.1)


def test_the_runs_log_line_says_the_schedule_and_names_steps_past_its_horizon():
    assert ActorConfig(lr=1e-4).schedule_summary(30) is None
    assert ActorConfig(lr=1e-4, lr_warmup_steps=3).schedule_summary(30) == (
        "actor.lr_schedule=constant: a linear warmup over 3 steps, then 0.0001")
    cosine = ActorConfig(lr=1e-4, lr_schedule="cosine", lr_schedule_steps=30)
    assert cosine.schedule_summary(30) == "actor.lr_schedule=cosine: 0.0001 -> 1e-05 over steps 1-30"
    longer = cosine.schedule_summary(60)
    assert "steps 31-60 at 1e-05" in longer and "actor.lr_schedule_steps=30 < trainer.steps=60" in longer
    assert ActorConfig(lr=1e-4, lr_schedule="cosine").schedule_summary(12).endswith("over steps 1-12")


def test_set_lr_governs_the_next_updates_and_lr_zero_moves_no_weight(model_dir):
    batch = make_batch()
    a = actor(model_dir, micro_batch_tokens=20, weight_decay=0.1)
    before = {k: w.clone() for k, w in a.named_weights()}
    a.set_lr(0.0)
    a.update(batch, pg_loss)
    assert all(torch.equal(w, before[k]) for k, w in a.named_weights())
    a.set_lr(1e-3)
    a.update(batch, pg_loss)
    assert any(not torch.equal(w, before[k]) for k, w in a.named_weights())


def test_the_learner_takes_each_steps_learning_rate_from_the_schedule_over_the_runs_steps():
    from common.config import load_config
    from launch.run.config import TrainConfig
    from pipeline.algorithms import build_algorithm
    from pipeline.dist import Ranks
    from pipeline.update.learner import Learner

    def learner(cfg):
        algo = build_algorithm(cfg.algorithm, cfg.rollout.max_new_tokens)
        return Learner(cfg.trainer, algo, cfg.actor, Ranks(), actor=None, pad_id=0, engine_old_logprobs=True)

    cfg = load_config(TrainConfig, None, ["model.path=unused", "trainer.steps=10", "actor.lr=2e-4",
                                          "actor.lr_schedule=cosine", "actor.lr_min_ratio=0.25"])
    rates = [learner(cfg).lr_at(s) for s in range(10)]
    assert rates == [scheduled_lr(2e-4, "cosine", s, 10, 0, 0.25) for s in range(10)]
    assert rates[0] == 2e-4 and rates[9] == pytest.approx(5e-5)
    # a fixed horizon: a 10-step run follows the first 10 steps of a 30-step curve
    cfg30 = load_config(TrainConfig, None, ["model.path=unused", "trainer.steps=10", "actor.lr=2e-4",
                                            "actor.lr_schedule=cosine", "actor.lr_schedule_steps=30"])
    assert [learner(cfg30).lr_at(s) for s in range(10)] == [scheduled_lr(2e-4, "cosine", s, 30, 0, 0.1) for s in range(10)]
