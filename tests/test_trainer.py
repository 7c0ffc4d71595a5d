"""The RL loop: speculation changes nothing that is learned, resume is exact, sync serves the new
policy, ranks run under torchrun, and bad input is named."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.config import load_config
from launch.run.config import TrainConfig
from launch.run.build import build_run, run
from pipeline.dist import Ranks
from pipeline.tasks import TASKS, Task, arith
from tests.conftest import digit_share

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def digits_task(monkeypatch):
    monkeypatch.setitem(TASKS, "digits", Task(name="digits", make_problems=arith.make_problems, reward=digit_share))


@contextlib.contextmanager
def built_run(cfg: TrainConfig):
    """The run of `cfg` built on one rank (launch.run.build.build_run), released afterwards."""
    built = build_run(cfg, Ranks())
    try:
        yield built
    finally:
        built.close()


def config(char_model_dir, out, *overrides) -> TrainConfig:
    base = [
        f"model.path={char_model_dir}", f"run.out_dir={out}", "task.name=digits", "task.train_problems=64",
        "task.eval_problems=4", "rollout.n=4", "rollout.max_new_tokens=24", "engine.max_batch=16", "engine.max_len=96",
        "trainer.steps=3", "trainer.prompts_per_step=4", "trainer.mini_batches=2", "trainer.eval_every=0",
        "actor.lr=1e-3", "actor.micro_batch_tokens=256", "metrics.wandb=false", "metrics.console=false",
        "metrics.dashboard=false", "engine.spec.depth=4", "engine.spec.verify_tokens=4", "spot.enabled=false",
        "engine.spec.tuner_arms=[]",
        # one rank, and the DAPO and asynchronous runs below (token shares and split groups need neither)
        "trainer.train_shares=shard", "rollout.split_groups=false",
    ]
    return load_config(TrainConfig, REPO / "configs" / "tiny.yaml", [*base, *overrides])


def step_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "timing/step" in r]


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "checkpoints" / f"step-{step}" / "actor" / "model.safetensors"))


LEARNED = ("reward/mean", "reward/std", "train/pg_loss", "train/grad_norm", "rollout/response_length/mean",
           "rollout/response_length/max")


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["eagle", "ngram"])
def test_speculation_on_and_off_learn_exactly_the_same_run(char_model_dir, char_drafter_dir, digits_task, tmp_path, drafter):
    off = run(config(char_model_dir, tmp_path / "off", "engine.spec.enabled=false"), Ranks())
    on = run(config(char_model_dir, tmp_path / "on", "engine.spec.enabled=true", f"engine.spec.drafter={drafter}",
                    f"engine.spec.drafter_path={char_drafter_dir}", "engine.spec.max_active_batch=null"), Ranks())
    rows_off, rows_on = step_rows(off["run_dir"]), step_rows(on["run_dir"])
    assert len(rows_on) == len(rows_off) == 3
    assert all(r["spec/accept_len"] >= 1 for r in rows_on) and not any("spec/accept_len" in r for r in rows_off)
    for a, b in zip(rows_off, rows_on):
        assert {k: a[k] for k in LEARNED} == {k: b[k] for k in LEARNED}
    w_off, w_on = weights(off["run_dir"], 3), weights(on["run_dir"], 3)
    initial = weights_of(char_model_dir)
    assert any(not torch.equal(w_off[k], initial[k]) for k in w_off)  # the policy did move
    assert all(torch.equal(w_off[k], w_on[k]) for k in w_off)


def weights_of(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


@pytest.mark.slow
def test_resume_from_a_step_2_checkpoint_equals_the_uninterrupted_run_at_step_4(char_model_dir, digits_task, tmp_path):
    full = run(config(char_model_dir, tmp_path / "full", "trainer.steps=4", "trainer.save_every=2",
                      "engine.spec.enabled=false"), Ranks())
    first = run(config(char_model_dir, tmp_path / "cut", "trainer.steps=2", "engine.spec.enabled=false"), Ranks())
    ckpt = Path(first["run_dir"]) / "checkpoints" / "step-2"
    resumed = run(config(char_model_dir, tmp_path / "cut", "trainer.steps=4", f"trainer.resume={ckpt}",
                         "engine.spec.enabled=false"), Ranks())
    assert resumed["run_dir"] == first["run_dir"]
    rows_full, rows_cut = step_rows(full["run_dir"]), step_rows(resumed["run_dir"])
    assert [r["step"] for r in rows_cut] == [1, 2, 3, 4]  # steps 3-4 appended after the resumed point
    for a, b in zip(rows_full, rows_cut):
        assert {k: a[k] for k in LEARNED} == {k: b[k] for k in LEARNED}
    w_full, w_cut = weights(full["run_dir"], 4), weights(resumed["run_dir"], 4)
    assert all(torch.equal(w_full[k], w_cut[k]) for k in w_full)
    for name in ("rollouts.jsonl", "decode_steps.jsonl"):  # the simulator's records: no step twice, none lost
        lines = lambda run: [json.loads(x) for x in (Path(run["run_dir"]) / name).read_text().splitlines()]  # noqa: E731
        drop = lambda rows: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]  # noqa: E731
        assert drop(lines(full)) == drop(lines(resumed))


def test_after_a_sync_the_engine_serves_the_actors_weights(char_model_dir, digits_task, tmp_path):
    with built_run(config(char_model_dir, tmp_path, "engine.spec.enabled=false")) as built:
        trainer, engine, actor = built.trainer, built.engine, built.actor
        result = trainer.step()
        assert engine.version == 1 and all(r.policy_version == 0 for r in result.rollouts.batch)
        ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10]])
        with torch.no_grad():
            want = actor.model(input_ids=ids).logits
            got = engine.runtime(ids, torch.arange(ids.shape[1])[None]).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        again = trainer.step()
        assert all(r.policy_version == 1 for r in again.rollouts.batch) and engine.version == 2


def test_with_bf16_weights_the_engine_serves_the_rounded_actor_and_the_actor_recomputes_old_logprobs(
        char_model_dir, digits_task, tmp_path):
    from engine.kernels.library import available

    if not available()[0]:
        pytest.skip(f"engine.weights=bfloat16 needs the CPU kernels: {available()[1]}")
    with pytest.raises(ValueError, match="engine.weights=bfloat16"):
        config(char_model_dir, tmp_path, "engine.weights=bfloat16", "trainer.old_logprobs=engine")
    with built_run(config(char_model_dir, tmp_path, "engine.spec.enabled=false", "engine.weights=bfloat16")) as built:
        trainer, engine, actor = built.trainer, built.engine, built.actor
        assert not trainer.learner.engine_old_logprobs
        result = trainer.step()
        assert result.metrics["train/mismatch_kl"] > 1e-9  # the bf16-rounded policy samples, the fp32 actor trains
        served = dict(engine.model.named_parameters())
        for name, w in actor.named_weights():
            if name in served and w.dim() >= 2:
                assert torch.equal(served[name].detach(), w.detach().cpu().bfloat16().float()), name


def test_a_non_finite_reward_is_an_error_naming_the_prompt(char_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(TASKS, "nan", Task(name="nan", make_problems=arith.make_problems, reward=lambda t, a: float("nan")))
    with pytest.raises(ValueError, match="reward nan of prompt .* is not a finite number"):
        run(config(char_model_dir, tmp_path, "task.name=nan", "engine.spec.enabled=false", "trainer.steps=1"), Ranks())


def test_a_malformed_config_key_is_named(char_model_dir, tmp_path):
    with pytest.raises(ValueError, match="trainer.stepz"):
        config(char_model_dir, tmp_path, "trainer.stepz=3")
    with pytest.raises(ValueError, match="trainer.old_logprobs=engine"):
        config(char_model_dir, tmp_path, "trainer.old_logprobs=engine", "trainer.async_steps=1")


def test_an_incomplete_checkpoint_folder_is_refused(char_model_dir, digits_task, tmp_path):
    folder = tmp_path / "checkpoints" / "step-2"
    folder.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="step-2 has no state.json"):
        run(config(char_model_dir, tmp_path, f"trainer.resume={folder}", "engine.spec.enabled=false"), Ranks())


@pytest.mark.slow
def test_two_ranks_under_torchrun_roll_out_their_shards_and_train_together(char_model_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "launch.train",
           "--config", str(REPO / "configs" / "tiny.yaml"), f"model.path={char_model_dir}", f"run.out_dir={tmp_path}",
           "task.train_problems=64", "task.eval_problems=4", "rollout.n=4", "rollout.max_new_tokens=16",
           "engine.max_batch=16", "engine.max_len=96", "engine.spec.enabled=false", "spot.enabled=false", "trainer.steps=2",
           "trainer.prompts_per_step=4", "trainer.eval_every=0", "actor.micro_batch_tokens=256", "metrics.wandb=false",
           "metrics.dashboard=false"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = list(tmp_path.iterdir())
    assert (run_dir / "rank0.log").is_file() and (run_dir / "rank1.log").is_file()
    rows = step_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(r["world_size"] == 2 for r in rows)
    assert all({"timing/rollout/rank0", "timing/rollout/rank1", "timing/idle/rank0", "timing/idle/rank1"} <= r.keys() for r in rows)
    # the prompts' prefill is part of each rank's rollout time (the simulator calibrates it)
    assert all(0 < r[f"timing/prefill/rank{k}"] < r[f"timing/rollout/rank{k}"] for r in rows for k in (0, 1))
    assert all(r["rollout/batch_size"] == 16 for r in rows)  # 4 prompts x 4 samples over both ranks
    assert (run_dir / "checkpoints" / "step-2" / "state.json").is_file()
    rollouts = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert sorted((r["step"], r["rank"]) for r in rollouts) == sorted([(s, k) for s in (1, 2) for k in (0, 1)] * 8)
    assert all(r["prompt_len"] > 0 for r in rollouts)
    by_prompt = {}
    for r in rollouts:  # one prompt length per prompt: its samples share it
        by_prompt.setdefault((r["step"], r["prompt_id"]), set()).add(r["prompt_len"])
    assert all(len(v) == 1 for v in by_prompt.values())


@pytest.mark.slow
def test_one_step_asynchronous_mode_trains_on_rollouts_one_policy_behind(char_model_dir, digits_task, tmp_path):
    sync = run(config(char_model_dir, tmp_path / "sync", "engine.spec.enabled=false"), Ranks())
    # The update in float32, as the engine computes: bf16-mixed (configs/tiny.yaml's auto on a CPU with
    # bf16 dot products) would put its own ~1e-5 into step 1's mismatch.
    lag = run(config(char_model_dir, tmp_path / "async", "engine.spec.enabled=false", "trainer.async_steps=1",
                     "actor.precision=float32"), Ranks())
    rows_sync, rows_async = step_rows(sync["run_dir"]), step_rows(lag["run_dir"])
    # Step 1 trains on the same rollouts; from step 2 on, async ones come from the policy before step 1's update.
    assert rows_async[0]["reward/mean"] == rows_sync[0]["reward/mean"]
    assert rows_async[1]["reward/mean"] != rows_sync[1]["reward/mean"]
    # The actor recomputes the old log-probs: at step 1 they equal the engine's (same weights), later the
    # behaviour policy is one update behind and the measured mismatch is the policy's move.
    assert abs(rows_async[0]["train/mismatch_kl"]) < 1e-6
    assert all(r["train/mismatch_kl"] > 1e-6 for r in rows_async[1:])


@pytest.mark.slow
def odd_answers_only(text: str, answer: str) -> float:
    """digit_share for problems with an odd answer, 0 for the others: their groups' rewards never differ."""
    return digit_share(text, answer) if int(answer) % 2 else 0.0


