"""A run's problem sets: the held-out split by a hash of the id (disjoint, stable, nested, the same
at every world size), held-out files, and the run's errors for rows it cannot use (launch.run.problems.problems_for)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import load_config
from launch.run.problems import problems_for, prompt_loader
from launch.run.config import TrainConfig
from pipeline.data.files import prompt_id
from pipeline.data.sets import file_sets
from pipeline.data.split import first_by_position, hold_out, position
from pipeline.tasks.arith import Problem
from tests.test_data_files import chat_tokenizer, verl_row, write_jsonl, write_parquet


def problems(n: int) -> list[Problem]:
    return [Problem(id=f"p{i}", prompt=f"{i}?", answer="1", response="") for i in range(n)]


def config(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, None, ["model.path=unused", "task.name=math", *overrides])


def math_rows(n: int, start: int = 0) -> list[dict]:
    return [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(start, start + n)]


def test_the_held_out_split_is_disjoint_stable_and_nested():
    ps = problems(2000)
    train, held = hold_out(ps, 0.1)
    assert not {p.id for p in train} & {p.id for p in held} and len(train) + len(held) == 2000
    assert 150 < len(held) < 250  # about the share
    assert hold_out(ps[::-1], 0.1) == (train[::-1], held[::-1])  # by id, not by position in the file
    assert {p.id for p in hold_out(ps, 0.05)[1]} < {p.id for p in held}  # a smaller share holds out a subset
    assert all(0 <= position(p.id) < 0.1 for p in held)
    assert first_by_position(held, 5) == sorted(held, key=lambda p: position(p.id))[:5]


def test_a_file_run_holds_out_a_share_by_default_named_in_the_eval_log(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", math_rows(400))
    cfg = config(f"task.file={path}", "task.prompt_field=question")
    tok = chat_tokenizer()
    run = problems_for(cfg, tok)
    train_ids, held_ids = {p.id for p in run.train}, {p.id for p in run.held_out}
    assert len(train_ids) + len(held_ids) == 400 and not train_ids & held_ids
    assert all(position(i) < 0.05 for i in held_ids) and all(position(i) >= 0.05 for i in train_ids)
    assert run.held_out_source == f"{path}'s held-out share 0.05, {len(held_ids)} of {len(held_ids)} problems"
    assert run.summary == [f"{path}: 400 rows, 0 bad, 0 duplicate prompts",
                           f"{len(train_ids)} training problems; held out: {run.held_out_source}"]
    assert problems_for(cfg, tok) == run  # the same on every call, so on every rank
    capped = problems_for(config(f"task.file={path}", "task.prompt_field=question", "task.eval_problems=3"), tok)
    assert capped.held_out == first_by_position(run.held_out, 3) and "(the task.eval_problems of smallest id hash)" in \
        capped.held_out_source


def test_no_world_size_trains_on_a_held_out_problem(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", math_rows(200))
    cfg = config(f"task.file={path}", "task.prompt_field=question", "task.eval_share=0.2", "trainer.prompts_per_step=8")
    run = problems_for(cfg, chat_tokenizer())
    held = {p.id for p in run.held_out}
    steps = {}
    for world in (1, 2, 4):
        loaders = [prompt_loader(cfg, run.train, world_size=world, rank=r) for r in range(world)]
        steps[world] = [[p.id for loader in loaders for p in loader.next_step()] for _ in range(30)]
        assert not held & {i for step in steps[world] for i in step}
    assert steps[1] == steps[2] == steps[4]


def test_a_held_out_file_is_the_held_out_set_and_overlap_with_training_is_reported(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", math_rows(50))
    test = write_jsonl(tmp_path / "test.jsonl", math_rows(10, start=45))  # 5 of them also train
    run = problems_for(config(f"task.file={train}", f"task.eval_file={test}", "task.prompt_field=question"),
                       chat_tokenizer())
    assert len(run.train) == 50 and {p.prompt for p in run.held_out} == {f"{i}+1=" for i in range(45, 55)}
    assert run.held_out_source == f"{test}, 10 of 10 problems"
    assert run.summary[-1] == f"50 training problems; held out: {test}, 10 of 10 problems; 5 held-out problems are " \
                              "also training problems"
    generated = problems_for(config(f"task.eval_file={test}", "task.prompt_field=question"), chat_tokenizer())
    assert len(generated.train) == 4096 and generated.held_out_source == f"{test}, 10 of 10 problems"


def test_a_generated_task_without_files_evaluates_its_test_problems():
    run = problems_for(config("task.eval_problems=7"), chat_tokenizer())
    assert run.held_out_source == "the math task's generated test problems (7)" and run.summary == []
    assert all(p.id.startswith("math-test-") for p in run.held_out)


@pytest.mark.parametrize("overrides, error", [
    (["task.eval_share=0.1"], "task.eval_share holds out a share of task.file"),
    (["task.file=a.jsonl", "task.eval_file=b.jsonl", "task.eval_share=0.1"], "task.eval_share holds out a share"),
    (["task.file=a.jsonl", "task.eval_share=1.0"], r"task.eval_share must be in \(0, 1\)"),
    (['task.instruction="{prompt}!"'], "shape chat prompts: set task.chat=true"),
    (["task.chat=true", "task.instruction=no placeholder"], r"task.instruction must hold \{prompt\} exactly once"),
    (['task.id_field=""'], "task.id_field is empty"),
])
def test_task_keys_that_do_not_fit_together_are_named(overrides, error):
    with pytest.raises(ValueError, match=error):
        config(*overrides)


def test_a_prompt_longer_than_the_engines_room_is_an_error_naming_the_row(tmp_path):
    rows = math_rows(20) + [{"id": "long-one", "question": "1" * 60 + "+1=", "answer": "2"}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = config(f"task.file={path}", "task.prompt_field=question", "engine.max_len=80", "rollout.max_new_tokens=32",
                 "task.chat=true", 'task.instruction="{prompt}"')
    with pytest.raises(ValueError, match=rf"(?s)1 of 21 rows are malformed.*{path}:21 \(id long-one\): the prompt is 66 "
                                         r"tokens in the chat template, and the engine has room for 48 \(engine.max_len "
                                         r"80 - rollout.max_new_tokens 32\): raise engine.max_len, lower "
                                         r"rollout.max_new_tokens, or drop the row"):
        problems_for(cfg, chat_tokenizer())


def test_an_empty_or_unreadable_answer_is_an_error_naming_the_row(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", math_rows(10) + [{"question": "7+1=", "answer": ""},
                                                                   {"question": "80+1=", "answer": "\\boxed{"}])
    cfg = config(f"task.file={path}", "task.prompt_field=question")
    with pytest.raises(ValueError, match=rf"(?s){path}:11 \(id {prompt_id('7+1=')}\): field 'answer' must be a non-empty "
                                         rf"string, got ''.*{path}:12 \(id {prompt_id('80+1=')}\): math-verify cannot "
                                         "parse the answer"):
        problems_for(cfg, chat_tokenizer())


def test_chat_message_prompts_need_a_chat_run_and_render_as_given_with_the_system_prompt(tmp_path):
    path = write_parquet(tmp_path / "verl.parquet", [verl_row(i) for i in range(40)])
    base = [f"task.file={path}", "task.answer_field=reward_model.ground_truth"]
    with pytest.raises(ValueError, match="the prompt is chat messages, which only a chat run renders: set task.chat=true"):
        problems_for(config(*base), chat_tokenizer())
    run = problems_for(config(*base, "task.chat=true", "task.system_prompt=Be brief."), chat_tokenizer())
    p = run.train[0]
    assert p.messages == (("system", "Be brief."), ("user", p.prompt)) and p.prompt.endswith("step by step.")
    assert p.extra["data_source"] == "gsm8k" and run.held_out and all(q.messages[0][0] == "system" for q in run.held_out)


def test_a_chat_run_gives_text_prompts_the_instruction_and_generated_problems_too(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", math_rows(30))
    run = problems_for(config(f"task.file={path}", "task.prompt_field=question", "task.chat=true"), chat_tokenizer())
    p = run.train[0]
    assert p.messages == (("user", f"{p.prompt}\nPut your final answer within \\boxed{{}}."),)
    generated = problems_for(config("task.chat=true", 'task.instruction="Q: {prompt}"', "task.eval_problems=2"),
                             chat_tokenizer())
    assert generated.held_out[0].messages == (("user", f"Q: {generated.held_out[0].prompt}"),)


def test_file_sets_refuse_a_share_that_leaves_no_problems_on_one_side(tmp_path):
    path = write_jsonl(tmp_path / "two.jsonl", [json.dumps({"prompt": f"{i}", "answer": "1"}) for i in range(2)])
    with pytest.raises(ValueError, match="leaves 0 held out and 2 for training; choose a share"):
        file_sets(path, None, eval_share=0.01, eval_problems=10)


def test_answers_are_checked_by_math_verify_only_where_it_is_the_reward(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", math_rows(20) + [{"question": "code?", "answer": "def f(): pass"}])
    base = [f"task.file={path}", "task.prompt_field=question", "task.max_bad_share=0.1"]
    for reward, kept in ((None, 20), ("math_verify", 20), ("my_rewards:score", 21)):  # a plug-in reads its own answers
        run = problems_for(config(*base, *([f"task.reward={reward}"] if reward else [])), chat_tokenizer())
        assert len(run.train) + len(run.held_out) == kept, reward
