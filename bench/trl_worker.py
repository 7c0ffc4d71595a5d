"""`python -m bench.trl_worker JOB.json OUT.json`: TRL's GRPOTrainer on bench.trl's job, timed.

Run by bench.trl with TRL's own interpreter (.venv-trl, `make setup-trl`): trl pins its own
transformers and accelerate, so it lives in an environment of its own. Run it as a module from the
repository root (`-m`), never as a script: a script's folder would put bench/trl.py in the place
of the `trl` package.

JOB (written by bench.trl): the model folder, the steps, the rows of every step in training order
(chat messages, the gold answer, and the prompt's token ids as TailSpec renders it: each is
checked against TRL's own rendering, so both train on the same tokens), math-verify's format
bonus, and the GRPOConfig keywords. The reward is TailSpec's own MathVerifyReward.

OUT: per optimizer step its wall seconds and response tokens, every span TRL's profiling times
(`trl.extras.profiling`: its generate call, `_prepare_inputs`, `_get_per_token_logps_and_entropies`,
`compute_loss`, ...) as (name, start, end) on the same clock, TRL's log history, and versions.
What this module does not do: split the step into phases (bench.trl does, from the spans).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m bench.trl_worker JOB.json OUT.json", file=sys.stderr)
        return 2
    job = json.loads(open(args[0]).read())

    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from pipeline.tasks.rewards import MathVerifyReward

    spans: list[tuple[str, float, float]] = []
    log_metrics = profiling.ProfilingContext._log_metrics

    def record(self, duration: float) -> None:  # TRL's own timer, kept on this process's clock
        end = time.perf_counter()
        spans.append((self.name, end - duration, end))
        log_metrics(self, duration)

    profiling.ProfilingContext._log_metrics = record

    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    for i, row in enumerate(job["rows"]):
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)
        if list(ids["input_ids"]) != row["ids"]:
            raise ValueError(f"row {i}: TRL's rendering of the prompt is not TailSpec's ({len(ids['input_ids'])} against "
                             f"{len(row['ids'])} tokens): the two would not train on the same prompts")

    reward = MathVerifyReward(format_weight=job["format_weight"])
    tokens: list[int] = []  # response tokens of each generation batch (one per optimizer step)

    def correctness_and_format(prompts, completions, completion_ids, answer, **_) -> list[float]:
        tokens.append(sum(len(c) for c in completion_ids))
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [reward(text, gold)[0] for text, gold in zip(texts, answer, strict=True)]

    clock: list[dict[str, float]] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock.append({"start": time.perf_counter()})

        def on_step_end(self, args, state, control, **kw):
            clock[-1]["end"] = time.perf_counter()

    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in job["rows"]]
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(output_dir=out_dir, max_steps=job["steps"], use_cpu=True, use_vllm=False,
                            report_to="none", save_strategy="no", logging_steps=1, shuffle_dataset=False,
                            seed=job["seed"], **job["grpo"])
        t = time.perf_counter()
        trainer = GRPOTrainer(model=job["model"], reward_funcs=[correctness_and_format], args=config,
                              train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
                              callbacks=[StepClock()])
        init_s = time.perf_counter() - t
        trainer.train()
    steps = [{"step_s": c["end"] - c["start"], "start": c["start"], "end": c["end"], "tokens": n}
             for c, n in zip(clock, tokens, strict=True)]
    result = {"steps": steps, "spans": spans, "init_s": init_s, "log_history": trainer.state.log_history,
              "threads": torch.get_num_threads(),
              "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}}
    with open(args[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
