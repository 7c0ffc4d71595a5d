"""The megatron actor backend.

Always (pure tensor code): HF -> megatron -> HF is bit-exact for every family, TP shards merge back
exactly, and the fused QKV / fc1 weights compute HF's q, k, v and SwiGLU when split the way
megatron-core's attention and MLP split them. With megatron-core installed: the GPTModel the actor
builds loads the converted weights strictly; megatron's own forward, run on CPU by
`emulate_cuda_on_cpu`, equals HF's logits, and the actor equals the torch actor (log-probs,
updates, weights, resume), also at tensor_parallel=2 over gloo. On CUDA: the real thing.

Run as `torchrun -m tests.test_megatron_actor --model DIR --out FILE` it is that test's worker.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.actors import ActorConfig, build_actor
from pipeline.actors.megatron_convert import (GPTLayout, fuse_qkv, hf_to_megatron, megatron_to_hf, rope_settings,
                                              split_qkv, split_tensor, tp_merge, tp_split)
from tests.conftest import FAMILIES, REPO, make_hf_model
from tests.mp.actor_worker import make_batch, pg_loss

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron")
HAVE_MEGATRON = all(importlib.util.find_spec(m) is not None for m in ("megatron", "megatron.core"))
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core not installed: pip install -e .[megatron]")
ACTOR = dict(lr=1e-3, grad_clip=0.5, micro_batch_tokens=28)


def layout_of(model, **kw) -> GPTLayout:
    return GPTLayout.from_hf_config(model.config, **kw)


@pytest.mark.parametrize("fused_norms", [False, True], ids=["local-spec", "te-spec"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_megatron_and_back_is_bit_exact(family, fused_norms):
    model = make_hf_model(family)
    for tp in (1, 2):  # 2 pads the vocabulary (101 -> 102 rows)
        layout = layout_of(model, tensor_parallel=tp, fused_norms=fused_norms)
        mc = hf_to_megatron(model.state_dict(), layout)
        assert ("output_layer.weight" in mc) == (family == "qwen2")  # tied for llama / qwen3
        assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mc) == (family == "qwen2")
        assert ("decoder.layers.0.self_attention.q_layernorm.weight" in mc) == (family == "qwen3")
        assert ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in mc) == fused_norms
        assert mc["embedding.word_embeddings.weight"].shape[0] == layout.padded_vocab
        back, hf = megatron_to_hf(mc, layout), dict(model.named_parameters())
        assert back.keys() == hf.keys()
        assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_tp_shards_merge_back_exactly_and_have_per_rank_shapes():
    model = make_hf_model("qwen2")  # qkv bias and an untied, vocab-parallel output layer
    layout = layout_of(model, tensor_parallel=2)
    mc = hf_to_megatron(model.state_dict(), layout)
    ranks = tp_split(mc, 2)
    merged = tp_merge(ranks)
    assert merged.keys() == mc.keys() and all(torch.equal(merged[k], mc[k]) for k in mc)
    shard, full = ranks[1], mc
    layer = "decoder.layers.0."
    for name, dim in [("embedding.word_embeddings.weight", 0), ("output_layer.weight", 0),
                      (layer + "self_attention.linear_qkv.weight", 0), (layer + "self_attention.linear_qkv.bias", 0),
                      (layer + "mlp.linear_fc1.weight", 0), (layer + "self_attention.linear_proj.weight", 1),
                      (layer + "mlp.linear_fc2.weight", 1)]:
        assert shard[name].shape[dim] * 2 == full[name].shape[dim], name
    assert torch.equal(shard[layer + "input_layernorm.weight"], full[layer + "input_layernorm.weight"])
    with pytest.raises(ValueError, match="tensor_parallel=3"):
        split_tensor(layer + "mlp.linear_fc2.weight", full[layer + "mlp.linear_fc2.weight"], 3)


def megatron_qkv(fused_out: torch.Tensor, layout: GPTLayout, groups: int):
    """megatron-core's split of linear_qkv's output [n, groups * (hpg + 2) * d] (SelfAttention.
    get_query_key_value_tensors): view [n, groups, (hpg + 2) * d], split [hpg * d, d, d]."""
    hpg, d = layout.heads_per_group, layout.head_dim
    return fused_out.view(-1, groups, (hpg + 2) * d).split([hpg * d, d, d], dim=-1)


def test_fused_qkv_computes_hf_q_k_v_by_megatrons_split_also_per_tp_rank():
    model = make_hf_model("qwen2")
    attn, layout = model.model.layers[1].self_attn, layout_of(model)
    fused_w = fuse_qkv(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, layout)  # [ng*(hpg+2)*d, H]
    fused_b = fuse_qkv(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias, layout)
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ng, hpg, d = layout.num_query_groups, layout.heads_per_group, layout.head_dim
    with torch.no_grad():
        q, k, v = megatron_qkv(x @ fused_w.T + fused_b, layout, ng)  # [5, ng, hpg*d], [5, ng, d], [5, ng, d]
        torch.testing.assert_close(q, attn.q_proj(x).view(5, ng, hpg * d), rtol=0, atol=1e-5)
        torch.testing.assert_close(k, attn.k_proj(x).view(5, ng, d), rtol=0, atol=1e-5)
        torch.testing.assert_close(v, attn.v_proj(x).view(5, ng, d), rtol=0, atol=1e-5)
        # TP rank r's rows are whole query groups: its output splits the same way into its groups.
        shards = zip(split_tensor("linear_qkv.weight", fused_w, 2), split_tensor("linear_qkv.bias", fused_b, 2))
        for r, (w, b) in enumerate(shards):
            for got, want in zip(megatron_qkv(x @ w.T + b, layout, ng // 2), (q, k, v)):
                torch.testing.assert_close(got, want[:, r : r + 1], rtol=0, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused_w, layout), (attn.q_proj.weight, attn.k_proj.weight,
                                                                              attn.v_proj.weight)))


def test_fused_fc1_computes_hf_swiglu_also_per_tp_rank():
    model = make_hf_model("llama")
    mlp = model.model.layers[0].mlp
    mc = hf_to_megatron(model.state_dict(), layout_of(model))["decoder.layers.0.mlp.linear_fc1.weight"]  # [2F, H]
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    def swiglu(y):  # megatron's gated MLP on fc1's output
        first, second = y.chunk(2, dim=-1)
        return torch.nn.functional.silu(first) * second

    with torch.no_grad():
        ref = torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)  # [5, F]
        torch.testing.assert_close(swiglu(x @ mc.T), ref, rtol=0, atol=1e-5)
        parts = [swiglu(x @ w.T) for w in split_tensor("mlp.linear_fc1.weight", mc, 2)]
        torch.testing.assert_close(torch.cat(parts, dim=-1), ref, rtol=0, atol=1e-5)  # rank r: columns r of F


def test_unsupported_models_and_weights_raise_naming_them():
    model = make_hf_model("llama")
    layout = layout_of(model)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.bias"):
        hf_to_megatron({**model.state_dict(), "model.layers.0.mlp.up_proj.bias": torch.zeros(160)}, layout)
    partial = {k: v for k, v in model.state_dict().items() if "layers.2.mlp.down_proj" not in k}
    with pytest.raises(ValueError, match=r"no model\.layers\.2\.mlp\.down_proj\.weight"):
        hf_to_megatron(partial, layout)
    with pytest.raises(ValueError, match="attention_bias"):
        layout_of(make_hf_model("llama", attention_bias=True))
    with pytest.raises(ValueError, match="rope scaling"):
        yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
        rope_settings(make_hf_model("llama", rope_parameters=yarn).config)


def test_megatron_backend_on_cpu_raises_naming_actor_device():
    from common.config import load_config
    from launch.run.config import TrainConfig

    tiny = REPO / "configs" / "tiny.yaml"
    with pytest.raises(ValueError, match=r"actor\.device=cpu .* capability cpu that actor\.backend=megatron lacks"):
        load_config(TrainConfig, tiny, ["actor.backend=megatron", "actor.precision=float32"])
    load_config(TrainConfig, tiny, ["actor.backend=megatron", "actor.device=cuda", "actor.tensor_parallel=2",
                                    "actor.precision=float32"])


def test_build_actor_without_megatron_core_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "megatron.core", None)  # import megatron.core now raises ImportError
    with pytest.raises(ImportError, match=r"pip install -e \.\[megatron\]"):
        build_actor(ActorConfig(backend="megatron", device="cuda"), tmp_path)


# ---- with megatron-core: its GPTModel, and its forward on CPU ----

def emulate_cuda_on_cpu(set_attr=setattr) -> None:
    """Lets megatron-core 0.16's forward run on CPU (it places these on CUDA); test-only.

    Buffers it allocates on `torch.cuda.current_device()` go to the CPU; the causal mask it builds
    on "cuda" is built on the CPU; its CUDA RNG tracker (forked around dropout, which is off) is a
    no-op; and actor.device=cpu passes validation as cuda would.
    """
    import megatron.core.fusions.fused_softmax as fused_softmax
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    import pipeline.actors.megatron_actor as megatron_actor

    validate = ActorConfig.validate
    set_attr(torch.cuda, "current_device", lambda: "cpu")
    set_attr(fused_softmax, "get_default_causal_mask", lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1))
    set_attr(CudaRNGStatesTracker, "fork", lambda self, *a, **k: contextlib.nullcontext())
    set_attr(megatron_actor, "seed_cuda_tracker", lambda seed=0: None)
    set_attr(ActorConfig, "validate", lambda self: validate(dataclasses.replace(self, device="cuda")))


@pytest.fixture(scope="module")
def world1():
    """A gloo world of one with megatron's parallel state (TP = PP = 1), torn down after the module."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from pipeline.actors.megatron_actor import init_model_parallel

    init_model_parallel(1, 1, torch.device("cpu"))
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture
def cpu_megatron(world1, monkeypatch):
    emulate_cuda_on_cpu(monkeypatch.setattr)


