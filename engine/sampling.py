"""Noise-indexed sampling: every token is `argmax(mask(logits / T) + g)`.

`g` is Gumbel noise from a counter-based hash keyed by (seed, RL step, prompt, sample index,
response position, token id): no generator state, no global RNG, so any process that knows the
key computes the same noise. Hence the autoregressive sampler, the speculative verifier and the
drafters all agree on which token "the target samples" at a position, and a rollout does not
depend on which other rows share its batch. Masking (top-k, then top-p on the temperature-scaled
distribution) happens before the noise; `T = 0` is greedy argmax.

The log-probability returned with each token is that of the sampling distribution
(`log_softmax(mask(logits / T))`); for greedy decoding, where that distribution is a point mass,
it is the log-probability under the unscaled softmax, which is what RL losses want.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from engine.kernels.library import available
from engine.kernels.noise import uniform_rows

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64 constants as signed int64
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_VOCAB_MUL = 0xD6E8FEB86659FD93 - (1 << 64)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    step: int = 0  # RL step: part of the noise key

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    # What the sampling settings imply, defined here once and read by every caller (a frozen
    # record: they cannot change after construction).
    @property
    def unmasked(self) -> bool:
        """No top-k / top-p mask: `mask_logits` is just logits / T."""
        return self.top_k == 0 and self.top_p == 1.0

    @property
    def plain(self) -> bool:
        """Greedy, or sampling without a mask: each token is argmax(logits / T + g) over the whole
        vocabulary (or argmax(logits)), which is what the compiled draft kernels compute."""
        return self.temperature == 0 or self.unmasked

    @property
    def samples_policy(self) -> bool:
        """T = 1 without a mask: the sampling distribution is the policy's own softmax, so the
        log-probs `sample` returns are the policy's (an RL loss's old log-probs)."""
        return self.temperature == 1.0 and self.unmasked


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer on int64 tensors (multiplication wraps mod 2^64)."""
    x = x ^ _shr(x, 30)
    x = x * _M1
    x = x ^ _shr(x, 27)
    x = x * _M2
    return x ^ _shr(x, 31)


def prompt_key(prompt_id: str | int) -> int:
    """A stable 63-bit integer for a prompt id (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(str(prompt_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _wrap(x: int) -> int:
    """A Python integer as the int64 with the same low 64 bits."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def _mix64_int(x: int) -> int:
    """`mix64` of one int64 in Python integers (the same bits: wraps mod 2^64, signed result)."""
    m = (1 << 64) - 1
    x &= m
    x ^= x >> 30
    x = (x * _M1) & m
    x ^= x >> 27
    x = (x * _M2) & m
    return _wrap(x ^ (x >> 31))


def row_keys(seed: int, step: int, prompts: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    """prompts, samples [N] int64 -> [N] int64 key of each (prompt, sample) stream."""
    base = _mix64_int(_wrap(_mix64_int(seed ^ _GOLDEN) + step * _GOLDEN))  # per (seed, step): in Python, no tensor ops
    return mix64(mix64(prompts ^ base) + samples * _GOLDEN)


def uniform(keys: torch.Tensor, positions: torch.Tensor, vocab: int | torch.Tensor) -> torch.Tensor:
    """keys [N], positions [N] -> uniforms in (0, 1) [N, V] (float32); `vocab` may be an id tensor [V].

    On a CPU with the compiled kernels this is one pass (engine/kernels/noise.cpp), bit for bit
    the same values as the tensor ops below (integer hashing; an exact float conversion)."""
    if keys.device.type == "cpu" and available()[0]:
        return uniform_rows(keys, positions, vocab)
    return uniform_reference(keys, positions, vocab)


def uniform_reference(keys: torch.Tensor, positions: torch.Tensor, vocab: int | torch.Tensor) -> torch.Tensor:
    """`uniform` in tensor ops (any device): the definition the compiled kernel reproduces."""
    ids = torch.arange(vocab, device=keys.device) if isinstance(vocab, int) else vocab
    site = mix64(keys ^ mix64(positions + _GOLDEN))  # [N], fully mixed per (row, position)
    # Per token one multiply-xorshift-multiply round suffices: site is already uniform and
    # each step is a bijection in the token id, so a row's V draws are distinct.
    x = (site.unsqueeze(-1) ^ (ids * _VOCAB_MUL)) * _M1  # [N, V]
    x = (x ^ _shr(x, 29)) * _M2
    return (_shr(x, 40).float() + 0.5) * (1.0 / (1 << 24))  # 24 bits


def gumbel(keys: torch.Tensor, positions: torch.Tensor, vocab: int | torch.Tensor) -> torch.Tensor:
    """keys [N], positions [N] -> Gumbel noise [N, V] (float32); `vocab` may be an id tensor [V]."""
    return uniform(keys, positions, vocab).log_().neg_().log_().neg_()


def derive_keys(keys: torch.Tensor, salt: int) -> torch.Tensor:
    """Independent key streams for other uses of randomness (e.g. rejection sampling's coins)."""
    return mix64(keys ^ mix64(torch.tensor([salt], dtype=torch.long, device=keys.device)))


def mask_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[N, V] raw logits -> [N, V] logits / T with entries outside top-k / top-p set to -inf."""
    scaled = logits.float() / temperature if temperature > 0 else logits.float()
    if top_k and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        scaled = _mask_top_p(scaled, top_p)
    return scaled


def _mask_top_p(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keeps the smallest set of best tokens whose mass reaches top_p (always the best one).

    A full sort of a large vocabulary is costly on a CPU and the nucleus is usually a few dozen
    tokens, so look among the top 64, then 1024, and sort everything only if still short.
    """
    V = scaled.shape[-1]
    lse = scaled.logsumexp(-1, keepdim=True)  # [N, 1]
    for k in (64, 1024, V):
        k = min(k, V)
        best, order = torch.topk(scaled, k, dim=-1)  # sorted descending
        probs = (best - lse).exp()
        mass_before = probs.cumsum(-1) - probs  # mass of strictly better tokens
        if k == V or bool((mass_before[:, -1] + probs[:, -1] >= top_p).all()):
            drop_sorted = mass_before >= top_p
            keep = torch.zeros_like(scaled, dtype=torch.bool).scatter(-1, order, ~drop_sorted)
            return scaled.masked_fill(~keep, float("-inf"))
    raise AssertionError("unreachable: k == V sorts everything")


def sample(
    logits: torch.Tensor,  # [N, V]
    keys: torch.Tensor,  # [N] row keys
    positions: torch.Tensor,  # [N] response positions being sampled
    params: SamplingParams,
    noise: torch.Tensor | None = None,  # [N, V] gumbel(keys, positions, V), when the caller has it already
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [N] int64, logprobs [N] float32)."""
    if params.temperature == 0:
        scores = logits.float()
        tokens = scores.argmax(-1)
    else:
        scores = mask_logits(logits, params.temperature, params.top_k, params.top_p)
        tokens = (scores + (gumbel(keys, positions, logits.shape[-1]) if noise is None else noise)).argmax(-1)
    # log_softmax at one entry per row, without materialising the [N, V] log-probabilities.
    logp = scores.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - scores.logsumexp(-1)
    return tokens, logp
