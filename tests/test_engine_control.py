"""The engine's training-loop handles: a per-step speculation policy (switching costs nothing and
changes no token), the feature sink (every committed token once, the target's true features),
pre-generated drafts, requests larger than the batch, and the engine's maximum shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.features import CommittedFeatures, target_features
from engine.model import Transformer
from engine.model_config import ModelConfig
from engine.sampling import SamplingParams
from engine.spec.compose import FallbackDrafter
from engine.spec.config import SpecConfig
from engine.spec.drafter import DraftShape
from engine.spec.eagle import EagleConfig, EagleModel
from engine.spec.eagle_drafter import EagleDrafter
from engine.spec.ngram import NgramDrafter
from engine.spec.pregenerated import PregeneratedDrafter
from engine.types import Request

PARAMS = {
    "greedy": SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(2,)),
    "T1": SamplingParams(max_new_tokens=24, temperature=1.0, seed=5, stop_token_ids=(2,)),
}


def requests(n: int = 3, count: int = 3, seed: int = 4) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(prompt_id=f"p{i}", prompt=torch.randint(3, 101, (3 + 2 * i,), generator=g).tolist(), n=n)
            for i in range(count)]


@pytest.fixture(scope="module")
def target(hf_folders):
    return load_checkpoint(hf_folders["llama"], dtype=torch.float64)


def engine(target, drafter=None, policy=None, sink=None, max_batch: int = 8, **spec) -> RolloutEngine:
    spec = SpecConfig(**{"depth": 4, "topk": 1, "verify_tokens": 6, **spec})
    return RolloutEngine(target, EngineConfig(max_batch=max_batch, max_len=128, spec=spec), drafter, policy, sink)


def eagle(target, kind: str = "eagle") -> EagleDrafter:
    torch.manual_seed(0)
    return EagleDrafter(EagleModel(EagleConfig.for_target(target.config, kind), target).to(target.dtype))


DRAFTERS = {
    "eagle": lambda t: eagle(t),
    "ngram+eagle": lambda t: FallbackDrafter([NgramDrafter(), eagle(t)]),
}


def same_rollouts(got, want) -> None:
    assert [(r.prompt_id, r.sample) for r in got] == [(r.prompt_id, r.sample) for r in want]
    for a, b in zip(got, want):
        assert a.tokens == b.tokens
        assert a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-9)


class RandomSwitch:
    """Off with probability p_off, decided afresh every `block` steps (seeded); keeps what it
    chose and the index of the record it was shown."""

    def __init__(self, shape: DraftShape, p_off: float, seed: int = 0, block: int = 1) -> None:
        self.shape, self.p_off, self.block = shape, p_off, block
        self.g = torch.Generator().manual_seed(seed)
        self.choices: list[DraftShape | None] = []
        self.shown: list[int | None] = []

    def choose(self, batch_size: int, last):
        self.shown.append(None if last is None else last.index)
        if len(self.choices) % self.block == 0:
            self.off = bool(torch.rand((), generator=self.g) < self.p_off)
        self.choices.append(None if self.off else self.shape)
        return self.choices[-1]


# -- the policy switches speculation on and off ---------------------------------------------
@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
@pytest.mark.parametrize("name", DRAFTERS)
def test_switching_speculation_at_random_steps_gives_autoregressive_tokens(target, name, params):
    reference = engine(target).generate(requests(), params)
    policy = RandomSwitch(DraftShape(depth=4, topk=1, verify_tokens=6), p_off=0.5, seed=11)
    batch = engine(target, DRAFTERS[name](target), policy).generate(requests(), params)
    same_rollouts(batch, reference)
    steps = batch.steps
    assert policy.shown == [None] + [s.index for s in steps[:-1]]  # asked every step, shown the last record
    assert [s.shape == "off" for s in steps] == [c is None for c in policy.choices]
    off = [s for s in steps if not s.speculative]
    on = [s for s in steps if s.speculative]
    assert off and on
    assert all(s.drafted == [0] * s.batch_size and s.emitted == [1] * s.batch_size for s in off)
    assert all(a <= d for s in on for a, d in zip(s.accepted, s.drafted))
    stats = batch.stats
    total = sum(len(r.tokens) for r in batch)
    assert sum(sum(s.emitted) for s in steps) + len(batch) == stats.new_tokens == total  # + the first tokens
    assert stats.speculative_steps == len(on) and stats.drafted == sum(sum(s.drafted) for s in on) > 0
    assert stats.accepted == sum(sum(s.accepted) for s in on)


def teacher(seed: int = 0) -> tuple[Transformer, EagleModel]:
    """A 1-layer Llama target and an EAGLE drafter that computes the target's own layer.

    Embedding rows have RMS 1 and every norm weight is 1 (head tied), so the target's input norm
    is (up to eps) the identity that EAGLE's layer has; fc = [I, 0] passes the token embedding
    through, and the layer is a copy of the target's. The drafter then computes the target's
    hidden state before the final norm, whose argmax is the target's greedy token, except that its
    cache never holds the first prompt token (EAGLE pairs start at position 1): with a complete
    cache it drafts the target's tokens nearly always; with missing entries it does not.
    """
    torch.manual_seed(seed)
    cfg = ModelConfig(family="llama", vocab_size=101, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                      tie_word_embeddings=True)
    target = Transformer(cfg).eval()
    with torch.no_grad():
        emb = target.model.embed_tokens.weight
        emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())
        # Sharpen attention and MLP so that the context decides the next token (at scale 1 the
        # embedding's residual wins and the target repeats its input).
        for name, p in target.model.layers[0].named_parameters():
            if p.dim() == 2:
                p.mul_(2.0 if name.startswith("self_attn") else 4.0)
    net = EagleModel(EagleConfig.for_target(cfg), target)
    with torch.no_grad():
        H = cfg.hidden_size
        net.fc.weight.zero_()
        net.fc.weight[:, :H] = torch.eye(H)
        layer = {k: v for k, v in target.model.layers[0].state_dict().items() if not k.startswith("input_layernorm")}
        net.layers[0].load_state_dict(layer)
    return target, net


class ForgetfulDrafter(EagleDrafter):
    """A broken EagleDrafter that does not catch up while speculation is off: a step without a
    draft drops the pending pairs, keeping only its own (so the root stays right)."""

    def update(self, verdict, features) -> None:
        if verdict.path.shape[1] == 0:
            self.pend_n[: features.shape[0]] = 0
        super().update(verdict, features)


def test_acceptance_after_switching_on_equals_always_on_and_the_check_has_power():
    params = SamplingParams(max_new_tokens=80, temperature=0.0)
    g = torch.Generator().manual_seed(1)
    reqs = [Request(prompt_id=f"p{i}", prompt=torch.randint(3, 101, (16,), generator=g).tolist(), n=2) for i in range(4)]
    shape = DraftShape(depth=4, topk=1, verify_tokens=4)

    def run(drafter_cls, p_off: float):
        target, net = teacher()
        e = engine(target, drafter_cls(net), RandomSwitch(shape, p_off, seed=0, block=4), depth=4, verify_tokens=4)
        return e.generate(reqs, params)

    always, switching, forgetful = run(EagleDrafter, 0.0), run(EagleDrafter, 0.5), run(ForgetfulDrafter, 0.5)
    assert [r.tokens for r in switching] == [r.tokens for r in always] == [r.tokens for r in forgetful]
    on, sw, bad = always.stats.accept_rate, switching.stats.accept_rate, forgetful.stats.accept_rate
    assert on > 0.8, f"the teacher drafter should draft the target's tokens (accept rate {on:.3f})"
    assert switching.stats.speculative_steps < len(switching.steps)  # it did switch off
    assert abs(sw - on) <= 0.1 * on, (on, sw)
    assert bad < 0.7 * on, (on, bad)  # a drafter that misses the off steps' pairs is caught


# -- the feature sink ---------------------------------------------------------------------------
class RecordingSink:
    def __init__(self, feature_layers: tuple[int, ...]) -> None:
        self.feature_layers = feature_layers
        self.prompts: dict[str, list[tuple[list[int], torch.Tensor, int]]] = {}
        self.entries: dict[tuple[str, int, int], list[tuple[int, torch.Tensor, int]]] = {}

    def prompt(self, prompt_id, tokens, features, policy_version) -> None:
        self.prompts.setdefault(prompt_id, []).append((tokens.tolist(), features.clone(), policy_version))

    def tokens(self, entries: CommittedFeatures) -> None:
        for m in range(entries.row.shape[0]):
            row = int(entries.row[m])
            key = (entries.prompt_ids[row], int(entries.samples[row]), int(entries.position[m]))
            self.entries.setdefault(key, []).append((int(entries.tokens[m]), entries.features[m].clone(),
                                                     entries.policy_version))


# The decoder's RMSNorm normalises in float32 (as HF does) even for a float64 model, and the
# runtime's packed layers round differently from model.forward: ~5e-7 apart, not 1e-12.
FEATURE_ATOL = 1e-5

SINK_DRAFTERS = {
    "off": (None, {}),
    "eagle-chain": (lambda t: eagle(t), {"topk": 1}),
    "eagle-tree": (lambda t: eagle(t), {"topk": 3}),
    "eagle3-tree": (lambda t: eagle(t, "eagle3"), {"topk": 3}),  # reads layers (0, 1) itself
}


SINK_CASES = [("off", ()), ("off", (0,)), ("eagle-chain", (1,)), ("eagle-tree", ()), ("eagle-tree", (0,)),
              ("eagle3-tree", (1,))]


@pytest.mark.parametrize(("name", "layers"), SINK_CASES, ids=[f"{n}-{'aux%d' % l[0] if l else 'final'}" for n, l in SINK_CASES])
def test_sink_gets_every_committed_token_once_with_teacher_forced_features(hf_folders, name, layers):
    target = load_checkpoint(hf_folders["llama"], dtype=torch.float64)
    make, spec = SINK_DRAFTERS[name]
    sink = RecordingSink(layers)
    e = engine(target, make(target) if make else None, sink=sink, max_batch=4, **spec)
    e.load_weights(target.state_dict(), version=2)
    reqs = requests(n=2, count=2) + [Request(prompt_id="big", prompt=[7, 3, 9, 4], n=5)]  # 5 > max_batch: chunks
    batch = e.generate(reqs, PARAMS["T1"])
    assert sorted(sink.prompts) == sorted(r.prompt_id for r in reqs)
    expected_keys = set()
    for req in reqs:
        ((tokens, feats, version),) = sink.prompts[req.prompt_id]  # once per request, chunks or not
        assert tokens == req.prompt and version == 2
        P = len(req.prompt)
        for ro in (r for r in batch if r.prompt_id == req.prompt_id):
            ids = torch.tensor([req.prompt + ro.tokens[:-1]])
            with torch.no_grad():
                out = target(ids, torch.arange(ids.shape[1])[None], hidden_layers=layers)
            forced = target_features(out, layers)[0]  # [P + L - 1, F]
            torch.testing.assert_close(feats, forced[:P], atol=FEATURE_ATOL, rtol=0)
            for i in range(len(ro.tokens) - 1):
                key = (req.prompt_id, ro.sample, i)
                expected_keys.add(key)
                ((token, f, version),) = sink.entries[key]  # exactly once
                assert token == ro.tokens[i] and version == 2
                torch.testing.assert_close(f, forced[P + i], atol=FEATURE_ATOL, rtol=0)
    assert set(sink.entries) == expected_keys  # nothing else: no rejected drafts, no last tokens
    if make:
        assert batch.stats.drafted > 0


# -- pre-generated drafts -------------------------------------------------------------------------
def with_drafts(reqs: list[Request], drafts: dict[tuple[str, int], list[int]]) -> list[Request]:
    return [Request(prompt_id=r.prompt_id, prompt=r.prompt, n=r.n,
                    drafts={k: drafts[(r.prompt_id, k)] for k in range(r.n) if (r.prompt_id, k) in drafts} or None)
            for r in reqs]


def test_the_targets_own_rollout_as_pregenerated_draft_is_accepted_in_full(target):
    L, D = 30, 4
    params = SamplingParams(max_new_tokens=L, temperature=1.0, seed=7)  # no stop: every row runs L tokens
    reference = engine(target).generate(requests(n=2, count=3), params)
    reqs = with_drafts(requests(n=2, count=3), {(r.prompt_id, r.sample): r.tokens for r in reference})
    batch = engine(target, PregeneratedDrafter(), depth=D, verify_tokens=D).generate(reqs, params)
    same_rollouts(batch, reference)
    g = 1  # every row has generated g tokens before each step (all rows move together)
    for s in batch.steps:
        left = L - g
        assert s.drafted == [min(D, left)] * 6 and s.accepted == s.drafted
        assert s.emitted == [min(D + 1, left)] * 6
        g += min(D + 1, left)
    assert g == L


def _random_drafts(reference, seed):
    g = torch.Generator().manual_seed(seed)
    return {(r.prompt_id, r.sample): torch.randint(3, 101, (len(r.tokens),), generator=g).tolist() for r in reference}


def _other_seed(target, params):
    other = engine(target).generate(requests(), dataclasses.replace(params, seed=99))
    return {(r.prompt_id, r.sample): r.tokens for r in other}


def _diverging(reference, seed):
    g = torch.Generator().manual_seed(seed)
    drafts = {}
    for r in reference:
        half = len(r.tokens) // 2
        drafts[(r.prompt_id, r.sample)] = r.tokens[:half] + torch.randint(3, 101, (len(r.tokens),), generator=g).tolist()
    return drafts


@pytest.mark.parametrize("kind", ["random", "other-seed", "diverging", "fallback"])
def test_wrong_pregenerated_drafts_change_no_token(target, kind):
    params = PARAMS["T1"]
    reference = engine(target).generate(requests(), params)
    if kind == "random":
        drafts = _random_drafts(reference, 0)
    elif kind == "other-seed":
        drafts = _other_seed(target, params)
    else:
        drafts = _diverging(reference, 1)
    if kind == "fallback":  # only sample 0 has a draft; EAGLE drafts for the others
        drafts = {k: v for k, v in drafts.items() if k[1] == 0}
        drafter = FallbackDrafter([PregeneratedDrafter(), eagle(target)])
    else:
        drafter = PregeneratedDrafter()
    batch = engine(target, drafter).generate(with_drafts(requests(), drafts), params)
    same_rollouts(batch, reference)
    stats = batch.stats
    assert stats.drafted > 0
    if kind in ("diverging", "fallback"):
        # A drafted row's first h tokens are its own rollout: each step within them accepts the
        # next D, then emits one more, so at least (h - 1) * D / (D + 1) of them are accepted.
        D = 4
        floor = sum((len(r.tokens) // 2 - 1) * D // (D + 1) for r in reference if (r.prompt_id, r.sample) in drafts)
        assert stats.accepted >= floor > 0


# -- requests larger than the batch -------------------------------------------------------------
@pytest.mark.parametrize("name", DRAFTERS)
def test_a_request_larger_than_the_batch_speculates_to_the_same_rollouts(target, name):
    reqs = [Request(prompt_id="x", prompt=[5, 9, 4, 7], n=7), Request(prompt_id="y", prompt=[8, 3], n=2)]
    params = PARAMS["T1"]
    small = engine(target, DRAFTERS[name](target), max_batch=3, topk=3).generate(reqs, params)
    big = engine(target, DRAFTERS[name](target), max_batch=16, topk=3).generate(reqs, params)
    same_rollouts(small, big)
    assert max(s.batch_size for s in small.steps) <= 3 and small.stats.drafted > 0


# -- the engine's maximum shapes -----------------------------------------------------------------
class Cycle:
    def __init__(self, shapes: list[DraftShape | None]) -> None:
        self.shapes, self.i = shapes, 0

    def choose(self, batch_size: int, last):
        self.i += 1
        return self.shapes[(self.i - 1) % len(self.shapes)]


@pytest.mark.parametrize("key", ["depth", "topk", "verify_tokens"])
@pytest.mark.parametrize("value", ["zero", "above"])
def test_a_shape_outside_the_limits_is_refused_naming_the_key(target, key, value):
    limits = {"depth": 4, "topk": 2, "verify_tokens": 6}
    shape = dict(limits)
    shape[key] = 0 if value == "zero" else limits[key] + 1
    e = engine(target, eagle(target), Cycle([DraftShape(**shape)]), **limits)
    with pytest.raises(ValueError, match=rf"{key}={shape[key]} is outside 1\.\.{limits[key]}.*engine\.spec\.max_{key}"):
        e.generate(requests(), PARAMS["T1"])


def test_a_shape_with_the_wrong_verify_mode_is_refused(target):
    e = engine(target, eagle(target), Cycle([DraftShape(depth=4, topk=1, verify_tokens=6, iid_children=True)]))
    with pytest.raises(ValueError, match="iid_children must be False.*engine.spec.verify"):
        e.generate(requests(), PARAMS["T1"])


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
def test_maximum_sizes_let_a_policy_pick_bigger_shapes_than_the_default(target, params):
    shapes = [DraftShape(depth=2, topk=1, verify_tokens=2), DraftShape(depth=6, topk=3, verify_tokens=10), None,
              DraftShape(depth=6, topk=1, verify_tokens=6), DraftShape(depth=3, topk=2, verify_tokens=5)]
    reference = engine(target).generate(requests(count=2), params)
    e = engine(target, eagle(target), Cycle(shapes), depth=2, topk=1, verify_tokens=2, max_depth=6, max_topk=3,
               max_verify_tokens=10)
    assert e.shape.label == "d2k1v2" and e.limits.label == "d6k3v10"
    batch = e.generate(requests(count=2), params)
    same_rollouts(batch, reference)
    labels = [s.label if s else "off" for s in shapes]
    assert [s.shape for s in batch.steps] == [labels[i % len(labels)] for i in range(len(batch.steps))]
    widest = [d for s in batch.steps if s.shape == "d6k3v10" for d in s.drafted]
    assert max(widest) == 10  # more than the default shape's 2 nodes, as many as the limit allows
    assert all(d <= int(s.shape.split("v")[1]) for s in batch.steps if s.speculative for d in s.drafted)


def test_the_tail_policy_speculates_exactly_once_the_batch_has_thinned_to_its_threshold(target):
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=3, stop_token_ids=(2,))
    reference = engine(target).generate(requests(), params)
    tail = engine(target, eagle(target), max_active_batch=4)  # the config key builds a TailPolicy
    out = tail.generate(requests(), params)
    same_rollouts(out, reference)
    assert {r.batch_size > 4 for r in out.steps} == {True, False}  # the batch did thin past the threshold
    assert all((r.shape == "off") == (r.batch_size > 4) for r in out.steps)


# -- preemption (pre-generation in idle windows, [F]) ---------------------------------------------
@pytest.mark.parametrize("name", ["off", "eagle"])
def test_a_preempted_generate_returns_prefixes_of_the_full_rollouts(target, name):
    reqs = requests(n=3, count=3)  # 9 rows > max_batch 4: some are never admitted
    full = {(r.prompt_id, r.sample): r.tokens for r in engine(target, DRAFTERS[name](target) if name != "off" else None,
                                                             max_batch=4).generate(reqs, PARAMS["T1"])}
    calls = []

    def stop_after_three() -> bool:
        calls.append(1)
        return len(calls) >= 3

    e = engine(target, DRAFTERS[name](target) if name != "off" else None, max_batch=4)
    batch = e.generate(reqs, PARAMS["T1"], should_stop=stop_after_three)
    assert len(batch.steps) == 3 and 0 < len(batch.rollouts) < len(full)
    preempted = [r for r in batch if r.finish_reason.value == "preempted"]
    assert preempted  # rows still running at the third step
    for r in batch:
        whole = full[(r.prompt_id, r.sample)]
        assert whole[: len(r.tokens)] == r.tokens  # the same noise: a prefix of what it would have become
        if r.finish_reason.value != "preempted":
            assert r.tokens == whole
    # The engine is reusable after a preemption: the next call is complete and identical.
    again = e.generate(reqs, PARAMS["T1"])
    assert {(r.prompt_id, r.sample): r.tokens for r in again} == full
