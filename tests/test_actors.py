"""The actor backends: log-probs against a hand computation, exact micro-batching, detached hidden
states, bit-for-bit resume, checkpoint errors, DeepSpeed's config, and DDP / DeepSpeed ZeRO-1 / 2 / 3
at world size 2 (losses, resume, ZeRO-3's weights and its layer-by-layer gathering), their chunked
LM head against one process computing log-probs from the whole logits."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipeline.actors import ActorConfig, build_actor
from pipeline.actors.deepspeed_actor import deepspeed_config, layer_key
from pipeline.actors.forward import equal_count, micro_batches, policy_forward
from tests.conftest import REPO, hf_config, make_hf_model
from tests.mp.actor_worker import BACKENDS, RESUMED, TRAIN, make_batch, pg_loss, whole_logits_forward


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("actor-model")
    make_hf_model("llama").save_pretrained(path)
    return path


def actor(model_dir, **kw):
    return build_actor(ActorConfig(**{"lr": 1e-3, "grad_clip": 0.5, **kw}), model_dir)


def test_logprobs_equal_log_softmax_of_hf_logits_at_the_next_token(model_dir):
    batch = make_batch()
    out = actor(model_dir, micro_batch_tokens=20).logprobs(batch.input_ids, batch.attention_mask, entropy=True,
                                                           hidden=True, hidden_layers=(0, 2))
    hf = make_hf_model("llama")
    with torch.no_grad():
        ref = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
    logp = torch.log_softmax(ref.logits, -1)  # [B, T, V]
    real = batch.attention_mask.bool()
    for b in range(batch.size):
        for t in range(1, int(real[b].sum())):
            assert out.logprobs[b, t].item() == pytest.approx(logp[b, t - 1, batch.input_ids[b, t]].item(), abs=1e-5)
            entropy = -(logp[b, t - 1].exp() * logp[b, t - 1]).sum()
            assert out.entropy[b, t].item() == pytest.approx(entropy.item(), abs=1e-5)
    assert (out.logprobs[:, 0] == 0).all() and (out.logprobs[~real] == 0).all()
    torch.testing.assert_close(out.hidden[real], ref.hidden_states[-1][real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.hidden_layers[2][real], ref.hidden_states[2][real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_forward_without_a_padding_mask_gives_each_real_token_what_the_masked_forward_gives(hf_folders, family):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_folders[family], dtype=torch.float32).eval()
    batch = make_batch()
    with torch.no_grad():
        out = policy_forward(model, batch.input_ids, batch.attention_mask)
        masked = torch.log_softmax(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, -1)
    picked = masked[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    real = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(out.logprobs[:, 1:][real], picked[real], atol=1e-5, rtol=1e-5)


def test_a_row_with_a_real_token_after_a_pad_is_refused_by_name(model_dir):
    batch = make_batch()
    left_padded = batch.attention_mask.flip(-1)  # pads first: the causal forward would let real tokens see them
    with pytest.raises(ValueError, match="right-padded"):
        actor(model_dir).logprobs(batch.input_ids, left_padded)


def test_micro_batches_hold_at_most_the_token_budget_and_cover_every_row_once():
    mask = make_batch(rows=9).attention_mask
    groups = micro_batches(mask, budget=30)
    rows = torch.cat([r for r, _ in groups])
    assert sorted(rows.tolist()) == list(range(9)) and len(groups) > 1
    for r, length in groups:
        assert length == int(mask[r].sum(-1).max())
        assert len(r) == 1 or len(r) * length <= 30
    assert len(micro_batches(mask, budget=1)) == 9  # a row over the budget is alone
    split = equal_count(groups, len(groups) + 2)
    assert len(split) == len(groups) + 2 and sorted(torch.cat([r for r, _ in split]).tolist()) == list(range(9))


def trained(model_dir, steps=2, **kw):
    a = actor(model_dir, **kw)
    metrics = [a.update(make_batch(), pg_loss) for _ in range(steps)]
    return a, metrics


def test_the_additive_loss_metrics_add_up_over_micro_batches(model_dir):
    """train/pg_loss is a share of the mini-batch loss and train/response_tokens a count: however
    the rows are cut into micro-batches, they are the whole mini-batch's; token means stay means."""
    from pipeline.algorithms import AlgorithmConfig, build_algorithm

    algo = build_algorithm(AlgorithmConfig(name="grpo"), max_response_len=64)
    loss = lambda lp, ent, micro: algo.loss(lp, micro, ent)  # noqa: E731
    whole, micro = (actor(model_dir, micro_batch_tokens=b).update(make_batch(), loss) for b in (10_000, 20))
    assert micro["train/pg_loss"] == pytest.approx(whole["train/pg_loss"], abs=1e-7) != 0.0
    assert micro["train/pg_loss"] == pytest.approx(micro["train/loss"], abs=1e-7)
    assert micro["train/response_tokens"] == whole["train/response_tokens"] == float(make_batch().response_mask.sum())
    assert micro["train/pg_clipfrac"] == pytest.approx(whole["train/pg_clipfrac"], abs=1e-7)


