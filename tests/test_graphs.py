"""Bucketed CUDA graphs: the capture plan (sizes, sharing, memory) and the engine's use of a runner
on CPU (a runner whose graphs run eagerly, recording the shapes it serves); on CUDA, replay
equals eager, and so does a whole generate() with graphs."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.graphs import (Captured, DecodeGraphs, GraphRunner, bucket_ranges, capture_plan, capture_sizes, pad_batch,
                           verify_width)
from engine.kv_cache import KVCache
from engine.model import Transformer, causal_mask
from engine.model_config import ModelConfig
from engine.sampling import SamplingParams
from engine.spec.config import SpecConfig
from engine.spec.drafter import DraftShape
from engine.spec.policy import FixedPolicy
from engine.spec.tuner import parse_arm
from engine.types import Request
from tests.spec_drafters import OracleDrafter, RandomDrafter

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
    plan = capture_plan(ARMS, TLT, 64, config(), context=256)
    graphs = {(g.batch, g.tokens): g.arms for g in plan.target}
    assert graphs[(8, 5)] == ("d4k1v4", "d4k3v4")
    assert graphs[(8, 1)] == ("off",) and graphs[(8, 17)] == ("d16k1v16",)
    assert {g.tokens for g in plan.target} == {1, 5, 17}  # three widths for four arms


def test_graphs_are_captured_only_for_the_padded_sizes_of_the_buckets_an_arm_serves():
    # TLT-style assignment: deep chains in the thin tail, off and a short chain once the batch is large.
    plan = capture_plan(ARMS, TLT, 64, config(), context=256,
                        bucket_arms=[[3], [1, 3], [0, 1, 2], [0, 1]])
    by_width = {}
    for g in plan.target:
        by_width.setdefault(g.tokens, []).append(g.batch)
    assert by_width[17] == [1, 2, 4]  # d16k1v16: batch 1 and 2-4 (padded to 4)
    assert by_width[1] == [8, 16, 24, 32, 40, 48, 56, 64]  # off: 5-20 pads to 8, 16, 24; 21-64 to 24..64
    # d4k1v4 (2-4, 5-20, 21+) and d4k3v4 (5-20) share width 5: one graph per padded size either serves
    assert by_width[5] == [2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_the_bucketed_estimate_is_well_below_every_arm_at_every_batch_size():
    target = config(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8)
    plan = capture_plan(ARMS, TLT, 128, target, context=4096)
    assert plan.bytes == sum(g.bytes for g in plan.target)
    assert plan.naive_graphs == 4 * 128
    assert len(plan.target) < plan.naive_graphs / 5
    assert plan.bytes < plan.naive_bytes / 2
    assert plan.metrics["graphs/gb"] < plan.metrics["graphs/naive_gb"]


def test_an_estimate_grows_with_batch_and_tokens():
    plan = capture_plan([None, DraftShape(depth=8, topk=1, verify_tokens=8)], [1], 16, config(), context=128)
    size = {(g.batch, g.tokens): g.bytes for g in plan.target}
    assert size[(1, 1)] < size[(2, 1)] < size[(2, 9)] < size[(16, 9)]


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


def test_the_engine_builds_no_graphs_on_cpu_and_a_runner_refuses_a_cpu_cache():
    model, cache = prefilled("cpu")
    engine = RolloutEngine(model, EngineConfig(max_batch=8, max_len=64, cuda_graphs=True))
    assert engine.graphs is None
    with pytest.raises(ValueError, match="CUDA device"):
        GraphRunner(model, cache, [(8, 1)])
    with pytest.raises(ValueError, match="engine.cuda_graphs must be true or false"):
        EngineConfig(cuda_graphs="yes").validate()


def test_the_config_policy_plans_off_in_every_bucket_and_the_shape_where_the_policy_speculates():
    fixed, tail, tuner = (
        DecodeGraphs.for_config(SpecConfig(depth=4, topk=1, verify_tokens=4, **kw), parse_arm("d4k1v4"), 16, config(),
                                context=64)
        for kw in ({}, {"max_active_batch": 4}, {"tuner_arms": ["off", "d4k2v6", "d16k1v16"], "tuner_buckets": [1, 5]}))
    sizes = [1, 2, 4, 8, 16]
    assert fixed.plain == tail.plain == tuner.plain == [(s, 1) for s in sizes]
    assert fixed.speculative == sorted([(s, 1) for s in sizes] + [(s, 5) for s in sizes])
    assert tail.speculative == sorted([(s, 1) for s in sizes] + [(s, 5) for s in (1, 2, 4)])  # speculates at <= 4 rows
    assert tuner.speculative == sorted((s, t) for s in sizes for t in (1, 7, 17))


class EagerGraphRunner(GraphRunner):
    """A GraphRunner whose "graphs" run the forward eagerly on their padded static inputs, so that
    its choice of graph and its padding run on a CPU. Records every call's (batch, tokens) with the
    captured shape chosen for it (None: eager), and every replay."""

    def __init__(self, *args, **kw) -> None:
        self.calls: list[tuple[tuple[int, int], tuple[int, int] | None]] = []
        self.replays: list[tuple[int, int]] = []
        super().__init__(*args, **kw)

    def _capture(self, batch: int, tokens: int) -> Captured:
        x = self._static_inputs(batch, tokens)

        def replay():
            self.replays.append((batch, tokens))
            return self._run(x)

        return Captured(x, replay)

    def __call__(self, input_ids, positions, cache_pos, attn_mask):
        shape = tuple(input_ids.shape)
        self.calls.append((shape, self.graph_for(*shape)))
        return super().__call__(input_ids, positions, cache_pos, attn_mask)


GEN = {"greedy": SamplingParams(max_new_tokens=40, temperature=0.0),
       "T1-top-p0.9": SamplingParams(max_new_tokens=40, temperature=1.0, top_p=0.9, seed=5)}


def varied_requests() -> list[Request]:
    """Prompts of 3-11 tokens under max_len 36: rows reach their limit at different steps, so the batch shrinks."""
    g = torch.Generator().manual_seed(4)
    return [Request(prompt_id=f"p{i}", prompt=torch.randint(3, 101, (3 + 2 * i,), generator=g).tolist(), n=2) for i in range(5)]


def generate(folder, drafter=None, topk: int = 1, runner_shapes=None, params=GEN["greedy"]):
    """Rollouts (with step records) and the runner (None: eager) of the llama fixture at float32
    (the CPU kernels), speculating with `drafter` (chains for topk 1) if one is given."""
    spec = SpecConfig(depth=4, topk=topk, verify_tokens=6)
    engine = RolloutEngine(load_checkpoint(folder, dtype=torch.float32), EngineConfig(max_batch=8, max_len=36, spec=spec), drafter)
    if runner_shapes is not None:
        engine.graphs = DecodeGraphs(runner_shapes, runner_shapes, make_runner=EagerGraphRunner)
    out = engine.generate(varied_requests(), params)
    return out, engine.graphs.current if engine.graphs is not None else None


def smallest_of(shapes):
    """The expected graph for (b, T): the captured shape of fewest entries that holds it (None: eager)."""
    return lambda b, T: min((s for s in shapes if s[0] >= b and s[1] >= T), key=lambda s: s[0] * s[1], default=None)


SHAPES = [(4, 1), (4, 5), (2, 7)]  # rows 3-4: decode or a chain of 4; rows 1-2: anything up to 6 drafts
CASES = {  # drafter (given the autoregressive rollouts), topk, tokens a step (None: 1 + the step's widest draft)
    "autoregressive": (lambda ref: None, 1, 1),
    "random chain": (lambda ref: RandomDrafter(101), 1, 5),  # rarely accepted
    "random tree": (lambda ref: RandomDrafter(101), 3, 7),
    "oracle chain": (lambda ref: OracleDrafter(ref), 1, None),  # all accepted: the padding must not touch them
}


@pytest.mark.parametrize("params", GEN.values(), ids=GEN.keys())
@pytest.mark.parametrize("case", CASES)
def test_decode_asks_the_runner_for_each_steps_rows_and_tokens_and_its_tokens_equal_eager(hf_folders, case, params):
    """Rows and tokens padded up to a captured shape where one holds them (the verify width padded
    too: a chain of 5 tokens in a (2, 7) graph), the eager forward elsewhere; the same rollouts."""
    make_drafter, topk, tokens = CASES[case]
    autoregressive = generate(hf_folders["llama"], params=params)[0] if case == "oracle chain" else None
    eager, none = generate(hf_folders["llama"], make_drafter(autoregressive), topk, params=params)
    graphed, runner = generate(hf_folders["llama"], make_drafter(autoregressive), topk, SHAPES, params=params)
    assert none is None and runner.captured == sorted(SHAPES)
    assert [r.tokens for r in graphed] == [r.tokens for r in eager]
    assert [r.logprobs for r in graphed] == [r.logprobs for r in eager]
    steps = graphed.steps
    assert len({s.batch_size for s in steps}) > 2  # the batch shrank (and grew on admission)
    asked = [(s.batch_size, tokens or 1 + max(s.drafted)) for s in steps]
    assert [shape for shape, _ in runner.calls] == asked  # one target pass a step, at the step's rows and tokens
    assert [graph for _, graph in runner.calls] == [smallest_of(SHAPES)(*shape) for shape in asked]
    assert runner.replays == [graph for _, graph in runner.calls if graph is not None]
    assert any(graph is None for _, graph in runner.calls) and runner.replays  # both paths served
    if case == "oracle chain":
        assert graphed.stats.accepted == graphed.stats.drafted > 0


def test_decode_graphs_capture_again_only_when_what_the_runner_holds_changes():
    made = []
    graphs = DecodeGraphs([(8, 1)], [(8, 1), (8, 5)], make_runner=lambda *args, **kw: made.append((args, kw)) or len(made))
    forward, cache, rope = object(), object(), object()
    assert graphs.runner(forward, cache, rope, (), speculative=False) == 1
    assert graphs.runner(forward, cache, rope, (), speculative=False) == 1  # the same call: the same graphs
    assert made[0] == ((forward, cache, [(8, 1)]), {"hidden_layers": ()})
    other = object()
    assert [graphs.runner(*held, layers, speculative=spec) for held, layers, spec in [
        ((other, cache, rope), (), False), ((other, other, rope), (), False), ((other, other, other), (), False),
        ((other, other, other), (1,), False), ((other, other, other), (1,), True), ((other, other, other), (1,), True),
    ]] == [2, 3, 4, 5, 6, 6]
    assert made[-1] == ((other, other, [(8, 1), (8, 5)]), {"hidden_layers": (1,)})


def test_an_engine_captures_again_after_attach_drafter_and_for_a_sinks_layers(hf_folders):
    params = GEN["T1-top-p0.9"]
    model = load_checkpoint(hf_folders["llama"], dtype=torch.float32)
    engine = RolloutEngine(model, EngineConfig(max_batch=8, max_len=36, spec=SpecConfig(depth=4, topk=1, verify_tokens=6)))
    engine.graphs = DecodeGraphs([(8, 1)], [(8, 1), (8, 5)], make_runner=EagerGraphRunner)
    plain = engine.generate(varied_requests(), params)
    first = engine.graphs.current
    engine.generate(varied_requests(), params)
    assert engine.graphs.current is first and first.captured == [(8, 1)]
    engine.attach_drafter(RandomDrafter(101))  # a new cache, with room for drafts
    spec = engine.generate(varied_requests(), params)
    second = engine.graphs.current
    assert second is not first and second.cache is engine.cache and second.captured == [(8, 1), (8, 5)]
    assert [r.tokens for r in spec] == [r.tokens for r in plain] and second.replays

    class Sink:
        feature_layers = (1,)

        def prompt(self, *args) -> None:
            pass

        def tokens(self, committed) -> None:
            self.rows = committed.features.shape[0]

    engine.sink = Sink()
    engine.generate(varied_requests(), params)
    assert engine.graphs.current is not second and engine.graphs.current.hidden_layers == (1,)
    assert engine.sink.rows > 0


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


@pytest.mark.gpu
@cuda
def test_generate_with_cuda_graphs_equals_eager_token_for_token(hf_folders, monkeypatch):
    """engine.cuda_graphs on and off, plain and then speculative (attach_drafter rebuilds the cache:
    graphs are captured again) with off, a chain padded to the tree's width, and the tree."""
    from engine.spec.eagle import EagleConfig, EagleModel
    from engine.spec.eagle_drafter import EagleDrafter

    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: (replays.append(graph), replay(graph))[1])
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3)
    reqs = [Request(prompt_id=f"g{i}", prompt=[5 + i, 9, 17, 4] * (i + 1), n=2) for i in range(3)]  # limits differ: the batch shrinks
    arms = [parse_arm(a) for a in ("off", "d4k1v4", "d4k2v6")]
    results = {}
    for graphs in (False, True):
        target = load_checkpoint(hf_folders["llama"], dtype=torch.float64, device="cuda")
        cfg = EngineConfig(max_batch=8, max_len=40, device="cuda", cuda_graphs=graphs,
                           spec=SpecConfig(depth=4, topk=2, verify_tokens=6))
        engine = RolloutEngine(target, cfg)
        assert (engine.graphs is not None) == graphs
        out = [[(r.tokens, r.logprobs) for r in engine.generate(reqs, params)]]
        torch.manual_seed(0)
        engine.attach_drafter(EagleDrafter(EagleModel(EagleConfig.for_target(target.config), target).double().cuda()))
        for arm in arms:
            engine.policy = FixedPolicy(arm)
            out.append([(r.tokens, r.logprobs) for r in engine.generate(reqs, params)])
        results[graphs] = out
        if graphs:
            runner = engine.graphs.current
            assert runner.cache is engine.cache and {(8, 1), (8, 7)} <= set(runner.captured)
    assert replays
    for eager, graphed in zip(results[False], results[True]):
        assert [t for t, _ in graphed] == [t for t, _ in eager]
        for (_, a), (_, b) in zip(eager, graphed):
            assert b == pytest.approx(a, abs=1e-9)
    assert all([t for t, _ in run] == [t for t, _ in results[True][0]] for run in results[True])  # speculation changes no token
