"""The rollout stage of an RL step: problems -> requests -> the engine -> scored rollouts.

A step's requests key the sampling noise by (run seed, RL step, prompt id, sample index), so
the same step of the same run samples the same tokens on any rank, with speculation on or off.
Rewards are the task's, computed on the decoded response text; a reward outside [0, inf) or not
finite is an error naming the prompt (never silently dropped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.engine import RolloutEngine
from engine.sampling import SamplingParams
from engine.types import Request, RolloutBatch
from pipeline.tasks import Problem, Task


@dataclass
class ScoredRollouts:
    problems: list[Problem]  # this rank's prompts, in request order
    prompts: list[list[int]]  # their token ids
    batch: RolloutBatch  # n rollouts per prompt, grouped in prompt order
    rewards: torch.Tensor  # [N] float, N = len(problems) * n
    n: int

    @property
    def lengths(self) -> torch.Tensor:  # [N]
        return torch.tensor([len(r.tokens) for r in self.batch], dtype=torch.long)


def encode_problem(tokenizer, problem: Problem, chat: bool) -> list[int]:
    if chat:
        from pipeline.tasks.math import chat_prompt

        return list(tokenizer(chat_prompt(tokenizer, problem.prompt), add_special_tokens=False)["input_ids"])
    return list(tokenizer(problem.prompt)["input_ids"])


def roll_out(engine: RolloutEngine, tokenizer, task: Task, problems: list[Problem], params: SamplingParams, n: int,
             chat: bool, reward=None, drafts: dict[str, dict[int, list[int]]] | None = None) -> ScoredRollouts:
    """`reward(text, answer) -> float`: the training reward (default: the task's own, correctness).
    `drafts`: pre-generated responses by prompt id and sample (bubble drafts), for the engine's
    `pregenerated` drafter; they change no token."""
    reward = reward or task.reward
    prompts = [encode_problem(tokenizer, p, chat) for p in problems]
    requests = [Request(prompt_id=p.id, prompt=ids, n=n, drafts=(drafts or {}).get(p.id))
                for p, ids in zip(problems, prompts)]
    batch = engine.generate(requests, params)
    rewards = []
    for i, ro in enumerate(batch):
        p = problems[i // n]
        value = reward(tokenizer.decode(ro.tokens, skip_special_tokens=True), p.answer)
        if not (isinstance(value, (int, float)) and math.isfinite(value)):
            raise ValueError(f"task {task.name!r}: reward {value!r} of prompt {p.id!r} sample {ro.sample} is not a finite number")
        rewards.append(float(value))
    return ScoredRollouts(problems=problems, prompts=prompts, batch=batch, rewards=torch.tensor(rewards), n=n)
