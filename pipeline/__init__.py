"""The RL loop (trainer.py) and its stages: tasks and rewards, algorithms, actor backends,
rollouts, train batches, weight sync, metrics and run checkpoints."""