def cpu_gpt_model(hf_model, dtype=torch.float32):
    from pipeline.actors.megatron_actor import build_gpt_model, load_megatron_state

    layout = layout_of(hf_model)
    model = build_gpt_model(hf_model.config, layout, ActorConfig(), torch.device("cpu")).to(dtype)
    load_megatron_state(model, hf_to_megatron(hf_model.state_dict(), layout))  # strict
    return model.eval()


@needs_megatron
@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_gpt_model_loads_the_converted_weights_strictly(world1, family):
    hf = make_hf_model(family)
    model = cpu_gpt_model(hf)
    mc = hf_to_megatron(hf.state_dict(), layout_of(hf))
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert {k: tuple(v.shape) for k, v in own.items()} == {k: tuple(v.shape) for k, v in mc.items()}
    assert all(torch.equal(own[k], mc[k]) for k in mc)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


@needs_megatron
@pytest.mark.parametrize("family,overrides", [("llama", {}), ("qwen2", {"rope_theta": 1e6}), ("qwen3", {}),
                                              ("llama", {"rope_parameters": LLAMA3_ROPE})],
                         ids=["llama", "qwen2-theta1e6", "qwen3", "llama3-rope-scaling"])
def test_megatron_forward_equals_hf_logits(cpu_megatron, family, overrides):
    hf = make_hf_model(family, max_position_embeddings=4096, **overrides).double()
    model = cpu_gpt_model(hf, torch.float64)
    ids = torch.randint(3, 101, (2, 160), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=torch.arange(160).expand(2, 160), attention_mask=None)
        ref = hf(input_ids=ids).logits  # [2, 160, V]
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)  # rotary tables are float32 in both


