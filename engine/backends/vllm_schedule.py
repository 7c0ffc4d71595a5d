"""The tuner's learned choices as vLLM's `num_speculative_tokens_per_batch_size` schedule (pure).

The native engine's tuner (engine.spec.tuner) keeps, per batch-size bucket, the arm with the best
median tokens/s. vLLM 0.32 takes a list of inclusive ranges `(start, end, k)`: k draft tokens
for batch sizes start..end, 0 for none, capped at the config's `num_speculative_tokens`. A
bucket becomes one range, its best arm's depth becomes k ("off" is 0); vLLM's EAGLE drafts a
chain, so a tree arm (top-k > 1) contributes its depth. A bucket the tuner has not yet measured
takes `default_k`.
"""

from __future__ import annotations

from engine.spec.tuner import parse_arm


def arm_tokens(label: str) -> int:
    """Draft tokens per step of a tuner arm label ("off" -> 0, "d4k1v4" -> 4)."""
    shape = parse_arm(label)
    return 0 if shape is None else shape.depth


def vllm_schedule(arms: list[str], thresholds: list[int], best: list[int | None], max_batch: int,
                  default_k: int) -> list[tuple[int, int, int]]:
    """Ranges covering 1..max_batch: bucket i spans thresholds[i] .. thresholds[i+1] - 1 (the last to
    max_batch) with the depth of arms[best[i]] (default_k where best[i] is None)."""
    if len(best) != len(thresholds):
        raise ValueError(f"one best arm per bucket: {len(best)} for {len(thresholds)} buckets")
    if not thresholds or thresholds[0] != 1:
        raise ValueError(f"bucket thresholds must start at 1, got {thresholds}")
    out = []
    for i, start in enumerate(thresholds):
        if start > max_batch:
            break
        end = min(thresholds[i + 1] - 1, max_batch) if i + 1 < len(thresholds) else max_batch
        out.append((start, end, arm_tokens(arms[best[i]]) if best[i] is not None else default_k))
    return out


def schedule_from_tuner(tuner_state: dict | None, arms: list[str], thresholds: list[int], max_batch: int,
                        default_k: int) -> list[tuple[int, int, int]]:
    """The schedule of a saved tuner (TunerPolicy.state_dict()); None: every bucket at default_k."""
    from engine.spec.tuner import Bandit

    best: list[int | None] = [None] * len(thresholds)
    if tuner_state is not None:
        bandit = Bandit(len(arms), thresholds)
        bandit.load_state_dict(tuner_state)
        best = [bandit.best(i) if any(bandit.rewards[i]) else None for i in range(len(thresholds))]
    return vllm_schedule(arms, thresholds, best, max_batch, default_k)