def test_dapo_refills_the_batch_with_groups_whose_rewards_differ(char_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(TASKS, "odd", Task(name="odd", make_problems=arith.make_problems, reward=odd_answers_only))
    out = run(config(char_model_dir, tmp_path, "engine.spec.enabled=false", "algorithm.name=dapo", "trainer.steps=2",
                     "task.name=odd"), Ranks())
    rows = step_rows(out["run_dir"])
    assert len(rows) == 2 and all("train/pg_clipfrac_high" in r for r in rows)
    for r in rows:  # a full batch (4 prompts x 4 samples), every group informative, what was dropped counted
        assert r["rollout/batch_size"] == 16 and r["train/zero_std_groups"] == 0, r
        assert r["train/dynamic_sampling_dropped"] > 0 and r["train/dynamic_sampling_rounds"] >= 2, r
    answers = {p.id: p.answer for p in arith.make_problems("train", 64, 0)}  # the run's problems (task.train_problems, run.seed)
    trained = [json.loads(line) for line in (Path(out["run_dir"]) / "rollouts.jsonl").read_text().splitlines()]
    assert trained and all(int(answers[row["prompt_id"]]) % 2 for row in trained)  # only odd-answer prompts were trained on


def test_dynamic_sampling_that_cannot_fill_the_batch_stops_the_run_naming_the_key(char_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(TASKS, "flat", Task(name="flat", make_problems=arith.make_problems, reward=lambda text, answer: 1.0))
    with pytest.raises(ValueError, match="algorithm.max_sampling_rounds"):
        run(config(char_model_dir, tmp_path, "engine.spec.enabled=false", "algorithm.name=dapo", "task.name=flat",
                   "algorithm.max_sampling_rounds=2"), Ranks())
