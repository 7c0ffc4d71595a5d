"""Bucketed CUDA graphs: the capture plan (sizes, sharing, memory) on CPU; replay equals eager on CUDA."""

from __future__ import annotations

import pytest
import torch

from engine.graphs import GraphRunner, bucket_ranges, capture_plan, capture_sizes, pad_batch, verify_width
from engine.kv_cache import KVCache
from engine.model import Transformer, causal_mask
from engine.model_config import ModelConfig
from engine.spec.drafter import DraftShape
from engine.spec.tuner import parse_arm

TLT = [1, 2, 5, 21]
ARMS = [parse_arm(a) for a in ("off", "d4k1v4", "d4k3v4", "d16k1v16")]


def config(**kw) -> ModelConfig:
    base = dict(vocab_size=101, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    return ModelConfig(**{**base, **kw})


def test_capture_sizes_are_powers_of_two_then_multiples_of_eight_up_to_max_batch():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert [pad_batch(b, capture_sizes(64)) for b in (1, 3, 5, 9, 21, 64)] == [1, 4, 8, 16, 24, 64]
    with pytest.raises(ValueError, match="larger than the largest capture size"):
        pad_batch(65, capture_sizes(64))


def test_buckets_cover_one_to_max_batch_without_overlap():
    ranges = bucket_ranges(TLT, 64)
    assert [(r.start, r.stop) for r in ranges] == [(1, 2), (2, 5), (5, 21), (21, 65)]
    assert [len(r) for r in bucket_ranges(TLT, 4)] == [1, 3, 0, 0]


def test_a_chain_and_a_tree_of_the_same_verify_width_share_a_target_graph():
    assert [verify_width(a) for a in ARMS] == [0, 4, 4, 16]
    plan = capture_plan(ARMS, TLT, 64, config(), config(num_hidden_layers=1), context=256)
    graphs = {(g.batch, g.tokens): g.arms for g in plan.target}
    assert graphs[(8, 5)] == ("d4k1v4", "d4k3v4")
    assert graphs[(8, 1)] == ("off",) and graphs[(8, 17)] == ("d16k1v16",)
    assert {g.tokens for g in plan.target} == {1, 5, 17}  # three widths for four arms
    assert {g.arm for g in plan.drafter} == {"d4k1v4", "d4k3v4", "d16k1v16"}  # one per arm: drafts differ


def test_graphs_are_captured_only_for_the_padded_sizes_of_the_buckets_an_arm_serves():
    # TLT-style assignment: deep chains in the thin tail, off and a short chain once the batch is large.
    plan = capture_plan(ARMS, TLT, 64, config(), config(num_hidden_layers=1), context=256,
                        bucket_arms=[[3], [1, 3], [0, 1, 2], [0, 1]])
    by_width = {}
    for g in plan.target:
        by_width.setdefault(g.tokens, []).append(g.batch)
    assert by_width[17] == [1, 2, 4]  # d16k1v16: batch 1 and 2-4 (padded to 4)
    assert by_width[1] == [8, 16, 24, 32, 40, 48, 56, 64]  # off: 5-20 pads to 8, 16, 24; 21-64 to 24..64
    drafts = {}
    for g in plan.drafter:
        drafts.setdefault(g.arm, []).append(g.batch)
    assert drafts["d16k1v16"] == [1, 2, 4]
    assert drafts["d4k3v4"] == [8, 16, 24]
    assert drafts["d4k1v4"] == [2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_the_bucketed_estimate_is_well_below_every_arm_at_every_batch_size():
    target = config(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8)
    plan = capture_plan(ARMS, TLT, 128, target, config(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                        num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8), context=4096)
    assert plan.bytes == sum(g.bytes for g in plan.target) + sum(g.bytes for g in plan.drafter)
    assert plan.naive_graphs == 4 * 128 + 3 * 128
    assert len(plan.target) + len(plan.drafter) < plan.naive_graphs / 5
    assert plan.bytes < plan.naive_bytes / 2
    assert plan.metrics["graphs/gb"] < plan.metrics["graphs/naive_gb"]


def test_an_estimate_grows_with_batch_and_tokens():
    plan = capture_plan([None, DraftShape(depth=8, topk=1, verify_tokens=8)], [1], 16, config(), None, context=128)
    size = {(g.batch, g.tokens): g.bytes for g in plan.target}
    assert size[(1, 1)] < size[(2, 1)] < size[(2, 9)] < size[(16, 9)]
    assert plan.drafter == []  # no drafter config: no drafter graphs


def test_bad_buckets_and_arm_lists_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="start at 1 and increase"):
        capture_plan(ARMS, [2, 5], 8, config(), context=64)
    with pytest.raises(ValueError, match="one list of arm indices"):
        capture_plan(ARMS, TLT, 8, config(), context=64, bucket_arms=[[0]])


def decode_inputs(cache: KVCache, b: int, tokens: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    dev = cache.k.device
    lengths = cache.lengths[:b]
    ids = torch.randint(0, vocab, (b, tokens), generator=g).to(dev)
    slots = lengths.unsqueeze(1) + torch.arange(tokens, device=dev)
    return ids, slots, slots, causal_mask(slots, int(slots.max()) + 1)


def prefilled(device: str, dtype=torch.float32, max_batch: int = 8, rows: int = 5):
    torch.manual_seed(0)
    model = Transformer(config()).to(device=device, dtype=dtype).eval()
    model.build_rope_table(256)
    cache = KVCache.for_model(model.config, max_batch, 96, dtype, device)
    prompt_lens = torch.tensor([7, 3, 11, 5, 9, 4, 6, 8][:rows])
    ids = torch.randint(0, 101, (rows, int(prompt_lens.max())), device=device)
    pos = torch.arange(ids.shape[1], device=device).expand(rows, -1)
    with torch.inference_mode():
        model(ids, pos, cache=cache.rows(0, rows))
    cache.lengths[:rows] = prompt_lens.to(device)
    return model, cache


def test_on_cpu_the_runner_captures_nothing_and_runs_the_forward_eagerly():
    model, cache = prefilled("cpu")
    runner = GraphRunner(model, cache, [(8, 1), (8, 5)])
    assert runner.captured == []
    ids, pos, slots, mask = decode_inputs(cache, 5, 1, 101, 1)
    with torch.inference_mode():
        want = model(ids, pos, cache=cache, cache_pos=slots, attn_mask=mask).logits
        got = runner(ids, pos, slots, mask).logits
    assert torch.equal(got, want)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has no GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("b, tokens", [(5, 1), (3, 5), (8, 3)])
def test_graph_replay_equals_eager_on_the_same_cache(b, tokens):
    """Rows padded to 8, tokens padded to 5 where the graph is wider; logits and the KV rows written agree."""
    model, cache = prefilled("cuda", torch.float64, rows=8)
    eager_cache = KVCache.for_model(model.config, 8, 96, torch.float64, "cuda")
    eager_cache.k.copy_(cache.k), eager_cache.v.copy_(cache.v), eager_cache.lengths.copy_(cache.lengths)
    runner = GraphRunner(model, cache, [(8, 1), (8, 5), (4, 5)])
    assert runner.captured == [(4, 5), (8, 1), (8, 5)]
    torch.testing.assert_close(cache.k, eager_cache.k, rtol=0, atol=0)  # capture left the cache as it was
    for step in range(3):
        ids, pos, slots, mask = decode_inputs(cache, b, tokens, 101, step)
        with torch.inference_mode():
            want = model(ids, pos, cache=eager_cache, cache_pos=slots, attn_mask=mask).logits
            got = runner(ids, pos, slots, mask).logits
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        n = int(cache.lengths[:b].max()) + tokens
        torch.testing.assert_close(cache.k[:, :b, :, :n], eager_cache.k[:, :b, :, :n], rtol=1e-9, atol=1e-9)
        cache.lengths[:b] += tokens
        eager_cache.lengths[:b] += tokens


class _GraphedRuntime:
    """The engine's runtime with its decode forwards (cache_pos given) through a GraphRunner."""

    def __init__(self, runtime, runner: GraphRunner) -> None:
        self._runtime, self._runner = runtime, runner

    def __call__(self, input_ids, positions, cache=None, cache_pos=None, attn_mask=None, logits=True, hidden_layers=()):
        if cache is self._runner.cache and cache_pos is not None and logits and tuple(hidden_layers) == self._runner.hidden_layers:
            return self._runner(input_ids, positions, cache_pos, attn_mask)
        return self._runtime(input_ids, positions, cache=cache, cache_pos=cache_pos, attn_mask=attn_mask, logits=logits,
                             hidden_layers=hidden_layers)

    def __getattr__(self, name):
        return getattr(self._runtime, name)


@pytest.mark.gpu
@cuda
def test_rollouts_through_graphs_equal_eager_rollouts_speculative_and_not(hf_folders):
    from engine.checkpoint import load_checkpoint
    from engine.config import EngineConfig
    from engine.engine import RolloutEngine
    from engine.graphs import capture_plan
    from engine.sampling import SamplingParams
    from engine.spec.config import SpecConfig
    from engine.spec.eagle import EagleConfig, EagleModel
    from engine.spec.eagle_drafter import EagleDrafter
    from engine.types import Request

    params = SamplingParams(max_new_tokens=32, temperature=1.0, seed=3)
    reqs = [Request(prompt_id=f"g{i}", prompt=[5 + i, 9, 17, 4], n=2) for i in range(3)]
    arms = [parse_arm(a) for a in ("off", "d4k1v4", "d4k2v6")]
    results = []
    for graphed in (False, True):
        target = load_checkpoint(hf_folders["llama"], dtype=torch.float64, device="cuda")
        cfg = EngineConfig(max_batch=8, max_len=64, device="cuda", spec=SpecConfig(depth=4, topk=2, verify_tokens=6))
        torch.manual_seed(0)
        drafter = EagleDrafter(EagleModel(EagleConfig.for_target(target.config), target).double().cuda())
        engine = RolloutEngine(target, cfg, drafter)
        if graphed:
            plan = capture_plan(arms, TLT, 8, target.config, context=engine.cache.max_len)
            layers = tuple(sorted(set(drafter.feature_layers)))
            runner = GraphRunner(engine.runtime, engine.cache, plan.target_shapes(), hidden_layers=layers)
            assert runner.captured
            engine.runtime = _GraphedRuntime(engine.runtime, runner)
        out = []
        for arm in arms:
            from engine.spec.policy import FixedPolicy

            engine.policy = FixedPolicy(arm)
            out.append([r.tokens for r in engine.generate(reqs, params)])
        results.append(out)
    assert results[0] == results[1]
    assert results[0][0] == results[0][1] == results[0][2]
