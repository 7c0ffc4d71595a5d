"""The simulator's model of one RL step on N devices, pure given the response lengths.

- `step`: the step in the scenario's placement, `colocated` or `separated`, both built on `parts`
  (the techniques, the rollout with its bubble filled, the training phases);
- `events`: one rollout group generating its requests; `latency`: one forward pass's latency;
- `lengths`: response lengths drawn and dealt to groups; `schedule`: the speculation arm per batch size.
"""
