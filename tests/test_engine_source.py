"""A generate() fed by a RequestSource as its rows free up: the same tokens as requests given up front."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import SamplingParams
from engine.types import Request
from tests.test_engine import make_engine, prompts


class OneAtATime:
    """Hands out one request per pull while fewer than `inflight` rows are active; records the rows active then."""

    def __init__(self, requests, inflight):
        self.left, self.inflight, self.seen = list(requests), inflight, []

    def pull(self, active, free):
        self.seen.append(active)
        if not self.left:
            return None
        return [self.left.pop(0)] if active < self.inflight else []


def test_requests_pulled_as_rows_free_up_get_the_tokens_of_requests_given_up_front(hf_folders):
    engine = make_engine(hf_folders["llama"], max_batch=8)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5, stop_token_ids=(2,))
    requests = [Request(prompt_id=f"p{i}", prompt=p, n=2) for i, p in enumerate(prompts(6, seed=2))]
    upfront = engine.generate(requests, params)
    source = OneAtATime(requests[::-1], inflight=3)  # reversed: admission order is not request order
    pulled = engine.generate([], params, source=source)
    assert max(source.seen) <= 4  # one 2-sample request at a time below 3 active rows: the batch was fed, not filled
    assert [(r.prompt_id, r.sample) for r in pulled] == [(f"p{i}", k) for i in reversed(range(6)) for k in range(2)]
    by_key = {(r.prompt_id, r.sample): r for r in upfront}
    for r in pulled:
        assert r.tokens == by_key[(r.prompt_id, r.sample)].tokens
        assert r.logprobs == by_key[(r.prompt_id, r.sample)].logprobs


def test_a_source_that_starves_an_idle_engine_is_an_error(hf_folders):
    engine = make_engine(hf_folders["llama"])

    class Stuck:
        def pull(self, active, free):
            return []

    with pytest.raises(RuntimeError, match="handed nothing to an idle engine"):
        engine.generate([], SamplingParams(max_new_tokens=4, temperature=1.0), source=Stuck())


def test_a_request_larger_than_the_batch_from_a_source_is_admitted_in_chunks(hf_folders):
    engine = make_engine(hf_folders["llama"], max_batch=4)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1)
    big = Request(prompt_id="big", prompt=[5, 6, 7], n=6)
    upfront = engine.generate([big], params)
    pulled = engine.generate([], params, source=OneAtATime([big], inflight=1))
    assert [r.tokens for r in pulled] == [r.tokens for r in upfront]
    assert torch.equal(torch.tensor([r.sample for r in pulled]), torch.arange(6))
