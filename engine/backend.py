"""The rollout backend a training loop talks to, and what it can do.

Two backends implement it: the native engine (engine.engine.RolloutEngine, CPU and GPU) and vLLM
(engine.backends.vllm_engine.VllmEngine, GPU clusters). Nothing asks which one it has: a class
declares what its backends can do (`CAPS`, and `serves` for the drafters), which a run's config is
checked against before any backend is built (launch.run.capabilities); a built backend's `caps` say
what it does with its config. The loop reads `caps` and calls the methods below, whose defaults
do nothing where a backend has nothing to do (a native engine never sleeps).

Vocabulary: the *served* policy is the one whose weights the backend holds (`version`); a
backend's log-probs are *exact* when they equal the served policy's log-probs of the sampled
tokens bit for bit (what PPO's old log-probs need); *same tokens* means the sampling noise is
keyed by (seed, step, prompt, sample, position), so speculation and placement change no token.
This module knows nothing about RL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from engine.features import FeatureSink
from engine.model_config import ModelConfig
from engine.sampling import SamplingParams
from engine.source import RequestSource
from engine.spec.drafter_spec import DrafterSpec
from engine.spec.policy import SpecPolicy
from engine.types import Request, RolloutBatch

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class BackendCapabilities:
    exact_logprobs: bool  # returned log-probs are the served policy's, bit for bit
    returns_features: bool  # a FeatureSink receives the target's features of every committed token
    same_tokens: bool  # noise-indexed sampling: speculation on or off, any rank, the same tokens
    preemptible: bool  # generate(should_stop=...) ends a call early, keeping each row's prefix
    takes_drafts: bool  # Request.drafts (pre-generated responses) serve as drafts
    sleeps: bool  # sleep() frees memory while a colocated actor trains
    pulls_requests: bool = False  # generate(source=...) admits requests from a RequestSource as rows free up
    bf16_kernels: bool = False  # engine.weights=bfloat16 / engine.products=bf16: the CPU kernels' bf16 numerics


class RolloutBackend(Protocol):
    """What a loop needs of a rollout backend. Implementations subclass it explicitly and so
    inherit the no-op defaults of `sleep`, `wake_up` and `close`."""

    CAPS: ClassVar[BackendCapabilities]  # what a backend of the class can do, with a config that asks for it
    caps: BackendCapabilities  # what this one does with its config (e.g. no exact log-probs with bf16 weights)
    policy: SpecPolicy | None  # the native engine's speculation policy; None where the backend schedules itself
    sink: FeatureSink | None  # read only where caps.returns_features

    version: int  # the served policy's version (the RL step whose weights it holds)
    model_config: ModelConfig  # the served model's config (end-of-sequence ids, sizes)

    @classmethod
    def serves(cls, drafter: DrafterSpec) -> bool:
        """Whether a backend of the class serves engine.spec.drafter `drafter`; every one by default."""
        return True

    def generate(self, requests: list[Request], params: SamplingParams, progress: Callable[[int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, source: RequestSource | None = None) -> RolloutBatch: ...

    def load_weights(self, named_tensors: NamedTensors, version: int) -> None: ...

    def load_drafter_weights(self, named_tensors: NamedTensors, version: int) -> None: ...

    def drafter_nets(self) -> list[torch.nn.Module]:
        """The drafter networks held in this process (checkpoints save them); none by default."""
        return []

    def sleep(self) -> None:
        """Frees memory from the rollouts' end to the next weight sync (caps.sleeps)."""

    def wake_up(self) -> None:
        """Back to serving after `sleep`."""

    def close(self) -> None:
        """Releases processes and files the backend started."""
