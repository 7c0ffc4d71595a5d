"""Data: which problems a run trains and evaluates on, read from the files users have.

- `fields`: rows of JSONL / JSON / parquet files and dotted field paths into them;
- `chat`: chat-message prompts, the conversation a chat run renders, its token ids;
- `files`: a file's rows as Problems, ids hashed where absent, every bad row reported;
- `split`: the held-out split by a hash of the id;
- `sets`: a run's training problems and named held-out set from its files;
- `layouts` and `prepare` (`python -m pipeline.data.prepare`): public dataset layouts converted
  to the run's, with a train / test split;
- `loader`: PromptLoader, the problems of each RL step per rank, resumable to the step.
"""

from pipeline.data.loader import PromptLoader, epoch_order

__all__ = ["PromptLoader", "epoch_order"]
