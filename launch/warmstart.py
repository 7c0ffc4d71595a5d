"""`python -m launch.warmstart --config CFG [section.key=value ...] --out DIR [warm-start flags]`: the
drafter warm start (spot.warmstart) on an RL run's own model and training prompts.

The run's config says everything about the data: `model.path` is the target; the prompts are the
run's training problems as launch.run.problems.problems_for makes them (task.file's rows by its field
paths, text or chat messages, task.chat with task.system_prompt and task.instruction, less the
held-out share; or a generated task's problems), encoded as the run encodes them
(pipeline.data.chat.encode_problem), so the drafter learns the target's responses to the prompts
it will draft for. Samples per prompt, max_new_tokens, temperature, top_k and top_p default to the
run's `rollout` section, the drafter kind to the learned part of `engine.spec.drafter` (eagle when
it has none) and the device to `engine.device`; a flag given on the command line wins.
`--max-prompts N` takes the first N training problems. Under `torchrun --nproc-per-node=R -m
launch.warmstart ...` it runs on R ranks as spot.warmstart does.
"""

from __future__ import annotations

import sys

from common.text import load_tokenizer
from common.config import load_config, missing_keys, override_args
from launch.run.problems import problems_for
from launch.run.config import TrainConfig
from pipeline.data.chat import encode_problem
from spot.warmstart.train import WarmstartConfig, build_parser, result_line, warmstart_prompts
from spot.warmstart.data import Prompt
from spot.warmstart.ranks import join, leave

# Warm-start keys that default to the run config's: key -> the dotted config key (run_value reads it)
FROM_RUN = {
    "n": "rollout.n", "max_new_tokens": "rollout.max_new_tokens", "temperature": "rollout.temperature",
    "top_k": "rollout.top_k", "top_p": "rollout.top_p", "device": "engine.device", "kind": "engine.spec.drafter",
}


def run_value(cfg: TrainConfig, key: str):
    if key == "kind":
        return cfg.engine.spec.drafter_spec.learned or "eagle"
    section, name = FROM_RUN[key].split(".")
    return getattr(getattr(cfg, section), name)


def run_prompts(cfg: TrainConfig, tokenizer, max_prompts: int | None) -> tuple[list[Prompt], str]:
    """The run's training problems as token ids, and a line saying where they came from."""
    problems = problems_for(cfg, tokenizer)
    chosen = problems.train[:max_prompts] if max_prompts else problems.train
    where = cfg.task.file or f"the {cfg.task.name} task's generated problems"
    source = f"{len(chosen)} of the {len(problems.train)} training problems of {where}" + (" (chat)" if cfg.task.chat else "")
    return [Prompt(p.id, encode_problem(tokenizer, p, cfg.task.chat)) for p in chosen], source


def main(argv: list[str] | None = None) -> int:
    overrides, rest = override_args(sys.argv[1:] if argv is None else argv)
    parser = build_parser("python -m launch.warmstart", paths=False)
    parser.description = __doc__.splitlines()[0]
    parser.epilog = "Any section.key=value argument overrides the run config."
    parser.add_argument("--config", required=True, help="the RL run's config (configs/*.yaml)")
    parser.add_argument("--max-prompts", type=int, default=None, help="the first N training problems (default: all)")
    parser.set_defaults(**dict.fromkeys(FROM_RUN))  # None: the run config's value
    args = vars(parser.parse_args(rest))
    config, out, max_prompts = args.pop("config"), args.pop("out"), args.pop("max_prompts")
    try:
        if max_prompts is not None and max_prompts < 1:
            raise ValueError(f"--max-prompts must be >= 1, got {max_prompts}")
        # The drafter path is what this writes: a config that leaves it to be set (???) still loads.
        if not any(o.startswith("engine.spec.drafter_path=") for o in overrides):
            overrides.append(f"engine.spec.drafter_path={out}")
        cfg = load_config(TrainConfig, config, overrides)
        needed = [k for k in missing_keys(cfg) if k.startswith(("model.", "task."))]
        if needed:
            raise ValueError(f"{config} leaves {', '.join(needed)} to be set (???): add "
                             f"{' '.join(k + '=...' for k in needed)} to the command line")
        ws = WarmstartConfig(**{k: run_value(cfg, k) if v is None and k in FROM_RUN else v for k, v in args.items()})
        ws.validate()
        r = join(ws.device)
        try:
            prompts, source = run_prompts(cfg, load_tokenizer(cfg.model.path), max_prompts)
            summary = warmstart_prompts(ws, cfg.model.path, prompts, out, r, source=f"{config}: {source}")
        finally:
            leave()
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if r.main:
        print(result_line(out, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
