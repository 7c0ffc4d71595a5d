"""Bubble drafts: the next step's rollouts pre-generated with its noise keys are its rollouts
under an unchanged policy (accepted in full), stay exact under a changed one, survive
preemption as prefixes, and the store keeps its bound."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.sampling import SamplingParams
from engine.spec.compose import FallbackDrafter
from engine.spec.config import SpecConfig
from engine.spec.eagle import EagleConfig, EagleModel
from engine.spec.eagle_drafter import EagleDrafter
from engine.spec.pregenerated import PregeneratedDrafter
from engine.types import FinishReason, Request, Rollout
from pipeline.drafts.bubble import BubbleConfig, BubbleStore, BubbleWork, common_prefix, coverage_metrics
from common.idle import IdleWindow

DEPTH = 6


def params(step: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=40, temperature=1.0, seed=11, step=step, stop_token_ids=(2,))


def requests(drafts=None) -> list[Request]:
    return [Request(prompt_id=f"p{i}", prompt=[5 + i, 9, 4 + i, 7], n=3, drafts=(drafts or {}).get(f"p{i}"))
            for i in range(3)]


@pytest.fixture
def target(hf_folders):
    return load_checkpoint(hf_folders["llama"])


def bubble_engine(target) -> RolloutEngine:
    torch.manual_seed(0)
    eagle = EagleDrafter(EagleModel(EagleConfig.for_target(target.config), target))
    spec = SpecConfig(depth=DEPTH, topk=1, verify_tokens=DEPTH)
    return RolloutEngine(target, EngineConfig(max_batch=16, max_len=128, spec=spec),
                         FallbackDrafter([PregeneratedDrafter(), eagle]))


def by_key(batch) -> dict[tuple[str, int], list[int]]:
    return {(r.prompt_id, r.sample): r.tokens for r in batch}


def as_drafts(tokens: dict[tuple[str, int], list[int]]) -> dict[str, dict[int, list[int]]]:
    out: dict[str, dict[int, list[int]]] = {}
    for (pid, s), t in tokens.items():
        out.setdefault(pid, {})[s] = t
    return out


def test_drafts_pregenerated_with_the_next_steps_noise_are_accepted_in_full_under_the_same_policy(target):
    pre = by_key(RolloutEngine(target, EngineConfig(max_batch=16, max_len=128)).generate(requests(), params(step=4)))
    batch = bubble_engine(target).generate(requests(as_drafts(pre)), params(step=4))
    assert by_key(batch) == pre
    assert all(s.accepted == s.drafted for s in batch.steps)  # every drafted token accepted
    from pipeline.drafts.bubble import draft_metrics

    m = draft_metrics(batch.steps)  # every row drafted by the pregenerated part (source 0), none by EAGLE
    assert all(src == 0 for s in batch.steps for src in s.source)
    assert m["bubble/decode_steps_saved"] == sum(sum(s.accepted) for s in batch.steps) > 0
    assert m["bubble/accept_len"] == pytest.approx(batch.stats.accept_len)
    longest = max(len(t) for t in pre.values())
    assert len(batch.steps) <= -(-longest // (DEPTH + 1)) + 1  # ~L / (D + 1) target passes, not L


def test_drafts_of_another_step_or_an_updated_policy_are_accepted_less_and_change_no_token(target):
    pre = by_key(RolloutEngine(target, EngineConfig(max_batch=16, max_len=128)).generate(requests(), params(step=4)))
    torch.manual_seed(1)
    moved = {n: p + 0.05 * p.std() * torch.randn_like(p) for n, p in target.state_dict().items()}
    e = bubble_engine(target)
    e.load_weights(moved, version=1)  # one "policy update" later
    reference = by_key(RolloutEngine(e.model, EngineConfig(max_batch=16, max_len=128)).generate(requests(), params(step=4)))
    batch = e.generate(requests(as_drafts(pre)), params(step=4))
    assert by_key(batch) == reference  # the target decides every token
    accepted, drafted = sum(sum(s.accepted) for s in batch.steps), sum(sum(s.drafted) for s in batch.steps)
    assert 0 < accepted < drafted
    other_step = bubble_engine(target).generate(requests(as_drafts(pre)), params(step=5))  # not this step's noise
    same_step = bubble_engine(target).generate(requests(as_drafts(pre)), params(step=4))
    assert other_step.stats.accept_len < same_step.stats.accept_len


def test_under_the_tuner_bubble_drafts_take_the_depth_it_chooses_and_change_no_token(target):
    pre = by_key(RolloutEngine(target, EngineConfig(max_batch=16, max_len=128)).generate(requests(), params(step=4)))
    torch.manual_seed(0)
    eagle = EagleDrafter(EagleModel(EagleConfig.for_target(target.config), target))
    spec = SpecConfig(depth=DEPTH, topk=1, verify_tokens=DEPTH, tuner_arms=["off", "d2k1v2", f"d{DEPTH}k1v{DEPTH}"],
                      tuner_epsilon=0.5)
    e = RolloutEngine(target, EngineConfig(max_batch=16, max_len=128, spec=spec), FallbackDrafter([PregeneratedDrafter(), eagle]))
    batch = e.generate(requests(as_drafts(pre)), params(step=4))
    assert by_key(batch) == pre
    assert {s.shape for s in batch.steps} == {"off", "d2k1v2", f"d{DEPTH}k1v{DEPTH}"}  # every arm ran
    for s in batch.steps:  # and drafted within its depth (a draft that runs out gives fewer)
        depth = 0 if s.shape == "off" else int(s.shape[1:].split("k")[0])
        assert max(s.drafted, default=0) <= depth
    assert max(max(s.drafted) for s in batch.steps if s.shape == f"d{DEPTH}k1v{DEPTH}") == DEPTH


def window(step: int, stop_after: int | None) -> IdleWindow:
    calls = []

    def others_done() -> bool:
        calls.append(1)
        return stop_after is not None and len(calls) > stop_after

    return IdleWindow(step=step, rank=0, world=1, started=0.0, others_done=others_done, all_done_at=lambda: 0.0,
                      opened_last=False)


def test_a_preempted_pregeneration_keeps_prefixes_of_the_next_steps_rollouts(target):
    e = RolloutEngine(target, EngineConfig(max_batch=4, max_len=128))  # 9 rows > 4 slots: some never start
    store = BubbleStore(max_tokens=10_000)
    work = BubbleWork(e, lambda: requests(), params, store, BubbleConfig(order="loader"))
    assert work.work(window(step=3, stop_after=5)) == {}  # the last rank finishes 5 decode steps in; no collective
    metrics = work.settle()
    full = by_key(RolloutEngine(target, EngineConfig(max_batch=16, max_len=128)).generate(requests(), params(step=4)))
    assert 0 < metrics["bubble/preempted"] and 0 < len(store.drafts) < len(full)
    for key, tokens in store.drafts.items():
        assert full[key][: len(tokens)] == tokens  # step 4's own tokens, as far as they got
    assert store.take(4) and store.take(4) == {}  # handed out once
    assert BubbleStore(100).take(7) == {}


def test_the_store_keeps_its_token_bound_and_one_step():
    store = BubbleStore(max_tokens=10)
    ro = lambda pid, s, n: Rollout(prompt_id=pid, sample=s, prompt_tokens=1, tokens=list(range(n)),  # noqa: E731
                                   logprobs=[0.0] * n, finish_reason=FinishReason.STOP)
    assert store.put(2, [ro("a", 0, 6), ro("a", 1, 6), ro("b", 0, 4)]) == 2  # a/1 would pass the bound
    assert store.tokens == 10 and sorted(store.drafts) == [("a", 0), ("b", 0)]
    assert store.put(3, [ro("c", 0, 3)]) == 1 and sorted(store.drafts) == [("c", 0)]  # a new step replaces the old
    assert store.take(2) == {} and store.tokens == 0


def test_coverage_counts_rows_tokens_and_the_matching_prefix():
    mk = lambda pid, s, t: Rollout(prompt_id=pid, sample=s, prompt_tokens=1, tokens=t, logprobs=[0.0] * len(t),  # noqa: E731
                                   finish_reason=FinishReason.STOP)
    rollouts = [mk("a", 0, [1, 2, 3, 4]), mk("a", 1, [1, 2]), mk("b", 0, [5, 6, 7, 8])]
    m = coverage_metrics({"a": {0: [1, 2, 9, 9, 9], 1: [1]}}, rollouts)
    assert m["bubble/coverage"] == pytest.approx(2 / 3)
    assert m["bubble/token_coverage"] == pytest.approx((4 + 1) / 10)
    assert m["bubble/prefix_match"] == pytest.approx((2 / 4 + 1 / 2) / 2)
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3 and common_prefix([], [1]) == 0


def test_bubble_needs_a_pregenerated_drafter_and_synchronous_steps():
    from common.config import load_config
    from launch.run.config import TrainConfig
    from tests.conftest import REPO

    with pytest.raises(ValueError, match="pregenerated"):
        load_config(TrainConfig, REPO / "configs" / "tiny.yaml", ["bubble.enabled=true"])
    with pytest.raises(ValueError, match="async_steps"):
        load_config(TrainConfig, REPO / "configs" / "tiny.yaml", ["bubble.enabled=true", "engine.spec.drafter=pregenerated+eagle",
                                                                  "trainer.async_steps=1"])


@pytest.mark.slow
def test_a_two_rank_run_with_bubble_drafts_is_the_run_without_them(char_model_dir, tmp_path, monkeypatch):
    import json

    from tests.test_spot_loop import two_rank_run
    from tests.test_trainer import step_rows

    # Rank 1 rolls out 0.5 s longer every step (tests.mp.slow_rank_train), so rank 0 has a window to
    # pre-generate in on a busy host too; the delay changes no token.
    monkeypatch.setenv("TAILSPEC_TEST_DELAY", "0.5")
    runs = {}
    for name, extra, module in (("bubble", ["bubble.enabled=true", "engine.spec.drafter=pregenerated+eagle"],
                                 "tests.mp.slow_rank_train"), ("plain", [], "launch.train")):
        (tmp_path / name).mkdir()
        runs[name] = two_rank_run(char_model_dir, tmp_path / name, "spot.enabled=false", *extra, module=module)
    with_bubble, plain = step_rows(runs["bubble"]), step_rows(runs["plain"])
    for a, b in zip(with_bubble, plain):
        assert a["reward/mean"] == b["reward/mean"] and a["train/pg_loss"] == b["train/pg_loss"]
    assert all({"bubble/pregen_s", "bubble/pregenerated"} <= r.keys() for r in with_bubble)
    assert any("bubble/coverage" in r for r in with_bubble[1:])  # steps 2 and 3 were pre-generated for
    assert any(r.get("bubble/decode_steps_saved", 0) > 0 for r in with_bubble[1:])
    rollouts = lambda d: sorted(json.dumps(x, sort_keys=True) for x in map(json.loads, (d / "rollouts.jsonl").read_text().splitlines()))  # noqa: E731
    assert rollouts(runs["bubble"]) == rollouts(runs["plain"])


@pytest.mark.slow
def test_with_spot_training_too_each_window_pregenerates_for_its_share_then_trains(char_model_dir, tmp_path, monkeypatch):
    from tests.test_trainer import step_rows
    from tests.test_spot_loop import two_rank_run

    # Rank 1 rolls out 1 s longer every step (tests.mp.slow_rank_train): rank 0 has a window to split,
    # long against the timing noise of a busy 2-core host.
    monkeypatch.setenv("TAILSPEC_TEST_DELAY", "1.0")
    run_dir = two_rank_run(char_model_dir, tmp_path, "bubble.enabled=true", "bubble.share=0.5",
                           "engine.spec.drafter=pregenerated+eagle", "spot.enabled=true", "spot.rows_per_step=4",
                           "spot.window=64", "trainer.steps=4", module="tests.mp.slow_rank_train")
    rows = step_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows[1:]:  # from step 2 on, each rank expects a window: pre-generation gets half of it, spot training the rest
        assert r["spot/micro_steps"] > 0, r
        assert 0 < r["bubble/pregen_s"] <= r["bubble/budget_s"] + 0.05, r  # within one decode step's estimate
        assert r["bubble/budget_s"] < r["bubble/idle_s"], r