def test_micro_batching_by_token_budget_gives_the_same_update_as_one_batch(model_dir):
    # Adam's first steps move a weight by about lr * g / |g|, so where a gradient is ~1e-8 float
    # noise can move it by up to lr: at lr = 1e-4, 1e-6 is 1% of that. Gradients are compared as well.
    (whole, m_whole), (micro, m_micro) = (trained(model_dir, lr=1e-4, micro_batch_tokens=b) for b in (10_000, 20))
    for (name, p), q in zip(whole.model.named_parameters(), micro.model.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=0, msg=name)
        torch.testing.assert_close(q.grad, p.grad, atol=1e-7, rtol=1e-4, msg=name)
    for a, b in zip(m_whole, m_micro):
        assert b["train/loss"] == pytest.approx(a["train/loss"], abs=1e-7)
        assert b["train/ratio_mean"] == pytest.approx(a["train/ratio_mean"], abs=1e-6)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)

    assert m_whole[1]["train/loss"] < m_whole[0]["train/loss"]  # the steps did something


def test_gradient_checkpointing_gives_the_same_update(model_dir):
    (plain, _), (ckpt, _) = (trained(model_dir, lr=1e-4, gradient_checkpointing=g) for g in (False, True))
    assert ckpt.model.is_activation_checkpointing and not plain.model.is_activation_checkpointing
    for (name, p), q in zip(plain.model.named_parameters(), ckpt.model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-7, rtol=1e-4, msg=name)


def test_hidden_states_are_detached_so_no_gradient_reaches_the_policy():
    model, batch = make_hf_model("llama"), make_batch()
    out = policy_forward(model, batch.input_ids, batch.attention_mask, hidden=True, hidden_layers=(1,))
    assert out.logprobs.requires_grad  # the forward itself is differentiable ...
    assert not out.hidden.requires_grad and not out.hidden_layers[1].requires_grad  # ... its hidden states are not
    with pytest.raises(RuntimeError):
        (out.hidden.sum() + out.hidden_layers[1].sum()).backward()
    assert all(p.grad is None for p in model.parameters())


def test_named_weights_are_the_hugging_face_parameters(model_dir):
    hf = dict(make_hf_model("llama").named_parameters())
    named = dict(actor(model_dir).named_weights())
    assert named.keys() == hf.keys()
    assert all(torch.equal(named[k], hf[k]) for k in hf)


def test_save_load_then_update_equals_an_uninterrupted_run_bit_for_bit(model_dir, tmp_path):
    batch = make_batch()
    a = actor(model_dir, micro_batch_tokens=20)
    a.update(batch, pg_loss)
    a.save(tmp_path / "ckpt")
    after = a.update(batch, pg_loss)
    b = actor(model_dir, micro_batch_tokens=20)
    b.load(tmp_path / "ckpt")
    resumed = b.update(batch, pg_loss)
    assert resumed == after
    wa, wb = dict(a.named_weights()), dict(b.named_weights())
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not (tmp_path / "ckpt.tmp").exists()


