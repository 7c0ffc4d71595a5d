"""A step's response-length statistics: the mean, p50, p90 and max of its rollouts' lengths.

Computed once, by the logger, from the lengths it is given with the step (every rank's), and
logged as `rollout/response_length/{mean,p50,p90,max}`; the console line, W&B, metrics.jsonl
and the dashboard all read those metrics. A reasoning run's lengths are long-tailed, so the
tail (p90, max) says more about a step's time than the mean does. Percentiles interpolate
linearly between the sorted lengths (numpy's default). Nothing here knows about steps or files.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

LENGTH = "rollout/response_length"
PERCENTILES = (50, 90)


def length_metric(stat: str) -> str:
    """The metric name of one statistic: "p50" -> "rollout/response_length/p50"."""
    return f"{LENGTH}/{stat}"


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """{metric: value} of the mean, percentiles and max of `lengths`; {} for no lengths."""
    if not lengths:
        return {}
    values = np.asarray(lengths, dtype=np.float64)  # [R], one per rollout of the step
    stats = {length_metric("mean"): float(values.mean())}
    for q, value in zip(PERCENTILES, np.percentile(values, PERCENTILES)):
        stats[length_metric(f"p{q}")] = float(value)
    stats[length_metric("max")] = float(values.max())
    return stats
