"""The length-aware draft budget: long rows draft deeper, short rows at the arm's depth, no token changes."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.sampling import SamplingParams
from engine.spec.config import SpecConfig
from engine.spec.drafter import DraftShape
from engine.spec.policy import FixedPolicy
from engine.spec.tree import DraftTree
from engine.spec.tuner import parse_arm
from engine.types import Request
from tests.spec_drafters import OracleDrafter

PARAMS = SamplingParams(max_new_tokens=30, temperature=1.0, seed=3, step=1, stop_token_ids=(2,))


@pytest.fixture(scope="module")
def target(hf_folders):
    from engine.checkpoint import load_checkpoint

    return load_checkpoint(hf_folders["llama"], dtype=torch.float64)


def requests(predicted: dict[str, int] | None = None) -> list[Request]:
    g = torch.Generator().manual_seed(7)
    return [Request(prompt_id=f"p{i}", prompt=torch.randint(3, 101, (4 + i,), generator=g).tolist(), n=2,
                    predicted_len=(predicted or {}).get(f"p{i}")) for i in range(3)]


def engine(target, drafter=None, policy=None) -> RolloutEngine:
    spec = SpecConfig(depth=2, verify_tokens=2, max_depth=6, max_verify_tokens=6, long_row_tokens=8)
    return RolloutEngine(target, EngineConfig(max_batch=8, max_len=96, spec=spec), drafter, policy=policy)


def test_an_arm_label_with_a_budget_parses_and_prints_back():
    arm = parse_arm("d8k1v8L16")
    assert (arm.depth, arm.verify_tokens, arm.long_depth, arm.label) == (8, 8, 16, "d8k1v8L16")
    assert arm.for_long_rows().label == "d16k1v16"
    for bad in ("d8k2v8L16", "d8k1v8L4"):
        with pytest.raises(ValueError, match="length-aware budget"):
            parse_arm(bad)
    with pytest.raises(ValueError, match="engine.spec.max_depth"):
        DraftShape(depth=2, verify_tokens=2, long_depth=12).check_within(DraftShape(depth=8, verify_tokens=8))


def test_cut_chains_keeps_each_rows_first_nodes_and_shrinks_the_width():
    pt = DraftTree.chains(torch.arange(12).view(2, 6)).padded()
    cut = pt.cut_chains(torch.tensor([2, 4]))
    assert cut.width == 4 and cut.valid.sum(1).tolist() == [2, 4]
    assert cut.tokens.tolist() == [[0, 1, 0, 0], [6, 7, 8, 9]]
    assert cut.depth.tolist() == [[1, 2, 0, 0], [1, 2, 3, 4]]


def test_long_rows_draft_deeper_and_no_token_changes(target):
    reference = engine(target).generate(requests(), PARAMS)
    budget = FixedPolicy(DraftShape(depth=2, verify_tokens=2, long_depth=6))
    batch = engine(target, OracleDrafter(reference), budget).generate(requests({"p1": 20}), PARAMS)
    assert [(r.prompt_id, r.sample, r.tokens) for r in batch] == [(r.prompt_id, r.sample, r.tokens) for r in reference]
    first = batch.steps[0]  # nothing generated yet beyond the first token: only p1's rows are predicted long
    assert first.drafted == [2, 2, 6, 6, 2, 2]
    assert all(s.shape == "d2k1v2L6" for s in batch.steps)
    # Once a row has generated long_row_tokens (8) it is long too: with an oracle, fewer decode steps.
    plain = engine(target, OracleDrafter(reference), FixedPolicy(DraftShape(depth=2, verify_tokens=2)))
    plain_steps = plain.generate(requests({"p1": 20}), PARAMS).steps
    assert max(d for s in plain_steps for d in s.drafted) == 2
    assert len(batch.steps) < len(plain_steps)


def test_the_fixed_shapes_budget_is_validated_naming_the_key():
    SpecConfig(depth=4, verify_tokens=4, max_depth=8, max_verify_tokens=8, long_depth=8).validate()
    for bad in ({"long_depth": 4}, {"long_depth": 12}, {"long_depth": 8, "topk": 2}):
        with pytest.raises(ValueError, match="engine.spec.long_depth"):
            SpecConfig(**{"depth": 4, "verify_tokens": 4, "max_depth": 8, "max_verify_tokens": 8, **bad}).validate()
