"""The rollout engine: greedy equals transformers, batch-independence, stops, the shrinking batch."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.sampling import SamplingParams
from engine.types import Request
from tests.conftest import FAMILIES


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 101, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def make_engine(folder, dtype=torch.float32, **cfg) -> RolloutEngine:
    return RolloutEngine(load_checkpoint(folder, dtype=dtype), EngineConfig(**{"max_batch": 8, "max_len": 128, **cfg}))


def hf_greedy(hf, prompt: list[int], new: int, eos: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_equals_transformers_generate(family, hf_folders):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_folders[family]).eval()
    engine = make_engine(hf_folders[family], max_batch=4)  # 6 requests: slots are reused
    ps = prompts(6)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(2,))
    rollouts = engine.generate([Request(prompt_id=str(i), prompt=p) for i, p in enumerate(ps)], params)
    for ro, p in zip(rollouts, ps):
        expected = hf_greedy(hf, p, 24, eos=2)
        if 2 in expected:
            expected = expected[: expected.index(2) + 1]
        assert ro.tokens == expected


def test_sampled_rollout_does_not_depend_on_batch_composition(hf_folders):
    engine = make_engine(hf_folders["qwen2"], dtype=torch.float64)
    params = SamplingParams(max_new_tokens=30, temperature=1.0, top_p=0.9, seed=3)
    target = Request(prompt_id="target", prompt=[5, 9, 17, 4], n=1)
    alone = engine.generate([target], params)[0]
    others = [Request(prompt_id=f"o{i}", prompt=p, n=1) for i, p in enumerate(prompts(7, seed=1))]
    crowded = engine.generate(others[:3] + [target] + others[3:], params)[3]
    assert crowded.prompt_id == "target"
    assert crowded.tokens == alone.tokens
    assert crowded.logprobs == pytest.approx(alone.logprobs, abs=1e-9)


def test_samples_of_one_prompt_differ_and_come_in_order(hf_folders):
    engine = make_engine(hf_folders["llama"])
    params = SamplingParams(max_new_tokens=20, temperature=1.0)
    rollouts = engine.generate([Request(prompt_id="p", prompt=[5, 6, 7], n=4), Request(prompt_id="q", prompt=[8], n=3)], params)
    assert [(r.prompt_id, r.sample) for r in rollouts] == [("p", 0), ("p", 1), ("p", 2), ("p", 3), ("q", 0), ("q", 1), ("q", 2)]
    assert len({tuple(r.tokens) for r in rollouts[:4]}) == 4


def test_stop_tokens_and_max_new_tokens_are_honoured(hf_folders):
    engine = make_engine(hf_folders["llama"])
    free = engine.generate([Request(prompt_id="s", prompt=[5, 6, 7], n=8)], SamplingParams(max_new_tokens=40, temperature=1.0))
    stop = free[0].tokens[5]  # a token that sample 0 emits at position 5
    stopped = engine.generate(
        [Request(prompt_id="s", prompt=[5, 6, 7], n=8)], SamplingParams(max_new_tokens=40, temperature=1.0, stop_token_ids=(stop,))
    )
    for a, b in zip(free, stopped):
        if stop in a.tokens:
            cut = a.tokens.index(stop) + 1
            assert b.tokens == a.tokens[:cut] and b.finish_reason == "stop"
        else:
            assert b.tokens == a.tokens and b.finish_reason == "length"
        assert len(b.tokens) <= 40 and len(b.logprobs) == len(b.tokens)
    assert stopped[0].finish_reason == "stop" and len(stopped[0].tokens) <= 6


def test_context_limit_finishes_rows_with_length(hf_folders):
    engine = make_engine(hf_folders["llama"], max_len=16)
    (ro,) = engine.generate([Request(prompt_id="c", prompt=list(range(3, 13)))], SamplingParams(max_new_tokens=50, temperature=0))
    assert ro.finish_reason == "length" and len(ro.tokens) == 16 - 10 + 1


def test_batch_shrinks_as_rows_finish(hf_folders):
    engine = make_engine(hf_folders["llama"])
    reqs = [Request(prompt_id=str(i), prompt=[5, 6], n=1) for i in range(8)]
    free = engine.generate(reqs, SamplingParams(max_new_tokens=60, temperature=1.0))
    # Stop on a token that some rows emit early and others late (or never).
    params = SamplingParams(max_new_tokens=60, temperature=1.0, stop_token_ids=(free[0].tokens[3],))
    batch = engine.generate(reqs, params)
    sizes = [r.batch_size for r in batch.steps]
    lengths = [len(r.tokens) for r in batch]
    assert len(set(lengths)) > 1  # rows did finish at different steps
    # Without speculation decode step s serves exactly the rows still generating their token s + 1.
    assert sizes == [sum(n > s + 1 for n in lengths) for s in range(max(lengths) - 1)]
    assert sum(sizes) + len(reqs) == batch.stats.new_tokens  # first tokens come with the prefill
    assert all(r.emitted == [1] * r.batch_size and r.shape == "off" for r in batch.steps)


def test_prompt_longer_than_the_context_is_rejected(hf_folders):
    engine = make_engine(hf_folders["llama"], max_len=16)
    with pytest.raises(ValueError, match="has 20 tokens.*context holds 16"):
        engine.generate([Request(prompt_id="long", prompt=[5] * 20)], SamplingParams())


class CountingRuntime:
    """Wraps the engine's runtime and records the token count of every target pass."""

    def __init__(self, runtime) -> None:
        self.inner, self.calls = runtime, []

    def __call__(self, ids, *args, **kw):
        self.calls.append(ids.shape)
        return self.inner(ids, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_part_of_a_group_samples_the_same_tokens_as_the_whole_group(hf_folders):
    engine = make_engine(hf_folders["llama"], max_batch=3)  # the part of 5 samples comes in chunks too
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7)
    whole = engine.generate([Request(prompt_id="p", prompt=[5, 6, 7], n=8)], params)
    part = engine.generate([Request(prompt_id="p", prompt=[5, 6, 7], n=5, first_sample=3)], params)
    assert [r.sample for r in part] == [3, 4, 5, 6, 7]
    assert [(r.sample, r.tokens, r.logprobs) for r in part] == [(r.sample, r.tokens, r.logprobs) for r in whole.rollouts[3:]]


