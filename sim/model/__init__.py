"""The simulator's model of one RL step on N devices, pure given the response lengths.

- `parts`: the step in the scenario's placement (`simulate_step`, the colocated one here) and the
  parts both placements share (the techniques, the rollout with its bubble filled, the training
  phases); `separated`: the separated placement's step, built on them;
- `events`: one rollout group generating its requests; `latency`: one forward pass's latency;
- `lengths`: response lengths drawn and dealt to groups; `schedule`: the speculation arm per batch size.
"""
