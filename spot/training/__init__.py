"""Training the EAGLE drafter: records, pairs, loss and the step shared by warm-start and spot training.

- `records`: HiddenStateRows, one sequence's tokens with the target's features;
- `features`: the target's features for whole sequences (one teacher-forced forward);
- `pairs`: training pairs packed into fixed-length windows; `loss`: the drafter loss;
- `step`: one optimiser step on packed pairs; `trainer`: the online, preemptible spot trainer.
"""