def test_a_part_of_a_group_takes_drafts_only_for_its_samples():
    Request(prompt_id="p", prompt=[5], n=2, first_sample=2, drafts={2: [1], 3: [4]})
    with pytest.raises(ValueError, match="keyed by sample index 2..3"):
        Request(prompt_id="p", prompt=[5], n=2, first_sample=2, drafts={0: [1]})
    with pytest.raises(ValueError, match="first_sample must be >= 0"):
        Request(prompt_id="p", prompt=[5], n=2, first_sample=-1)


def test_a_request_larger_than_the_batch_is_served_in_chunks_with_one_prefill(hf_folders):
    small = make_engine(hf_folders["llama"], max_batch=3)
    small.runtime = CountingRuntime(small.runtime)
    big = make_engine(hf_folders["llama"], max_batch=16)
    reqs = [Request(prompt_id="x", prompt=[5, 9, 4, 7], n=7), Request(prompt_id="y", prompt=[8, 3], n=2)]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    got, want = small.generate(reqs, params), big.generate(reqs, params)
    assert [(r.prompt_id, r.sample, r.tokens) for r in got] == [(r.prompt_id, r.sample, r.tokens) for r in want]
    prefills = [shape for shape in small.runtime.calls if shape[1] > 1]
    assert prefills == [(1, 4), (1, 2)]  # "x" prefilled once for its 3 chunks, then "y"
    assert max(r.batch_size for r in got.steps) <= 3
