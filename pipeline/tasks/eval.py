"""Greedy exact-answer accuracy of a model on a list of problems, decoded by the rollout engine.

One decoder for every "held-out accuracy" the project reports (pretraining, the RL loop's eval):
`RolloutEngine` at temperature 0, no speculation, the tokenizer's eos as stop token. Prompts
are encoded as `pipeline.tasks.tokenizer` does ([bos] + chars(prompt)); a response ends at
`<eos>` (not part of the decoded text) or after `max_new_tokens`. The held-out problems are the
task's test split drawn with `EVAL_SEED`, so every caller that asks for n problems scores the
same n.
"""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.engine import RolloutEngine
from engine.model import Transformer
from engine.sampling import SamplingParams
from engine.types import Request
from pipeline.tasks.arith import Problem, reward

EVAL_SEED = 1234  # the held-out problems' seed, for every caller


def greedy_rollouts(engine: RolloutEngine, tokenizer, problems: list[Problem], max_new_tokens: int):
    """Greedy rollouts (a RolloutBatch) through the engine, whatever its weights version."""
    requests = [Request(prompt_id=f"eval-{i}", prompt=tokenizer(p.prompt).input_ids) for i, p in enumerate(problems)]
    stops = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stops)
    return engine.generate(requests, params)


def greedy_responses(engine: RolloutEngine, tokenizer, problems: list[Problem], max_new_tokens: int) -> list[str]:
    """Decoded greedy responses."""
    return [tokenizer.decode(r.tokens, skip_special_tokens=True) for r in greedy_rollouts(engine, tokenizer, problems, max_new_tokens)]


def accuracy(texts: list[str], problems: list[Problem]) -> float:
    return sum(reward(t, p.answer) for t, p in zip(texts, problems)) / len(problems)


@torch.no_grad()
def evaluate(model: Transformer, tokenizer, problems: list[Problem], max_new_tokens: int = 384) -> float:
    """Fraction of problems whose greedy response has exactly the right final answer (the model
    is decoded by an engine of its own; its weights are not modified)."""
    if not problems:
        raise ValueError("evaluate needs at least one problem")
    import copy

    longest = max(len(tokenizer(p.prompt).input_ids) for p in problems)
    cfg = EngineConfig(max_batch=min(len(problems), 256), max_len=longest + max_new_tokens + 1)
    engine = RolloutEngine(copy.deepcopy(model).eval(), cfg)  # a copy: the runtime re-lays out what it packs
    return accuracy(greedy_responses(engine, tokenizer, problems, max_new_tokens), problems)
