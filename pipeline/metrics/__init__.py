"""Metrics: one logger (pipeline.metrics.logger) with W&B, JSONL and console sinks, and at the
end of a run a PNG dashboard and a text summary rebuilt from the run folder's files.

Run folder files: metrics.jsonl, lengths.jsonl (pipeline.metrics.jsonl), wandb/ (offline runs),
dashboard.png, summary.txt, and comparison.json when the run was measured against a reference
run (pipeline.metrics.comparison).
"""

from pipeline.metrics.config import MetricsConfig
from pipeline.metrics.logger import MetricsLogger

__all__ = ["MetricsConfig", "MetricsLogger"]