@needs_megatron
@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_actor_equals_the_torch_actor(cpu_megatron, family, tmp_path):
    make_hf_model(family).save_pretrained(tmp_path / "model")
    mg, th = (build_actor(ActorConfig(backend=b, **ACTOR), tmp_path / "model") for b in ("megatron", "torch"))
    batch, real = make_batch(), make_batch().attention_mask.bool()
    a, r = (x.logprobs(batch.input_ids, batch.attention_mask, entropy=True, hidden=True, hidden_layers=(0, 2))
            for x in (mg, th))
    for got, want in [(a.logprobs, r.logprobs), (a.entropy, r.entropy), (a.hidden[real], r.hidden[real]),
                      (a.hidden_layers[2][real], r.hidden_layers[2][real])]:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (a.logprobs[~real] == 0).all() and torch.equal(a.hidden_layers[0][real], r.hidden_layers[0][real])
    weights, hf = dict(mg.named_weights()), dict(th.named_weights())
    assert weights.keys() == hf.keys() and all(torch.equal(weights[k], hf[k]) for k in hf)
    for _ in range(2):
        got, want = mg.update(batch, pg_loss), th.update(batch, pg_loss)
        for key in ("train/loss", "train/grad_norm", "train/ratio_mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
    mg.save(tmp_path / "ckpt")
    after = mg.update(batch, pg_loss)
    resumed = build_actor(ActorConfig(backend="megatron", **ACTOR), tmp_path / "model")
    resumed.load(tmp_path / "ckpt")
    assert resumed.update(batch, pg_loss) == after
    (tmp_path / "ckpt" / "optimizer_tp0.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"ckpt is malformed: missing optimizer_tp0\.pt"):
        resumed.load(tmp_path / "ckpt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(model_root: Path, out: Path) -> None:
    """Two ranks over gloo: qwen2 and qwen3 at tensor_parallel=2, qwen3 at data parallel 2; rank 0's rows
    are 5 of make_batch's and rank 1's the last. Writes rank 0's log-probs, whether named_weights are the
    folder's, and the 3 steps' losses summed over ranks, for each run."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    emulate_cuda_on_cpu()
    rank, results = dist.get_rank(), {}
    local = make_batch().select(slice(0, 5) if rank == 0 else slice(5, 6))
    for family, tp in (("qwen2", 2), ("qwen3", 2), ("qwen3", 1)):
        actor = build_actor(ActorConfig(backend="megatron", tensor_parallel=tp, **ACTOR), model_root / family)
        out_lp = actor.logprobs(local.input_ids, local.attention_mask).logprobs
        hf = dict(AutoModelForCausalLM.from_pretrained(model_root / family).named_parameters())
        weights = dict(actor.named_weights())
        weights_match = weights.keys() == hf.keys() and all(torch.equal(weights[k], hf[k]) for k in hf)
        losses = []
        for _ in range(3):
            loss = torch.tensor(actor.update(local, pg_loss)["train/loss"], dtype=torch.float64)
            dist.all_reduce(loss)
            losses.append(float(loss))
        results[f"{family}-tp{tp}"] = {"logprobs": out_lp.tolist(), "weights_match": weights_match, "losses": losses}
        parallel_state.destroy_model_parallel()
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


@needs_megatron
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tensor_parallel_2_and_data_parallel_2_give_the_single_process_results(tmp_path):
    for family in ("qwen2", "qwen3"):
        make_hf_model(family).save_pretrained(tmp_path / family)
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "tests.test_megatron_actor", "--model", str(tmp_path),
           "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=360, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    batch = make_batch()
    for run, r in results.items():
        family = run.split("-")[0]
        torch_actor = build_actor(ActorConfig(**ACTOR), tmp_path / family)
        ref = torch_actor.logprobs(batch.input_ids, batch.attention_mask).logprobs
        torch.testing.assert_close(torch.tensor(r["logprobs"]), ref[:5], rtol=0, atol=1e-5, msg=run)
        assert r["weights_match"], run  # gathered over TP: bit for bit the folder's
        single = [torch_actor.update(batch, pg_loss)["train/loss"] for _ in range(3)]
        assert single[-1] < single[0] - 0.01  # the run moved: matching losses say something
        # Qwen3's q/k-norm gradients summed over TP matter here at ~1e-4 relative (measured).
        assert r["losses"] == pytest.approx(single, rel=1e-6, abs=1e-9), run


# ---- on CUDA ----

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.gpu
@needs_megatron
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has no GPU")
def test_cuda_megatron_actor_matches_the_torch_actor(family, tmp_path):
    make_hf_model(family).save_pretrained(tmp_path / "model")
    kw = dict(ACTOR, device="cuda")
    mg, th = (build_actor(ActorConfig(backend=b, **kw), tmp_path / "model") for b in ("megatron", "torch"))
    batch = make_batch()
    a, r = (x.logprobs(batch.input_ids, batch.attention_mask, entropy=True) for x in (mg, th))
    torch.testing.assert_close(a.logprobs, r.logprobs, rtol=0, atol=1e-3)  # float32; TF32 / fused kernels may differ
    torch.testing.assert_close(a.entropy, r.entropy, rtol=0, atol=1e-3)
    weights, hf = dict(mg.named_weights()), dict(th.named_weights())
    assert weights.keys() == hf.keys() and all(torch.equal(weights[k], hf[k]) for k in hf)
    for _ in range(2):  # the second loss is after one step of each
        want = th.update(batch, pg_loss)["train/loss"]
        assert mg.update(batch, pg_loss)["train/loss"] == pytest.approx(want, rel=1e-3)


@pytest.mark.gpu
@needs_megatron
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has no GPU")
def test_cuda_bfloat16_megatron_logprobs_are_as_close_to_float32_as_the_torch_actors(tmp_path):
    make_hf_model("qwen3").save_pretrained(tmp_path / "model")
    batch = make_batch()
    exact = build_actor(ActorConfig(device="cuda"), tmp_path / "model").logprobs(batch.input_ids, batch.attention_mask)
    err = {}
    for backend in ("megatron", "torch"):
        actor = build_actor(ActorConfig(backend=backend, device="cuda", dtype="bfloat16"), tmp_path / "model")
        logprobs = actor.logprobs(batch.input_ids, batch.attention_mask).logprobs
        err[backend] = float((logprobs - exact.logprobs).abs().mean())
    assert err["megatron"] <= 2 * err["torch"] + 1e-3, err


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    worker(args.model, args.out)
