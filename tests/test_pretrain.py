"""Tiny-model pretraining: the loss falls, the folder is a standard HF folder, greedy eval is greedy."""

from __future__ import annotations

import json

import pytest
import torch

from engine.checkpoint import load_checkpoint
from pipeline.pretrain import PretrainConfig, build_model, collate, encode_example, parse_args, pretrain
from pipeline.tasks import get_task
from pipeline.tasks.arith import make_problems
from pipeline.tasks.eval import EVAL_SEED, evaluate
from pipeline.tasks.tokenizer import build_tokenizer

TINY = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    batch_tokens=1024, pool_size=256, warmup_steps=5, lr=1e-2, threads=1, log_every=10,
)


@pytest.fixture
def one_thread():
    """Two spinning OpenMP threads on a shared 2-core machine can make this test 10x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_a_few_steps_reduce_the_loss_and_the_folder_loads_in_transformers(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "tiny"
    summary = pretrain(PretrainConfig(steps=40, eval_problems=8, **TINY), out)
    assert summary["final_loss"] < summary["initial_loss"] - 0.5
    tok = AutoTokenizer.from_pretrained(out)
    # The summary's accuracy is the one decoder's score of the saved model on the held-out problems.
    assert summary["heldout_accuracy"] == evaluate(load_checkpoint(out), tok, make_problems("test", 8, EVAL_SEED))
    assert json.loads((out / "pretrain_summary.json").read_text())["steps"] == 40
    assert not (tmp_path / "tiny.tmp").exists()

    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = torch.tensor([tok("123+45\n").input_ids])  # [1, T]
    ours = load_checkpoint(out)
    with torch.no_grad():
        expected = ours(ids, torch.arange(ids.shape[1])[None]).logits
        torch.testing.assert_close(hf(ids).logits, expected, atol=1e-4, rtol=1e-4)


def test_eval_decoding_equals_argmax_decoding_without_cache(one_thread):
    from engine.config import EngineConfig
    from engine.engine import RolloutEngine
    from pipeline.tasks.eval import greedy_rollouts

    torch.manual_seed(0)
    tok = build_tokenizer()
    model = build_model(PretrainConfig(init_std=0.5, **TINY), tok).eval()  # large init: varied argmaxes
    problems = make_problems("test", 16, seed=5)
    prompts = [tok(p.prompt).input_ids for p in problems]
    max_new = 30
    import copy

    engine = RolloutEngine(copy.deepcopy(model), EngineConfig(max_batch=16, max_len=64))
    got = [[t for t in r.tokens if t != tok.eos_token_id] for r in greedy_rollouts(engine, tok, problems, max_new)]
    assert 0 < sum(len(out) < max_new for out in got) < len(got)  # rows finish at different steps
    for prompt, out in zip(prompts, got):
        seq = list(prompt)
        with torch.no_grad():
            while len(seq) < len(prompt) + max_new and seq[-1] != tok.eos_token_id:
                logits = model(torch.tensor([seq]), torch.arange(len(seq))[None]).logits  # [1, T, V]
                seq.append(int(logits[0, -1].argmax()))
        assert out == [t for t in seq[len(prompt) :] if t != tok.eos_token_id]


def test_evaluate_counts_exact_final_answers(monkeypatch):
    tok = build_tokenizer()
    problems = make_problems("test", 4, seed=0)
    responses = [p.response for p in problems]
    responses[1] = responses[1].replace(f"#### {problems[1].answer}", "#### 99999999")
    monkeypatch.setattr("pipeline.tasks.eval.greedy_responses", lambda engine, tokenizer, problems, max_new: responses)
    model = build_model(PretrainConfig(**TINY), tok)
    assert evaluate(model, tok, problems) == 0.75


@pytest.mark.parametrize(
    "override, message",
    [
        ({"steps": 0}, "steps must be > 0"),
        ({"lr": 0.0}, "lr must be > 0"),
        ({"task": "nope"}, "unknown task"),
        ({"num_attention_heads": 5}, "multiple of num_attention_heads"),
        ({"batch_tokens": 100}, "batch_tokens"),
    ],
)
def test_bad_config_values_raise_value_error_naming_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        PretrainConfig(**override).validate()


def test_cli_flags_map_onto_the_config(capsys):
    cfg, out = parse_args(["--out", "x", "--steps", "7", "--hidden-size", "96", "--lr", "0.01"])
    assert (cfg.steps, cfg.hidden_size, cfg.lr, str(out)) == (7, 96, 0.01, "x")
    with pytest.raises(SystemExit) as e:
        parse_args(["--out", "x", "--steps", "-1"])
    assert e.value.code == 2 and "steps must be > 0" in capsys.readouterr().err


def test_loss_targets_are_the_response_and_eos_only():
    tok = build_tokenizer()
    p = make_problems("train", 1, seed=0)[0]
    ids, prompt_len = encode_example(tok, p)
    inputs, targets = collate([(ids, prompt_len), (ids[:3], 3)], tok.pad_token_id)  # [2, T-1]
    counted = targets[0][targets[0] != -100].tolist()
    assert tok.decode(counted) == p.response + tok.eos_token
    assert (targets[1] == -100).all()
    assert inputs[0].tolist() == ids[:-1]


def test_the_careless_share_replaces_that_share_of_responses_with_the_careless_teachers():
    import random

    from pipeline.pretrain import demonstrated
    from pipeline.tasks.arith import careless_solution, operands

    careless = get_task("arith").careless
    problems = make_problems("train", 2000, 0)
    assert demonstrated(problems, 0.0, random.Random(0), careless) == problems  # share 0: the data is unchanged
    expected = {p.id: careless_solution(*operands(p.prompt)) for p in problems}
    carrying = [p for p in problems if expected[p.id] != p.response]  # the last column carries
    mixed = demonstrated(problems, 0.6, random.Random(0), careless)
    replaced = [m for p, m in zip(problems, mixed) if m.response != p.response]
    assert all(m.response == expected[m.id] for m in replaced)
    assert [m.answer for m in mixed] == [p.answer for p in problems]  # the reward still checks the true sum
    assert 0.5 < len(replaced) / len(carrying) < 0.7
    with pytest.raises(ValueError, match="task 'math' has no careless teacher"):
        PretrainConfig(task="math", careless_share=0.5).validate()


def test_the_check_share_makes_that_share_of_responses_check_their_answer_and_leaves_the_rest_alone():
    import random

    from pipeline.pretrain import demonstrated
    from pipeline.tasks.mult import make_problems as mult_problems

    task = get_task("mult")
    problems = mult_problems("train", 2000, 0)
    plain = demonstrated(problems, 0.6, random.Random(0), task.careless)
    assert demonstrated(problems, 0.6, random.Random(0), task.careless, 0.0, task.checking) == plain  # share 0: unchanged
    mixed = demonstrated(problems, 0.6, random.Random(0), task.careless, 0.25, task.checking)
    checked = {m.id for p, m in zip(problems, mixed) if len(m.response.splitlines()) == 2 * len(p.response.splitlines())}
    assert 0.2 < len(checked) / len(problems) < 0.3
    for p, m in zip(problems, mixed):
        if m.id in checked:  # a first pass, careless or not, then the careful one
            assert m.response.endswith(p.response) and m.response[: -len(p.response) - 1] in (p.response, task.careless(p))
        else:
            assert m.response in (p.response, task.careless(p))
    slipped_then_checked = [m for p, m in zip(problems, mixed) if m.id in checked and not m.response.startswith(p.response)]
    assert slipped_then_checked and all(task.reward(m.response, m.answer) == 1.0 for m in slipped_then_checked)
    from pipeline.pretrain import train_batches  # the pretraining stream draws its examples the same way

    cfg = PretrainConfig(task="mult", careless_share=0.6, check_share=0.5, max_position_embeddings=2048, **TINY | dict(batch_tokens=2048))
    tok = build_tokenizer()
    answers = [sum(t == tok.convert_tokens_to_ids("#") for t in row.tolist()) // 4
               for _, (_, targets) in zip(range(20), train_batches(cfg, tok)) for row in targets]  # '#### ' lines a row
    assert set(answers) == {1, 2} and 0.3 < answers.count(2) / len(answers) < 0.7
    with pytest.raises(ValueError, match="task 'arith' has no checking teacher"):
        PretrainConfig(task="arith", check_share=0.5).validate()
    with pytest.raises(ValueError, match="check_share must be in"):
        PretrainConfig(task="mult", check_share=1.5).validate()


def test_the_mult_task_pretrains_with_its_careless_teacher_and_a_longer_context(tmp_path, one_thread):
    from pipeline.pretrain import train_batches
    from pipeline.tasks.mult import careless_solution, operands, worked_solution

    cfg = PretrainConfig(task="mult", careless_share=0.5, max_position_embeddings=1024, steps=10, eval_problems=4,
                         eval_max_new_tokens=64, **TINY | dict(batch_tokens=2048))
    tok = build_tokenizer()
    prompts, responses = [], []
    for _, (inputs, targets) in zip(range(10), train_batches(cfg, tok)):  # [B, T] each
        responses += [tok.decode([t for t in row.tolist() if t >= 0], skip_special_tokens=True) for row in targets]
        prompts += [tok.decode(row.tolist(), skip_special_tokens=True).partition("\n")[0] + "\n" for row in inputs]
    careful = [worked_solution(*operands(p)) for p in prompts]
    assert all(r in (careless_solution(p), c) for p, c, r in zip(prompts, careful, responses))
    assert any(r != c for c, r in zip(careful, responses))  # the careless teacher's, where its slip shows
    summary = pretrain(cfg, tmp_path / "mult")
    assert summary["config"]["task"] == "mult" and summary["heldout_problems"] == 4


def test_a_context_too_short_for_the_tasks_examples_is_a_value_error_naming_the_key():
    from pipeline.pretrain import train_batches

    cfg = PretrainConfig(task="mult", max_position_embeddings=512, **TINY)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        next(train_batches(cfg, build_tokenizer()))
