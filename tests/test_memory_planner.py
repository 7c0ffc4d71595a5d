"""The memory planner's figures against what they claim to count: DeepSpeed's own estimators for the
model states; the tensors autograd saves in a transformers model, and the peak of the live tensors of
the actor's forward and backward, for the activations."""

from __future__ import annotations

import contextlib
import io
import re
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.model_config import ModelConfig
from launch.memory.actor import (ModelStates, activation_parts, head_bytes, layer_activation_bytes, param_counts,
                                 zero_model_states)
from tests.conftest import FAMILIES, make_hf_model

QWEN7B = ModelConfig(family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4)


def _shape(model) -> ModelConfig:
    return ModelConfig.from_hf(model.config.to_dict())


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_counts_are_deepspeeds_for_a_transformers_model(family):
    from deepspeed.runtime.zero.stage3 import model_to_params

    model = make_hf_model(family)
    total, largest = model_to_params(model)
    p = param_counts(_shape(model))
    assert (p.total, p.largest_module) == (total, largest)


def test_the_qwen_7b_shape_has_its_published_parameter_count():
    assert round(param_counts(QWEN7B).total / 1e9, 2) == 7.62  # Qwen2.5-7B: 7.61B, 7.62B with its untied head


def _device(s: ModelStates) -> int:
    return sum(p.bytes for p in s.device)


def _host(s: ModelStates) -> int:
    return sum(p.bytes for p in s.host_per_node)


@pytest.mark.parametrize("nodes, per_node", [(1, 8), (4, 8), (16, 8)])
@pytest.mark.parametrize("offload", [False, True])
def test_zero2_model_states_agree_with_deepspeeds_estimator(nodes, per_node, offload):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    p = param_counts(QWEN7B)
    cpu, gpu = estimate_zero2_model_states_mem_needs(p.total, num_gpus_per_node=per_node, num_nodes=nodes,
                                                     cpu_offload=offload)
    s = zero_model_states(p, stage=2, world=nodes * per_node, ranks_per_node=per_node, offload_optimizer=offload,
                          offload_params=False)
    assert _device(s) == pytest.approx(gpu, rel=1e-6)
    if offload:
        assert _host(s) == pytest.approx(cpu, rel=1e-6)


@pytest.mark.parametrize("nodes, per_node", [(1, 8), (4, 8), (16, 8)])
@pytest.mark.parametrize("offload_optimizer, offload_params", [(False, False), (True, False), (True, True)])
def test_zero3_model_states_agree_with_deepspeeds_estimator(nodes, per_node, offload_optimizer, offload_params):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    p = param_counts(QWEN7B)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(p.total, p.largest_module, num_gpus_per_node=per_node,
                                                        num_nodes=nodes, cpu_offload=offload_optimizer,
                                                        cpu_offload_params=offload_params, zero_init=True)
    s = zero_model_states(p, stage=3, world=nodes * per_node, ranks_per_node=per_node,
                          offload_optimizer=offload_optimizer, offload_params=offload_params)
    assert _device(s) == pytest.approx(gpu, rel=1e-6)
    if offload_optimizer:
        assert _host(s) == pytest.approx(cpu, rel=1e-6)


def test_the_zero3_table_deepspeed_prints_holds_the_planners_figures():
    """DeepSpeed's `_all_cold` estimator prints a table (GiB per CPU and per GPU by option); the planner's
    figures for the 7B on 4 x 8 GPUs are its rows."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold

    p = param_counts(QWEN7B)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        estimate_zero3_model_states_mem_needs_all_cold(p.total, p.largest_module, num_gpus_per_node=8, num_nodes=4)
    rows = {("cpu" in m.group(4), "cpu" in m.group(3)): (float(m.group(1)), float(m.group(2)))
            for m in re.finditer(r"^\s*([\d.]+)GB \|\s*([\d.]+)GB \| offload_param=(\S+?)\s*, offload_optimizer=(\S+?)\s*, "
                                 r"zero_init=1$", out.getvalue(), re.M)}
    assert set(rows) == {(False, False), (True, False), (True, True)}, out.getvalue()
    for (opt, par), (cpu, gpu) in rows.items():
        s = zero_model_states(p, stage=3, world=32, ranks_per_node=8, offload_optimizer=opt, offload_params=par)
        assert round(_device(s) / 2**30, 2) == gpu
        if opt:
            assert round(_host(s) / 2**30, 2) == cpu


def _saved_bytes(model, tokens: int) -> int:
    """Bytes of the tensors autograd saves in one forward of `tokens` tokens (parameters excluded)."""
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(3, model.config.vocab_size, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False)
    return sum(n for ptr, n in seen.items() if ptr not in params)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layers_activation_bytes_are_what_autograd_saves(family, dtype):
    """The difference between a 4-layer and a 2-layer model is two layers' saved tensors, whatever
    the rest of the model saves; per token it is the planner's count (SDPA attention, no mask)."""
    tokens = 128
    saved = {}
    for layers in (2, 4):
        model = make_hf_model(family, num_hidden_layers=layers, attn_implementation="sdpa").to(dtype).train()
        saved[layers] = _saved_bytes(model, tokens)
    per_layer = (saved[4] - saved[2]) / 2 / tokens
    assert per_layer == pytest.approx(layer_activation_bytes(_shape(model), dtype.itemsize), rel=0.01)


