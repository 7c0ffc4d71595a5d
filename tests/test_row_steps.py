"""Row identities in the engine's step records, and accept lengths compared on the same tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.row_steps import accept_on, finished_only, row_step_tokens
from engine.sampling import SamplingParams
from engine.spec.compose import FallbackDrafter
from engine.spec.config import SpecConfig
from engine.spec.history import history_counts, history_drafted, history_metrics
from engine.spec.ngram import NgramDrafter
from engine.types import FinishReason, Rollout, RolloutBatch, StepRecord
from tests.spec_drafters import OracleDrafter
from tests.test_spec import history, requests

PARAMS = SamplingParams(max_new_tokens=40, temperature=1.0, seed=5, stop_token_ids=(2,))


@pytest.fixture(scope="module")
def target(hf_folders):
    return load_checkpoint(hf_folders["llama"], dtype=torch.float64)


def generate(target, drafter=None, max_batch: int = 5):
    """Fewer slots than rows (12): rows finish and others take their slots, so slot order moves."""
    cfg = EngineConfig(max_batch=max_batch, max_len=128, spec=SpecConfig(depth=4, topk=1, verify_tokens=4))
    return RolloutEngine(target, cfg, drafter).generate(requests(), PARAMS)


def test_every_row_step_is_known_by_its_sample_and_covers_each_response_token_after_the_first_once(target):
    batch = generate(target, NgramDrafter())
    costs = row_step_tokens(batch)
    expected = {(r.prompt_id, r.sample, pos) for r in batch.rollouts for pos in range(1, len(r.tokens))}
    assert set(costs) == expected and len(batch.rollouts) == 12
    assert all(len(s.rollout) == s.batch_size for s in batch.steps)
    slots = {}  # rollout -> the slots it held: retirement compacts rows, so identities are not slot numbers
    for s in batch.steps:
        for slot, r in enumerate(s.rollout):
            slots.setdefault(r, set()).add(slot)
    assert any(len(held) > 1 for held in slots.values())
    # the row-steps' mean emitted tokens is the accept length over all of them
    row_steps = sum(s.batch_size for s in batch.steps)
    assert accept_on(costs, costs) == pytest.approx(sum(map(sum, (s.emitted for s in batch.steps))) / row_steps)


def test_autoregressive_decoding_costs_one_step_a_token_on_any_tokens(target):
    reference = generate(target)
    plain = row_step_tokens(reference)
    spec = row_step_tokens(generate(target, OracleDrafter(reference.rollouts)))
    assert set(plain) == set(spec)  # the same tokens, speculation being exact
    assert accept_on(spec, plain) == 1.0
    assert accept_on(spec, spec) > 3.0  # the oracle's drafts of depth 4 are accepted whole, but near the ends


def test_a_history_way_on_its_own_drafted_tokens_is_its_history_accept_length(target):
    reference = generate(target)
    batch = generate(target, FallbackDrafter([history(reference.rollouts), NgramDrafter()]))
    drafted = row_step_tokens(batch, history_drafted(0))
    metrics = history_metrics(history_counts(batch.steps, 0))
    assert drafted and accept_on(drafted, row_step_tokens(batch)) == pytest.approx(metrics["spec/history_accept_len"])
    # another way on the same tokens: autoregressive decoding spent one step a token there
    assert accept_on(drafted, row_step_tokens(reference)) == 1.0


def test_a_token_another_way_did_not_emit_is_an_error_naming_it(target):
    costs = row_step_tokens(generate(target))
    with pytest.raises(KeyError, match="same requests"):
        accept_on({("elsewhere", 0, 3): 1.0}, costs)


def record(rollout: list[int], emitted: list[int]) -> StepRecord:
    b = len(rollout)
    return StepRecord(index=0, batch_size=b, shape="d2k1v2", drafted=[2] * b, accepted=[e - 1 for e in emitted],
                      emitted=emitted, context_mean=0.0, draft_s=0.0, forward_s=0.0, other_s=0.0, rollout=rollout)


def test_a_preempted_call_renumbers_its_rows_to_the_rollouts_it_returns():
    done = lambda pid: Rollout(prompt_id=pid, sample=0, prompt_tokens=1, tokens=[7, 7, 7],  # noqa: E731
                               logprobs=[0.0] * 3, finish_reason=FinishReason.PREEMPTED)
    rollouts, steps = finished_only([done("a"), None, done("c")], [record([0, 1, 2], [2, 1, 2])])
    assert [r.prompt_id for r in rollouts] == ["a", "c"] and steps[0].rollout == [0, -1, 1]
    batch = RolloutBatch(rollouts=rollouts, steps=steps, prefill_s=0.0, wall_s=0.0, policy_version=0)
    assert set(row_step_tokens(batch)) == {("a", 0, 1), ("a", 0, 2), ("c", 0, 1), ("c", 0, 2)}


def test_records_without_row_identities_are_refused_by_name():
    unnamed = dataclasses.replace(record([0], [1]), rollout=None)
    batch = RolloutBatch(rollouts=[], steps=[unnamed], prefill_s=0.0, wall_s=0.0, policy_version=0)
    with pytest.raises(ValueError, match="no rollout per row"):
        row_step_tokens(batch)
