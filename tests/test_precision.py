"""actor.precision: bf16-mixed tracks float32 closely, keeps what must stay float32 in float32, and
`auto` chooses it only where the CPU multiplies bfloat16 (pipeline/actors/precision.py)."""

from __future__ import annotations

import pytest
import torch

from pipeline.actors import precision
from pipeline.actors.base import ActorConfig
from pipeline.actors.forward import forward_in, load_policy
from pipeline.actors.head import LogprobHead
from tests.conftest import REPO


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small Llama with tied embeddings whose next-token distributions are peaked, as a trained
    policy's are (scaled-up embeddings), so log-probs of its likely tokens are near 0 as in RL."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(40.0)
    path = tmp_path_factory.mktemp("precision-model")
    model.save_pretrained(path)
    return path


def _rows(vocab: int = 32):
    ids = torch.randint(0, vocab, (3, 120), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 120, dtype=torch.long)
    mask[1, 90:] = 0
    mask[2, 31:] = 0
    return ids, mask


def _logprobs_and_grads(model_dir, prec: str, attention: str = "tailspec"):
    cfg = ActorConfig(precision=prec, attention=attention)
    model = load_policy(model_dir, cfg)
    ids, mask = _rows()
    lp = forward_in(model, cfg)(ids, mask).logprobs
    lp.sum().backward()
    return lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]), model


@pytest.mark.parametrize("attention", ["tailspec", "sdpa"])
def test_bf16_mixed_log_probs_and_gradients_track_float32(model_dir, attention):
    lp32, g32, _ = _logprobs_and_grads(model_dir, "float32", attention)
    lp16, g16, model = _logprobs_and_grads(model_dir, "bf16-mixed", attention)
    assert lp16.dtype == torch.float32
    diff = (lp32 - lp16).abs()
    assert diff.max() > 0  # the products did run in bf16
    assert diff.mean() < 2e-3 and diff.max() < 2e-2, (diff.mean(), diff.max())
    assert (g32 - g16).norm() < 5e-3 * g32.norm()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


def test_the_lm_head_computes_in_float32_and_keeps_its_weights(model_dir, tmp_path):
    model = load_policy(model_dir, ActorConfig(precision="bf16-mixed"))
    head = model.get_output_embeddings()
    assert isinstance(head, LogprobHead) and head.float32
    assert not load_policy(model_dir, ActorConfig(precision="float32")).get_output_embeddings().float32
    assert head.weight is model.get_input_embeddings().weight  # still tied
    hidden = torch.randn(2, 5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(hidden)
        plain = torch.nn.functional.linear(hidden, head.weight)
    assert logits.dtype == torch.float32 and plain.dtype == torch.bfloat16
    assert torch.equal(logits, torch.nn.functional.linear(hidden, head.weight))
    # Checkpoints are unchanged: the same keys, and a float32 model loads them.
    reference = load_policy(model_dir, ActorConfig(precision="float32"))
    assert model.state_dict().keys() == reference.state_dict().keys()
    model.save_pretrained(tmp_path)
    again = load_policy(tmp_path, ActorConfig(precision="float32"))
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), reference.state_dict().values()))


def test_auto_picks_bf16_mixed_only_where_the_cpu_multiplies_bf16(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    assert precision.resolve(ActorConfig(precision="auto")) == "bf16-mixed"
    assert precision.resolve(ActorConfig(precision="auto", backend="deepspeed")) == "float32"
    assert precision.resolve(ActorConfig(precision="auto", dtype="bfloat16")) == "float32"
    assert precision.resolve(ActorConfig(precision="auto", device="cuda")) == "float32"
    assert precision.resolve(ActorConfig(precision="float32")) == "float32"
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    assert precision.resolve(ActorConfig(precision="auto")) == "float32"
    assert precision.resolve(ActorConfig(precision="bf16-mixed")) == "bf16-mixed"


def test_bf16_mixed_off_the_torch_backends_float32_weights_is_refused_with_the_fix():
    from common.config import load_config
    from launch.run.config import TrainConfig

    with pytest.raises(ValueError, match="set actor.precision=float32"):
        ActorConfig(precision="bf16-mixed", dtype="bfloat16", attention="sdpa").validate()
    with pytest.raises(ValueError, match="capability autocast that actor.backend=deepspeed lacks: set actor.precision=float32"):
        load_config(TrainConfig, REPO / "configs" / "tiny.yaml", ["actor.backend=deepspeed", "actor.precision=bf16-mixed"])


def test_the_torch_actor_updates_in_bf16_mixed(model_dir):
    """One update step: finite gradient norm, float32 weights that moved, and the actor's no-grad
    log-probs are the update forward's (the same precision on both paths)."""
    from pipeline.actors.torch_actor import TorchActor
    from pipeline.records import TrainBatch

    actor = TorchActor(ActorConfig(precision="bf16-mixed", lr=1e-3, micro_batch_tokens=256), model_dir)
    ids, mask = _rows()
    before = actor.logprobs(ids, mask).logprobs
    with torch.no_grad():
        again = forward_in(actor.model, actor.cfg)(ids, mask).logprobs
    assert torch.equal(before, again)
    resp = mask.clone()
    resp[:, :4] = 0
    batch = TrainBatch(input_ids=ids, attention_mask=mask, response_mask=resp, old_logprobs=before,
                       advantages=torch.ones(3, 120), loss_weights=resp.float() / resp.sum())
    weights = [p.detach().clone() for p in actor.params]

    def loss_fn(lp, entropy, micro):
        loss = -(lp * micro.loss_weights).sum()
        return loss, {"train/loss": float(loss.detach())}

    metrics = actor.update(batch, loss_fn)
    assert torch.isfinite(torch.tensor(metrics["train/grad_norm"])) and metrics["train/grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in actor.params)
    assert any(not torch.equal(w, p) for w, p in zip(weights, actor.params))


def test_bench_precision_reports_both_ways_and_their_agreement(char_model_dir, capsys):
    import json

    from bench import precision as bench

    assert bench.main(["--model", str(char_model_dir), "--repeat", "1", "--problems", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["ratio"]) == {f"model {r}x{t}" for r, t in bench.SHAPES}
    assert all(v > 0 for v in out["ratio"].values())
    diff = out["logprob_diff"]
    assert diff["tokens"] > 3 and 0 < diff["mean"] <= diff["p99"] <= diff["max"]
    assert 0 <= diff["outside_clip"] <= 1 and isinstance(out["bf16_native"], bool)
