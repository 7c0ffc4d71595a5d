"""The rollout stage of an RL step: problems -> requests -> the engine -> scored rollouts.

A step's requests key the sampling noise by (run seed, RL step, prompt id, sample index), so
the same step of the same run samples the same tokens on any rank, with speculation on or off.
Each rollout is scored once, on its decoded response text, by the run's rewards
(pipeline.tasks.reward_scoring: where they run, what a failed call scores, and a non-finite
score as an error naming the prompt, never silently dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.backend import RolloutBackend
from engine.sampling import SamplingParams
from engine.types import Request, RolloutBatch
from pipeline.config import RolloutSection, TaskSection
from pipeline.data.chat import encode_problem
from pipeline.tasks import Problem
from pipeline.tasks.reward_scoring import RewardRow, Rewards


@dataclass
class ScoredRollouts:
    problems: list[Problem]  # this rank's prompts, in request order
    prompts: list[list[int]]  # their token ids
    batch: RolloutBatch  # n rollouts per prompt, grouped in prompt order
    rewards: torch.Tensor  # [N] float, N = len(problems) * n
    n: int
    fill_metrics: dict[str, float] = field(default_factory=dict)  # dynamic sampling's, when it chose these groups
    # [N] the rank that generated each rollout, where rows came from other ranks (the schedule's
    # exchange, a separated run's shipments); None: all generated here. The simulator's records.
    generated_on: list[int] | None = None
    # Where the schedule dealt a step's rows over the ranks (trainer.train_shares=tokens): the rows
    # (indices into batch) this rank trains, in training order, and how many of them each of its
    # mini-batches takes. The batch holds whole groups, for their advantages; another rank trains
    # the rest of a group. None: every row, cut into even mini-batches.
    train_rows: list[int] | None = None
    mini_batch_rows: list[int] | None = None

    @property
    def lengths(self) -> torch.Tensor:  # [N]
        return torch.tensor([len(r.tokens) for r in self.batch], dtype=torch.long)

    @property
    def trained(self) -> list[int]:
        """The rows this rank trains, in training order (each row of the step on exactly one rank)."""
        return self.train_rows if self.train_rows is not None else list(range(len(self.batch)))


@dataclass(frozen=True)
class StepSampling:
    """The sampling params of each RL step's rollouts: the rollout section's settings, with the
    noise keyed by the run's seed and the step."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, rollout_cfg: RolloutSection, seed: int, stop_token_ids: tuple[int, ...]) -> StepSampling:
        r = rollout_cfg
        return cls(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=seed,
                   stop_token_ids=tuple(stop_token_ids))

    @property
    def is_policy(self) -> bool:
        """Samples from the policy itself (SamplingParams.samples_policy, the same on every step)."""
        return self(0).samples_policy

    def __call__(self, step: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, step=step, stop_token_ids=self.stop_token_ids)


def requests_for(tokenizer, problems: list[Problem], n: int, chat: bool,
                 drafts: dict[str, dict[int, list[int]]] | None = None,
                 predicted: dict[str, int] | None = None, first_sample: int = 0) -> list[Request]:
    """One request of samples first_sample .. first_sample + n - 1 per problem (a whole group by
    default), with its bubble drafts and predicted response length if any (neither changes a token)."""
    return [Request(prompt_id=p.id, prompt=encode_problem(tokenizer, p, chat), n=n, drafts=(drafts or {}).get(p.id),
                    predicted_len=(predicted or {}).get(p.id), first_sample=first_sample)
            for p in problems]


def roll_out(engine: RolloutBackend, tokenizer, problems: list[Problem], params: SamplingParams, n: int, chat: bool,
             rewards: Rewards, first_sample: int = 0,
             prepare: Callable[[list[Request]], list[Request]] = list) -> ScoredRollouts:
    """Samples first_sample .. first_sample + n - 1 of each problem (a part of each group when a
    group is split over ranks), scored with the run's training reward. `prepare`: the requests ->
    the requests the engine takes (the step hooks attach drafts and predicted lengths, which change
    no token: pipeline.hooks)."""
    requests = prepare(requests_for(tokenizer, problems, n, chat, first_sample=first_sample))
    return score(tokenizer, problems, [r.prompt for r in requests], engine.generate(requests, params), n, rewards,
                 params.step)


def score(tokenizer, problems: list[Problem], prompts: list[list[int]], batch: RolloutBatch, n: int, rewards: Rewards,
          step: int) -> ScoredRollouts:
    """The rollouts of `problems` (n each, in order) of RL step `step`, with their training rewards."""
    scores = rewards.score(reward_rows(tokenizer, problems, batch, n), step)
    return ScoredRollouts(problems=problems, prompts=prompts, batch=batch, rewards=torch.tensor(scores), n=n)


def reward_rows(tokenizer, problems: list[Problem], batch: RolloutBatch, n: int) -> list[RewardRow]:
    """What the reward sees of each rollout of `problems` (n each, in order)."""
    rows = []
    for i, ro in enumerate(batch):
        p = problems[i // n]
        rows.append(RewardRow(prompt_id=p.id, sample=ro.sample, prompt=p.prompt, answer=p.answer, extra=p.extra,
                              response=tokenizer.decode(ro.tokens, skip_special_tokens=True)))
    return rows


def held_out_accuracy(engine: RolloutBackend, tokenizer, problems: list[Problem], task_cfg: TaskSection,
                      sampling: StepSampling, rewards: Rewards) -> float:
    """Greedy accuracy on the held-out problems with the served policy: the mean held-out reward
    (correctness, without a format bonus; a plug-in's score), with the rollouts' stop tokens and
    task.eval_max_new_tokens (else the rollouts' limit). Held-out rollouts are not training data
    for anyone: the engine's feature sink is off while they run."""
    params = SamplingParams(max_new_tokens=task_cfg.eval_max_new_tokens or sampling.max_new_tokens, temperature=0.0,
                            stop_token_ids=sampling.stop_token_ids)
    sink, engine.sink = engine.sink, None
    try:
        batch = engine.generate(requests_for(tokenizer, problems, 1, task_cfg.chat), params)
    finally:
        engine.sink = sink
    scores = rewards.score_held_out(reward_rows(tokenizer, problems, batch, 1))
    return sum(scores) / len(scores)