def test_without_checkpointing_the_update_keeps_every_layers_activations_and_with_it_only_their_inputs():
    m = QWEN7B
    full = activation_parts(m, 32768, dtype_bytes=2, checkpointing=False, head_chunk_tokens=512)
    ckpt = activation_parts(m, 32768, dtype_bytes=2, checkpointing=True, head_chunk_tokens=512)
    assert full[0].bytes == m.num_hidden_layers * 32768 * layer_activation_bytes(m, 2)
    assert ckpt[0].bytes == m.num_hidden_layers * 32768 * m.hidden_size * 2
    # Checkpointed, the backward recomputes a layer, larger at 32k tokens than the LM head's chunk buffers.
    assert ckpt[2].bytes == 32768 * layer_activation_bytes(m, 2) > full[2].bytes
    assert sum(p.bytes for p in ckpt) < sum(p.bytes for p in full) / 5


def test_the_lm_heads_backward_grows_with_its_chunk_and_only_its_hidden_gradient_with_the_micro_batch():
    m = QWEN7B
    work = lambda tokens, chunk: activation_parts(m, tokens, dtype_bytes=2, checkpointing=False,  # noqa: E731
                                                 head_chunk_tokens=chunk)[2].bytes
    H = m.hidden_size
    assert work(4096, 512) - 4096 * H * 2 == work(32768, 512) - 32768 * H * 2 == head_bytes(m, 512, weight_bytes=2,
                                                                                          float32_head=False)
    assert work(32768, 1024) - work(32768, 512) == 512 * m.vocab_size * (3 * 4 + 2)


class LiveTensors(TorchDispatchMode):
    """The bytes of the CPU tensors that ops create and that are still alive, and their peak (storages
    already alive when it starts, such as parameters and gradients, are not counted)."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen = set(skip)

    def _freed(self, key: int, n: int) -> None:
        self.live -= n
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s.data_ptr() and s.data_ptr() not in self.seen:
                    self.seen.add(s.data_ptr())
                    self.live += s.nbytes()
                    weakref.finalize(s, self._freed, s.data_ptr(), s.nbytes())
                    self.peak = max(self.peak, self.live)
        return out


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_updates_planned_activations_are_the_peak_of_its_live_tensors(tmp_path, checkpointing):
    """One micro-batch's forward and backward through the actor's own forward (chunked LM head), its
    live tensors tracked op by op: their peak is the plan's update activations within 10%."""
    from pipeline.actors.base import ActorConfig
    from pipeline.actors.forward import forward_in, load_policy

    make_hf_model("llama", vocab=3000, num_hidden_layers=4).save_pretrained(tmp_path)
    cfg = ActorConfig(attention="sdpa", head_chunk_tokens=128, gradient_checkpointing=checkpointing)
    model = load_policy(tmp_path, cfg).train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    rows, length = 4, 256
    ids = torch.randint(3, 3000, (rows, length))
    tracked = LiveTensors({t.untyped_storage().data_ptr() for p in model.parameters() for t in (p, p.grad)})
    with tracked:
        forward_in(model, cfg)(ids, torch.ones_like(ids)).logprobs.sum().backward()
    planned = activation_parts(_shape(model), rows * length, dtype_bytes=4, checkpointing=checkpointing,
                               head_chunk_tokens=128)
    assert sum(p.bytes for p in planned) == pytest.approx(tracked.peak, rel=0.10)


def test_the_planners_zero3_live_parameters_are_the_actors_setting():
    from launch.memory.actor import ZERO3_MAX_LIVE_PARAMETERS
    from pipeline.actors.deepspeed_actor import zero3_settings

    assert zero3_settings(576)["stage3_max_live_parameters"] == ZERO3_MAX_LIVE_PARAMETERS


def test_the_cost_tuners_one_time_measurement_is_planned_at_build():
    """engine.spec.tuner=cost measures passes on a private KV cache of max_batch rows: the build phase holds it."""
    from engine.config import EngineConfig
    from engine.spec.config import SpecConfig
    from launch.memory.rollout import engine_parts

    from tests.conftest import hf_config

    m = ModelConfig.from_hf(hf_config("llama").to_dict())
    spec = dict(enabled=True, drafter="ngram", tuner_arms=["off", "d2k1v2"], max_depth=6, max_verify_tokens=6)
    names = lambda tuner: [p.name for p in engine_parts(m, EngineConfig(max_batch=8, max_len=64, spec=SpecConfig(**spec, tuner=tuner)),  # noqa: E731
                                                        n=4, max_new_tokens=32, cuda=False, cpu_tile_n=None)]
    assert "cost tuner's pass measurement" in names("cost")
    assert "cost tuner's pass measurement" not in names("bandit")