def test_a_malformed_checkpoint_folder_gives_an_error_naming_it(model_dir, tmp_path):
    a = actor(model_dir)
    a.save(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "optimizer.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"ckpt is malformed: missing optimizer\.pt"):
        a.load(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        a.load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_actor(ActorConfig(), tmp_path)


def test_config_errors_name_the_key():
    for kw, key in [({"micro_batch_tokens": 0}, "actor.micro_batch_tokens"), ({"lr": 0.0}, "actor.lr"),
                    ({"backend": "deepspeed", "offload_params": True, "zero_stage": 2}, "actor.offload_params"),
                    ({"device": "tpu"}, "actor.device"), ({"lr_schedule": "linear"}, "actor.lr_schedule"),
                    ({"lr_warmup_steps": -1}, "actor.lr_warmup_steps"), ({"lr_min_ratio": 1.5}, "actor.lr_min_ratio"),
                    ({"lr_schedule_steps": 0}, "actor.lr_schedule_steps")]:
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            ActorConfig(**kw).validate()


def test_deepspeed_config_renders_the_actor_section():
    cfg = ActorConfig(backend="deepspeed", lr=2e-5, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=1.0,
                      zero_stage=3, offload_optimizer=True, offload_params=True, dtype="bfloat16")
    ds = deepspeed_config(cfg, hidden_size=4096)  # a 7B's hidden size
    # transformers' "auto" values: H^2, 0.9 H^2, 10 H.
    assert ds["zero_optimization"] == {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
        "offload_param": {"device": "cpu", "pin_memory": False}, "overlap_comm": True, "contiguous_gradients": True,
        "reduce_bucket_size": 16_777_216, "stage3_prefetch_bucket_size": 15_099_494,
        "stage3_param_persistence_threshold": 40_960, "stage3_max_live_parameters": 10**9,
        "stage3_max_reuse_distance": 10**9, "stage3_gather_16bit_weights_on_model_save": False,
        "memory_efficient_linear": False}
    assert ds["optimizer"]["params"] == {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                         "torch_adam": True}
    assert ds["gradient_clipping"] == 1.0 and ds["bf16"] == {"enabled": True}
    # DeepSpeed derives the train batch from its data-parallel world size (the job's or the actor group's)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (1, 1)
    assert "train_batch_size" not in ds
    big = deepspeed_config(ActorConfig(backend="deepspeed", device="cuda", zero_stage=3), hidden_size=5120)
    z = big["zero_optimization"]  # a 32B's (Qwen2.5-32B: H = 5120)
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) \
        == (26_214_400, 23_592_960, 51_200)
    gpu = deepspeed_config(ActorConfig(backend="deepspeed", device="cuda", zero_stage=1))
    assert gpu["zero_optimization"] == {"stage": 1} and gpu["optimizer"]["params"]["torch_adam"] is False
    with pytest.raises(ValueError, match="hidden_size"):
        deepspeed_config(cfg)


def test_deepspeed_reads_every_rendered_key_and_rejects_an_unknown_zero_key():
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    cfg = ActorConfig(backend="deepspeed", device="cuda", zero_stage=3, offload_optimizer=True, offload_params=True,
                      dtype="bfloat16", grad_clip=0.7, lr=3e-6)
    ds = deepspeed_config(cfg, hidden_size=5120)  # outside torch.distributed: DeepSpeedConfig's world size is 1
    parsed = DeepSpeedConfig(ds)
    # DeepSpeed ignores unknown top-level keys silently, so each one is checked to have landed.
    batch = (parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps, parsed.train_batch_size)
    assert batch == (1, 1, 1)
    assert parsed.gradient_clipping == 0.7 and parsed.bfloat16_config.enabled
    assert parsed.optimizer_name == "adamw" and parsed.optimizer_params["lr"] == 3e-6
    assert parsed.steps_per_print == 2**31 - 1 and parsed.wall_clock_breakdown is False
    z = parsed.zero_config  # zero_optimization is a pydantic model with extra="forbid": an unknown key raises
    assert (z.stage, z.overlap_comm, z.contiguous_gradients, z.memory_efficient_linear) == (3, True, True, False)
    buckets = (z.reduce_bucket_size, z.prefetch_bucket_size, z.param_persistence_threshold)
    assert buckets == (26_214_400, 23_592_960, 51_200)
    assert (z.max_live_parameters, z.max_reuse_distance, z.gather_16bit_weights_on_model_save) == (10**9, 10**9, False)
    assert z.offload_param.device == "cpu" and z.offload_optimizer.device == "cpu" and z.offload_param.pin_memory
    with pytest.raises(ValidationError, match="stage3_prefetch_bucket"):
        DeepSpeedZeroConfig(**{**ds["zero_optimization"], "stage3_prefetch_bucket": 1})


def test_layer_key_puts_each_decoder_layers_parameters_together_and_top_level_tensors_alone():
    assert layer_key("model.layers.3.mlp.up_proj.weight") == layer_key("model.layers.3.input_layernorm.weight")
    assert layer_key("model.layers.3.mlp.up_proj.weight") != layer_key("model.layers.13.mlp.up_proj.weight")
    assert layer_key("model.embed_tokens.weight") == "model.embed_tokens.weight"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STEPS = 3  # steps before the save; the worker takes RESUMED more after it


def run_actor_worker(model_dir: Path, folder: Path, procs: int, *args: str) -> dict:
    """tests/mp/actor_worker.py under torchrun with `procs` processes: its results (rank 0's --out)."""
    out = folder / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(REPO / "tests/mp/actor_worker.py"), "--model", str(model_dir),
           "--out", str(out), "--steps", str(STEPS), "--budget", "28", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def world_size_2(model_dir, tmp_path_factory) -> Iterator[tuple[dict, Path]]:
    """tests/mp/actor_worker.py's results at world size 2, and the folder with its weight files and checkpoints."""
    folder = tmp_path_factory.mktemp("world-size-2")
    yield run_actor_worker(model_dir, folder, 2), folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def single_process(model_dir) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The one-process torch actor on the whole batch, its log-probs computed from the model's whole
    logits (not the chunked head): its STEPS + RESUMED losses, and its weights after STEPS."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("pipeline.actors.forward.policy_forward", whole_logits_forward)
        a = build_actor(ActorConfig(**TRAIN, micro_batch_tokens=28), model_dir)
        losses, weights = [], {}
        for step in range(STEPS + RESUMED):
            losses.append(a.update(make_batch(), pg_loss)["train/loss"])
            if step == STEPS - 1:
                weights = {k: w.clone() for k, w in a.named_weights()}
    return losses, weights


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_zero1_2_and_3_at_world_size_2_with_the_chunked_head_give_the_whole_logits_losses_and_resume_exactly(
        world_size_2, single_process):
    results, _ = world_size_2
    single, _ = single_process
    assert single[-1] < single[0] - 0.01  # the run moved: matching losses say something
    for backend in BACKENDS:
        r = results[backend]
        # Two ranks sum their gradients (ZeRO-2 / 3: bucketed reduce-scatters) in another order than one
        # process does, and the chunked head sums its weight's gradient over chunks, which changes float32
        # rounding only: measured max relative deviations over the 5 steps are 1.6e-7 (DDP), 2.0e-7
        # (ZeRO-2), 1.0e-7 (ZeRO-3) with whole logits on both sides. 1e-5 leaves 50x room, and ZeRO-3
        # with every matrix in the no-decay group (measured) is off by 9.7e-5 at step 2, 8.6e-4 at step 5.
        assert r["losses"] == pytest.approx(single, rel=1e-5, abs=1e-7), backend
        assert r["resumed"] == r["losses"][-RESUMED:], backend  # resume is bit for bit, optimizer state included
        assert r["lr_zero_still"], backend  # set_lr reaches the optimizer that steps (ZeRO's partitions too)
        assert f"{backend}-malformed is malformed: missing" in r["malformed"], backend
        if backend != "torch":
            assert "saved by 3 data-parallel ranks and is malformed: missing zero_rank2.pt" in r["other_world"], backend


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero3_weights_after_training_agree_across_ranks_with_deepspeeds_gather_the_checkpoint_and_one_process(
        world_size_2, single_process):
    _, folder = world_size_2
    _, single = single_process
    rank0, rank1 = (torch.load(folder / f"weights-zero3-rank{r}.pt") for r in (0, 1))
    at_once = torch.load(folder / "gathered-zero3-rank0.pt")
    loaded = [torch.load(folder / f"loaded-zero3-rank{r}.pt") for r in (0, 1)]
    initial = {k: p.detach() for k, p in make_hf_model("llama").named_parameters()}
    assert rank0.keys() == rank1.keys() == single.keys() == initial.keys()
    # Adam moves a weight by up to ~lr per step whatever its gradient's size, so float noise in a tiny
    # gradient shows in the weights more than in the loss: measured max |ZeRO-3 - one process| after
    # 3 steps is 2.7e-6, against moves of up to 3.1e-3; 2e-5 is 7x the one and 1/150 of the other.
    atol = 2e-5
    assert max(float((single[k] - initial[k]).abs().max()) for k in single) > 100 * atol
    for k in rank0:
        assert torch.equal(rank0[k], rank1[k]), k
        assert torch.equal(rank0[k], at_once[k]), k  # layer by layer = DeepSpeed gathering every parameter at once
        assert all(torch.equal(rank0[k], w[k]) for w in loaded), k  # the checkpoint restores the partitions
        torch.testing.assert_close(rank0[k], single[k], atol=atol, rtol=0, msg=k)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero3_is_partitioned_and_weight_sync_materialises_one_decoder_layer_at_a_time(world_size_2):
    z = world_size_2[0]["zero3"]
    assert z["partitioned"] and z["weights_match"]
    assert z["linear_kept"]  # torch.nn.functional.linear is torch's still: other models in the process use it
    hf = dict(make_hf_model("llama").named_parameters())
    # Only tensors under ZeRO-3's persistence threshold (10 x hidden) stay whole on every rank: the norms.
    threshold = 10 * hf_config("llama").hidden_size
    assert z["persistent"] == sorted(n for n, p in hf.items() if p.numel() <= threshold)
    gathered = {layer_key(n) for n in hf if n not in z["persistent"]}
    assert {f"model.layers.{i}" for i in range(3)} <= gathered
    assert [name for name, _, _ in z["trace"]] == list(hf)
    for name, key, live in z["trace"]:  # at each yield after training: which layers are materialised
        assert live == ([key] if key in gathered else []), name


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero3_on_two_ranks_of_a_three_rank_job_trains_and_resumes_exactly_as_on_a_two_rank_job(
        model_dir, world_size_2, tmp_path):
    # A separated placement's actor ranks: ZeRO-3 partitions, reduces, checks its module order and
    # checkpoints on their process group; the third rank joins nothing (a collective over the
    # whole job would end the run with a timeout). Same partitions, same reduction order: bit for bit.
    on_group = run_actor_worker(model_dir, tmp_path, 3, "--backends", "zero3", "--bystanders", "1")["zero3"]
    whole, folder = world_size_2
    assert on_group["losses"] == whole["zero3"]["losses"]
    assert on_group["resumed"] == whole["zero3"]["resumed"] == on_group["losses"][-RESUMED:]
    assert on_group["partitioned"] and on_group["weights_match"] and on_group["trace"] == whole["zero3"]["trace"]
    for r in (0, 1):
        a, b = torch.load(tmp_path / f"weights-zero3-rank{r}.pt"), torch.load(folder / f"weights-zero3-rank{r}.pt")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_megatron_trains_on_every_rank_of_the_job_so_a_separated_run_refuses_it():
    from common.config import load_config
    from launch.run.config import TrainConfig

    separated = ["pipeline.placement=separated", "pipeline.actor_ranks=1", "trainer.train_shares=shard",
                 "rollout.split_groups=false", "actor.device=cuda"]
    with pytest.raises(ValueError, match="capability subgroup that actor.backend=megatron lacks"):
        load_config(TrainConfig, REPO / "configs" / "tiny.yaml", [*separated, "actor.backend=megatron"])
    load_config(TrainConfig, REPO / "configs" / "tiny.yaml", [*separated, "actor.backend=deepspeed"])


def zero_advantage_update(model_dir, batch, skip: bool):
    """One Learner update (2 mini-batches) of `batch` on a fresh actor -> (actor, metrics)."""
    from common.config import load_config
    from launch.run.config import TrainConfig
    from pipeline.algorithms import build_algorithm
    from pipeline.dist import Ranks
    from pipeline.update.learner import Learner, mini_batch_cut

    cfg = load_config(TrainConfig, None, ["model.path=unused", "trainer.mini_batches=2",
                                          f"trainer.skip_zero_advantage={str(skip).lower()}"])
    a = actor(model_dir, lr=1e-4, micro_batch_tokens=20)
    batch.old_logprobs = a.logprobs(batch.input_ids, batch.attention_mask).logprobs * batch.response_mask
    batch.engine_logprobs = batch.old_logprobs.clone()
    learner = Learner(cfg.trainer, build_algorithm(cfg.algorithm, cfg.rollout.max_new_tokens), cfg.actor, Ranks(), a,
                      pad_id=0, engine_old_logprobs=True)
    return a, learner._update(batch, mini_batch_cut(batch.size, None, 2))


def test_rows_of_zero_advantage_left_out_of_the_update_change_no_weight(model_dir):
    batch = make_batch(rows=8, seed=3)
    inert = torch.tensor([0, 3, 4, 7])
    batch.advantages[inert] = 0.0
    (full, m_full), (skipped, m_skip) = (zero_advantage_update(model_dir, batch, skip) for skip in (False, True))
    for (name, p), q in zip(full.model.named_parameters(), skipped.model.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=0, msg=name)
    assert m_skip["train/grad_norm"] == pytest.approx(m_full["train/grad_norm"], rel=1e-5)
    assert m_skip["train/loss"] == pytest.approx(m_full["train/loss"], abs=1e-7)
    share = float(batch.response_mask[inert].sum() / batch.response_mask.sum())
    assert m_skip["train/skipped_token_share"] == pytest.approx(share) and share > 0.2
    assert m_full["train/skipped_token_share"] == 0.0


def test_a_mini_batch_of_only_zero_advantage_rows_still_runs_one_backward_and_moves_no_weight(model_dir):
    batch = make_batch(rows=4, seed=5)
    batch.advantages.zero_()
    before = {n: p.detach().clone() for n, p in actor(model_dir).model.named_parameters()}
    trained_actor, m = zero_advantage_update(model_dir, batch, skip=True)
    for name, p in trained_actor.model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.grad is not None, name  # one row went through forward and backward (its all-reduce on several ranks)
    assert 0.5 < m["train/skipped_token_share"] < 1.0
