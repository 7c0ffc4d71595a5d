"""Data: which problems a run trains and evaluates on, read from the files users have.

- `loader`: PromptLoader, the problems of each RL step per rank, resumable to the step.
"""

from pipeline.data.loader import PromptLoader, epoch_order

__all__ = ["PromptLoader", "epoch_order"]
