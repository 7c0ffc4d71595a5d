"""The elastic spot pool: drafter training as its own torchrun-elastic job, and the run's side of it.

- `elastic`: a member's loop, checkpoints and versioned publications (launch.spot_pool starts it);
- `follower`: a colocated run's ranks, which fill the buffer and load the pool's publications;
- `separated_follower`: a separated run's rollout ranks, which also set the node's gate.
"""
