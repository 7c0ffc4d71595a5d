"""The DataBuffer filled from the actor's log-prob forward (engines without hidden states: vLLM):
its entries are the native engine sink's for the same rollouts, its HeadTarget follows the policy's
weight sync, and build_spot_work wires it for such an engine with the drafter folder's weights."""

from __future__ import annotations

import os
import uuid
from types import SimpleNamespace

import pytest
import torch

from engine.backend import BackendCapabilities
from engine.checkpoint import load_checkpoint, read_config
from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.sampling import SamplingParams
from engine.spec.config import SpecConfig
from engine.spec.eagle import EagleConfig, EagleModel
from engine.spec.eagle_drafter import EagleDrafter
from engine.types import Request
from pipeline.actors import ActorConfig, build_actor
from pipeline.update.train_batch import pack_rollouts
from spot.buffer.actor_features import ActorFeatures, HeadTarget
from spot.buffer.ring import DataBuffer
from spot.buffer.segment import node_segment
from spot.buffer.sink import DataBufferSink


@pytest.fixture
def names():
    made = [f"tailspec-test-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    yield made
    for name in made + [node_segment(n) for n in made]:  # a buffer_name's segment is node_segment(name)
        for p in (f"/dev/shm/{name}", f"/dev/shm/{name}.lock"):
            if os.path.exists(p):
                os.unlink(p)


def entries(buf: DataBuffer) -> dict:
    return {i.key: buf.read(i) for i in buf.infos()}


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_entries_from_the_actor_forward_are_the_native_sinks_for_the_same_rollouts(hf_folders, names, kind):
    folder = hf_folders["llama"]
    target = load_checkpoint(folder)
    torch.manual_seed(0)
    net = EagleModel(EagleConfig.for_target(target.config, kind), target)
    layers = tuple(net.config.aux_layers)
    F = net.config.feature_size
    with DataBuffer.create(names[0], capacity_bytes=8 * 2**20, feature_size=F) as native, \
            DataBuffer.create(names[1], capacity_bytes=8 * 2**20, feature_size=F) as from_actor:
        sink = DataBufferSink(native, max_new_tokens=20, feature_layers=layers)
        engine = RolloutEngine(target, EngineConfig(max_batch=4, max_len=96, spec=SpecConfig(depth=3, verify_tokens=3)),
                               EagleDrafter(net), sink=sink)
        reqs = [Request(prompt_id=f"p{i}", prompt=[5 + i, 9, 17, 3 + i], n=3) for i in range(2)]
        batch = engine.generate(reqs, SamplingParams(max_new_tokens=20, temperature=1.0, seed=3, stop_token_ids=(2,)))
        sink.flush(batch.rollouts, step=7)
        prompts = [r.prompt for r in reqs for _ in range(r.n)]
        packed = pack_rollouts(prompts, [r.tokens for r in batch], [r.logprobs for r in batch],
                               torch.zeros(len(batch)), pad_id=0)
        producer = ActorFeatures(from_actor, max_new_tokens=20, feature_layers=layers,
                                 num_layers=target.config.num_hidden_layers)
        actor = build_actor(ActorConfig(micro_batch_tokens=64), folder)  # several micro-batches: rows put back in order
        out = actor.logprobs(packed.input_ids, packed.attention_mask, **producer.logprobs_kwargs)
        put = producer.put(batch.rollouts, prompts, packed.input_ids, out, step=7)
        ours, theirs = entries(from_actor), entries(native)
        assert put == len(theirs) == len(batch.rollouts) - sink.skipped and set(ours) == set(theirs)
        for key, want in theirs.items():
            got = ours[key]
            assert torch.equal(got.tokens, want.tokens)
            assert (got.step, got.policy_version, got.finished, got.prompt_len) == (
                want.step, want.policy_version, want.finished, want.prompt_len)
            # Teacher-forced through transformers, the engine's while it decoded: the same features.
            torch.testing.assert_close(got.features, want.features, atol=1e-4, rtol=0)


def test_a_feature_layer_the_actor_forward_cannot_return_is_refused(hf_folders, names):
    with DataBuffer.create(names[0], capacity_bytes=2**20, feature_size=128) as buf:
        with pytest.raises(ValueError, match="decoder layers 0..1"):
            ActorFeatures(buf, max_new_tokens=8, feature_layers=(2,), num_layers=3)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # a tied and an untied LM head
def test_a_head_target_following_the_weight_sync_gives_the_drafter_the_targets_logits(hf_folders, family):
    folder = hf_folders[family]
    target = load_checkpoint(folder)
    actor = build_actor(ActorConfig(), folder)
    with torch.no_grad():
        for p in actor.model.parameters():  # "an update": the policy now differs from the folder
            p.add_(0.1 * torch.randn_like(p))
    head = HeadTarget(read_config(folder))
    engine = RolloutEngine(target, EngineConfig(max_batch=2, max_len=32))
    engine.load_weights(head.follow(actor.named_weights()), version=1)  # the loop's sync, watched
    torch.manual_seed(0)
    on_head = EagleModel(EagleConfig.for_target(target.config), head)
    on_target = EagleModel(EagleConfig.for_target(target.config), target)
    on_target.load_state_dict(on_head.state_dict())
    tokens, features = torch.tensor([[3, 7, 11]]), torch.randn(1, 3, target.config.hidden_size)
    pos = torch.arange(3)[None]
    with torch.no_grad():
        got = on_head.logits(on_head(tokens, features, pos))
        want = on_target.logits(on_target(tokens, features, pos))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_build_spot_work_for_an_engine_without_hidden_states_trains_the_folders_drafter(hf_folders, names, tmp_path):
    from spot.colocated import build_spot_work
    from spot.config import SpotConfig

    folder = hf_folders["llama"]
    target = load_checkpoint(folder)
    torch.manual_seed(0)
    EagleModel(EagleConfig.for_target(target.config), target).save(tmp_path / "drafter")
    spec = SpecConfig(enabled=True, drafter="eagle", drafter_path=str(tmp_path / "drafter"), depth=2, verify_tokens=2)
    # What build_spot_work reads of a vLLM engine (engine.backends.vllm_engine.VllmEngine).
    engine = SimpleNamespace(cfg=EngineConfig(backend="vllm", spec=spec), path=folder, sink=None, drafter_nets=lambda: [],
                             caps=BackendCapabilities(exact_logprobs=False, returns_features=False, same_tokens=False,
                                                      preemptible=False, takes_drafts=False, sleeps=False))
    run = build_spot_work(SpotConfig(enabled=True, buffer_name=names[0], buffer_mb=1), engine, run_name="t", rank=0,
                          local_rank=0, world=1, seed=0, max_new_tokens=16)
    try:
        assert engine.sink is None and run.actor_features is run.work.sink
        trained = run.work.trainer.model
        assert isinstance(trained.target, HeadTarget) and run.actor_features.head is trained.target
        saved = EagleModel.load(tmp_path / "drafter", target)
        assert all(torch.equal(p, dict(saved.named_parameters())[n]) for n, p in trained.named_parameters())
        assert run.work.rollouts_done(1, SimpleNamespace(rollouts=[])) is None and run.buffer.infos() == []
    finally:
        run.close()
