"""A run on a user's file: it trains on the file's rows and evaluates its held-out share, named in the log."""

from __future__ import annotations

from launch.run.build import build_run
from pipeline.data.files import prompt_id
from pipeline.data.split import is_held_out
from pipeline.dist import Ranks
from tests.test_data_files import write_jsonl
from tests.test_trainer import config


class Recorder:
    """Wraps an engine's generate to record the prompt ids of greedy (held-out) and sampled (training) requests."""

    def __init__(self, engine) -> None:
        self.generate, self.greedy, self.sampled = engine.generate, [], []

    def __call__(self, requests, params, *args, **kwargs):
        (self.greedy if params.temperature == 0 else self.sampled).extend(r.prompt_id for r in requests)
        return self.generate(requests, params, *args, **kwargs)


def test_a_file_run_trains_on_its_rows_and_evaluates_its_held_out_share(char_model_dir, tmp_path):
    rows = [{"prompt": f"{i}+{2 * i + 7}\n", "answer": str(3 * i + 7), "solution": "#### " * (i % 5 + 1)}
            for i in range(60)]  # no ids; tiny.yaml's stratified order sizes problems by their solutions
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = config(char_model_dir, tmp_path / "runs", "task.name=arith", f"task.file={path}", "task.eval_share=0.25",
                 "task.response_field=solution", "task.eval_problems=5", "engine.spec.enabled=false", "trainer.steps=1")
    built = build_run(cfg, Ranks())
    try:
        recorder = Recorder(built.engine)
        built.engine.generate = recorder
        built.train()
    finally:
        built.close()
    ids = {prompt_id(r["prompt"]) for r in rows}
    held = {i for i in ids if is_held_out(i, 0.25)}
    assert len(recorder.greedy) == 2 * 5 and set(recorder.greedy) <= held  # before the first step and after the last
    assert recorder.sampled and set(recorder.sampled) <= ids - held
    log = (built.run_dir / "rank0.log").read_text()
    assert f"data: {path}: 60 rows, 0 bad, 0 duplicate prompts" in log
    assert f"on {path}'s held-out share 0.25, 5 of {len(held)} problems (the task.eval_problems of smallest id hash)" in log
