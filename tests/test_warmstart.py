"""Offline drafter warm-start: pair alignment, packing, draft vocabulary, loss, and the CLI end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.spec.eagle import EagleConfig, EagleModel
from spot.warmstart.draft_vocab import most_frequent
from spot.training.features import TokenSequence, capture_features
from spot.training.loss import acceptance_metrics, eagle_loss
from spot.training.pairs import PackedPairs
from pipeline.tasks.prompts import make_prompts
from spot.training.records import HiddenStateRows, RowStore
from spot.training.step import batch_loss, train
from spot.warmstart.train import WarmstartConfig, warmstart
from common.text import load_tokenizer
from tests.conftest import REPO, make_hf_model


def coded_rows(lengths: list[int], prompt_lens: list[int]) -> list[HiddenStateRows]:
    """Rows whose feature at position t of row r is (r, t, 1000 r + t): alignment is readable."""
    rows = []
    for r, (T, P) in enumerate(zip(lengths, prompt_lens)):
        t = torch.arange(T, dtype=torch.float32)
        feats = torch.stack([torch.full((T,), float(r)), t, 1000 * r + t], -1)  # [T, 3]
        rows.append(HiddenStateRows(prompt_id=f"p{r}", tokens=1000 * r + torch.arange(T), features=feats, prompt_len=P))
    return rows


def test_pairs_feed_the_feature_at_t_with_the_token_and_target_at_t_plus_1():
    rows = coded_rows([7, 12, 3, 20], [3, 5, 1, 4])
    packed = PackedPairs(rows, window=8)  # row 3 (19 pairs) is cut into segments
    b = packed.batch(torch.arange(len(packed)))
    seen = set()
    for w in range(len(packed)):
        for i in range(packed.window):
            if packed.seg[w, i] < 0:
                assert not b.loss_mask[w, i]
                continue
            r, t = int(b.features[w, i, 0]), int(b.features[w, i, 1])
            assert int(b.tokens[w, i]) == 1000 * r + t + 1  # x_{t+1}
            assert int(b.positions[w, i]) == t + 1
            assert b.targets[w, i].tolist() == [r, t + 1, 1000 * r + t + 1]  # f_{t+1}
            assert bool(b.loss_mask[w, i]) == (t + 1 >= rows[r].prompt_len)
            assert (r, t) not in seen
            seen.add((r, t))
    # Every response pair is trained on exactly once.
    assert packed.num_pairs == sum(r.response_len for r in rows)
    assert {(r, t) for r, row in enumerate(rows) for t in range(row.prompt_len - 1, row.length - 1)} <= seen


def test_packed_windows_attend_causally_within_a_row_only():
    rows = coded_rows([5, 4, 6], [2, 2, 2])
    packed = PackedPairs(rows, window=16)
    assert len(packed) == 1  # 4 + 3 + 5 pairs share one window
    b = packed.batch(torch.tensor([0]))
    row_of, t_of = b.features[0, :, 0], b.features[0, :, 1]
    valid = packed.seg[0] >= 0
    for i in range(16):
        for j in range(16):
            if valid[i] and valid[j]:
                expect = bool(row_of[i] == row_of[j] and t_of[j] <= t_of[i])
                assert bool(b.attn_mask[0, i, j]) == expect, (i, j)
        assert b.attn_mask[0, i].any()  # padding attends to itself: no fully masked query


def test_segments_without_response_pairs_are_dropped():
    rows = coded_rows([30], [25])  # window 8: pairs 0..23 are prompt-only for the first segments
    packed = PackedPairs(rows, window=8)
    assert packed.num_pairs == 5
    assert len(packed) == 1  # segments [0, 8), [8, 16), [16, 24) hold no response pair; only [24, 29) is kept


def test_draft_vocab_holds_the_most_frequent_ids_sorted():
    seqs = [torch.tensor([5, 5, 5, 9, 9, 1, 7]), torch.tensor([9, 9, 3, 3, 3, 3])]
    # counts: 3 -> 4, 9 -> 4, 5 -> 3, 1 -> 1, 7 -> 1; ties go to the lower id
    assert most_frequent(seqs, 12, 3).tolist() == [3, 5, 9]
    assert most_frequent(seqs, 12, 4).tolist() == [1, 3, 5, 9]
    assert most_frequent(seqs, 12, 7).tolist() == [0, 1, 2, 3, 5, 7, 9]  # unseen ids fill in, lowest first
    assert most_frequent(seqs, 12, 0) is None and most_frequent(seqs, 12, 12) is None


def test_acceptance_metrics_on_a_hand_built_distribution():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    vocab = torch.tensor([0, 1])
    q = torch.tensor([[0.6, 0.4]])
    accept, m = acceptance_metrics(q.log(), p.log(), vocab)
    assert accept.item() == pytest.approx(0.8)  # min(.5,.6) + min(.3,.4); q is 0 on id 2
    assert m["spot/top1_agreement"] == 1.0
    accept, m = acceptance_metrics(torch.tensor([[0.1, 0.9]]).log(), p.log(), vocab)
    assert accept.item() == pytest.approx(0.4) and m["spot/top1_agreement"] == 0.0
    same, m = acceptance_metrics(p.log(), p.log(), None)
    assert same.item() == pytest.approx(1.0)


def test_eagle_loss_of_a_perfect_prediction_is_the_target_entropy_times_the_ce_weight():
    g = torch.Generator().manual_seed(0)
    feats, logits = torch.randn(6, 8, generator=g), torch.randn(6, 5, generator=g)
    loss, m = eagle_loss(feats, feats.clone(), logits, logits.clone(), ce_weight=0.1)
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
    assert m["spot/feature_loss"] == 0.0 and m["spot/top1_draft_vocab"] == 1.0
    assert loss.item() == pytest.approx(0.1 * entropy.item(), rel=1e-5)


def test_split_by_prompt_keeps_a_prompts_samples_together():
    rows = [HiddenStateRows(prompt_id=f"p{i // 3}", sample=i % 3, tokens=torch.arange(4), features=torch.zeros(4, 2),
                            prompt_len=2) for i in range(60)]
    train_rows, held = RowStore(rows).split_by_prompt(0.1, torch.Generator().manual_seed(0))
    assert len(held) == 6 and len(train_rows) == 54
    assert not {r.prompt_id for r in held} & {r.prompt_id for r in train_rows}


def test_captured_features_are_aux_outputs_then_final_hidden_and_padding_does_not_leak(char_model_dir):
    target = load_checkpoint(char_model_dir)
    aux = EagleConfig.for_target(target.config, "eagle3").aux_layers
    assert aux  # eagle3 reads auxiliary layers
    seqs = [TokenSequence("a", 0, [1, 5, 6, 7, 8, 9, 10], 3), TokenSequence("b", 0, [1, 11, 12], 2)]
    rows = capture_features(target, seqs, aux, batch_tokens=1000)  # both in one padded batch
    H = target.config.hidden_size
    for s, row in zip(seqs, rows):
        ids = torch.tensor([s.tokens])
        with torch.no_grad():
            out = target(ids, torch.arange(len(s.tokens)).unsqueeze(0), logits=False, hidden_layers=tuple(aux))
        expect = torch.cat([out.layer_hidden[i][0] for i in aux] + [out.hidden[0]], -1)
        assert row.features.shape == (len(s.tokens), H * (len(aux) + 1))
        torch.testing.assert_close(row.features, expect, rtol=1e-4, atol=1e-5)
        assert row.tokens.tolist() == s.tokens and row.prompt_len == s.prompt_len


def test_no_gradient_reaches_the_target(char_model_dir):
    target = load_checkpoint(char_model_dir)  # parameters still require grad here
    rows = capture_features(target, [TokenSequence("a", 0, [1, 5, 6, 7, 8, 2], 2)])
    model = EagleModel(EagleConfig.for_target(target.config), target)
    loss, *_ = batch_loss(model, PackedPairs(rows, 8), torch.tensor([0]), 0.1)
    loss.backward()
    assert all(p.grad is None for p in target.parameters())
    assert all(p.grad is not None for p in model.parameters())


def test_training_stops_at_the_time_budget(char_model_dir):
    target = load_checkpoint(char_model_dir)
    rows = capture_features(target, [TokenSequence("a", 0, [1, 5, 6, 7, 8, 2], 2)])
    model = EagleModel(EagleConfig.for_target(target.config), target)
    cfg = WarmstartConfig(steps=50, window=8)
    stats = train(model, PackedPairs(rows, 8), cfg.optim(), steps=cfg.steps, batch_windows=cfg.batch_windows, seed=0,
                  seconds=1e-9, log_every=cfg.log_every)
    assert stats["steps"] == 1 and stats["stopped_early"]


def write_prompts(path, n: int) -> str:
    path.write_text("".join(json.dumps({"id": i, "prompt": f"{i * 37 % 900}+{i * 53 % 97}\n"}) + "\n" for i in range(n)))
    return str(path)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3_vllm", "mtp"])
def test_warmstart_writes_a_drafter_that_loads_and_whose_loss_went_down(char_model_dir, tmp_path, kind):
    cfg = WarmstartConfig(kind=kind, n=2, max_new_tokens=24, steps=40, batch_windows=2, window=64, lr=3e-3,
                          warmup_steps=5, threads=1, log_every=20, holdout=0.2)
    out = tmp_path / "drafter"
    summary = warmstart(cfg, char_model_dir, write_prompts(tmp_path / "p.jsonl", 10), out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "warmstart_summary.json"]
    assert not (tmp_path / "drafter.tmp").exists()
    assert summary["train_loss_end"] < summary["train_loss_start"]
    assert summary["steps"] == 40 and summary["sequences"] == 20 and summary["heldout_sequences"] == 4
    # Held-out prompts (never trained on) are predicted better after training than before.
    assert summary["heldout"]["loss"] < summary["heldout_before"]["loss"]
    assert json.loads((out / "warmstart_summary.json").read_text())["steps"] == 40
    target = load_checkpoint(char_model_dir)
    drafter = EagleModel.load(out, target)
    assert drafter.config.kind == kind
    assert drafter.config.aux_layers == EagleConfig.for_target(target.config, kind).aux_layers
    assert (drafter.fc_out is not None) == (kind == "eagle3")
    assert drafter.vocab_ids is None  # vocabulary 23 <= 4096: the full one


def test_warmstart_with_a_draft_vocabulary_saves_it(char_model_dir, tmp_path):
    cfg = WarmstartConfig(n=1, max_new_tokens=16, steps=3, window=64, draft_vocab=8, threads=1, holdout=0.0)
    warmstart(cfg, char_model_dir, write_prompts(tmp_path / "p.jsonl", 6), tmp_path / "d")
    drafter = EagleModel.load(tmp_path / "d", load_checkpoint(char_model_dir))
    assert drafter.vocab_ids.tolist() == sorted(drafter.vocab_ids.tolist()) and len(drafter.vocab_ids) == 8
    assert drafter.logits(torch.zeros(2, drafter.config.feature_size)).shape == (2, 8)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spot.warmstart", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("which", ["target", "prompts"])
def test_cli_missing_paths_exit_1_with_a_message_and_no_traceback(char_model_dir, tmp_path, which):
    paths = {"target": str(char_model_dir), "prompts": write_prompts(tmp_path / "p.jsonl", 2)}
    paths[which] = str(tmp_path / "missing")
    res = run_cli("--target", paths["target"], "--prompts", paths["prompts"], "--out", str(tmp_path / "d"))
    assert res.returncode == 1
    assert "error:" in res.stderr and str(tmp_path / "missing") in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "d").exists()


def test_template_prompts_are_distinct_and_deterministic():
    a = make_prompts(200, seed=1)
    assert a == make_prompts(200, seed=1) and a != make_prompts(200, seed=2)
    assert len({r["prompt"] for r in a}) == 200 and len({r["id"] for r in a}) == 200


def test_test_split_prompts_never_occur_in_a_train_split_whatever_the_seeds():
    train = {r["prompt"] for seed in range(3) for r in make_prompts(2000, seed=seed, split="train")}
    test = [r["prompt"] for seed in range(3) for r in make_prompts(400, seed=seed, split="test")]
    assert len(set(test)) > 300 and not train.intersection(test)
    assert all(r["id"].startswith("test-") for r in make_prompts(5, split="test"))
    with pytest.raises(ValueError, match="split must be one of"):
        make_prompts(5, split="dev")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has no GPU")
def test_a_warmstart_on_cuda_writes_a_drafter_that_loads_on_cpu(char_model_dir, tmp_path):
    cfg = WarmstartConfig(n=2, max_new_tokens=24, steps=40, batch_windows=2, window=64, lr=3e-3, warmup_steps=5,
                          log_every=20, holdout=0.2, device="cuda")
    summary = warmstart(cfg, char_model_dir, write_prompts(tmp_path / "p.jsonl", 10), tmp_path / "drafter")
    assert summary["train_loss_end"] < summary["train_loss_start"]
    EagleModel.load(tmp_path / "drafter", load_checkpoint(char_model_dir))  # saved from the GPU, read on the CPU


def test_a_warmstart_device_that_does_not_exist_is_refused_by_name():
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        WarmstartConfig(device="tpu").validate()


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """A random Llama over the character tokenizer with a chat template (a chat run's model)."""
    from tests.test_data_files import chat_tokenizer

    tok = chat_tokenizer()
    path = tmp_path_factory.mktemp("chat-model")
    make_hf_model("llama", vocab=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def verl_run(chat_model_dir, tmp_path) -> list[str]:
    """Overrides of configs/tiny.yaml for a chat run on a verl-layout parquet file without ids."""
    from tests.test_data_files import verl_row, write_parquet

    data = write_parquet(tmp_path / "verl.parquet", [verl_row(i) for i in range(60)])
    return [f"model.path={chat_model_dir}", "task.name=math", f"task.file={data}",
            "task.answer_field=reward_model.ground_truth", "task.chat=true", "task.system_prompt=Be brief.",
            "rollout.n=3", "rollout.max_new_tokens=12", "engine.spec.drafter=ngram+eagle3"]


def test_the_warm_start_of_a_run_config_reads_the_runs_training_prompts_as_the_run_renders_them(chat_model_dir, tmp_path):
    from common.config import load_config
    from launch.run.problems import problems_for
    from launch.run.config import TrainConfig
    from launch.warmstart import run_prompts

    cfg = load_config(TrainConfig, REPO / "configs" / "tiny.yaml", verl_run(chat_model_dir, tmp_path))
    tok = load_tokenizer(chat_model_dir)
    prompts, source = run_prompts(cfg, tok, 10)
    train = problems_for(cfg, tok).train
    assert [p.id for p in prompts] == [p.id for p in train[:10]]  # the training share: held-out ids never appear
    assert len(train) < 60 and "10 of the" in source and "verl.parquet (chat)" in source
    # The conversation a chat run renders: the system prompt's turn ('#' in this template), then the
    # file's user message as it is ('*'), then the assistant's opening ('=').
    expect = tok("#Be brief.\n*" + train[0].prompt + "\n=", add_special_tokens=False)["input_ids"]
    assert prompts[0].tokens == expect and train[0].prompt.startswith("What is")


@pytest.mark.slow
def test_the_warm_start_cli_takes_the_runs_model_sampling_and_drafter_kind_unless_a_flag_says_otherwise(chat_model_dir,
                                                                                                      tmp_path):
    base = [sys.executable, "-m", "launch.warmstart", "--config", str(REPO / "configs" / "tiny.yaml"),
            *verl_run(chat_model_dir, tmp_path), "--steps", "4", "--window", "64", "--threads", "1", "--holdout", "0.3"]
    res = subprocess.run([*base, "--max-prompts", "6", "--out", str(tmp_path / "d")], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((tmp_path / "d" / "warmstart_summary.json").read_text())
    assert s["kind"] == "eagle3" and s["prompts"] == 6 and s["sequences"] == 18  # rollout.n = 3
    assert s["config"]["max_new_tokens"] == 12 and "verl.parquet" in s["prompt_source"]
    assert "expected accept length" in res.stdout.splitlines()[-1]
    res = subprocess.run([*base, "--max-prompts", "4", "--samples", "1", "--kind", "eagle", "--out", str(tmp_path / "e")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((tmp_path / "e" / "warmstart_summary.json").read_text())
    assert s["kind"] == "eagle" and s["sequences"] == 4


@pytest.mark.slow
def test_the_warm_start_of_a_config_names_the_keys_it_still_needs():
    res = subprocess.run([sys.executable, "-m", "launch.warmstart", "--config", str(REPO / "configs" / "7b.yaml"),
                          "--out", "/nonexistent/d"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "leaves model.path, task.file to be set" in res.stderr
    assert "Traceback" not in res.stderr
