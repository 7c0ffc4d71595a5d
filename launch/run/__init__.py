"""Building an RL run: `build.build_run(cfg, ranks) -> Run` and the parts it connects.

- `config`: TrainConfig, the run config, one typed section per component (loaded by common.config);
- `capabilities`: the config checked once, as it loads, against what each setting needs of the
  rollout backend, the actor backend and the placement;
- `problems`: the run's problems and its prompt loader;
- `parts`: what both placements share (the data, the rollout and update sides, the `Run` and its
  loop over the steps, the rank's log, the resume point);
- `colocated`, `separated`: the parts of each placement on this rank;
- `build`: `build_run`, which picks the placement and releases every part through one ExitStack.
"""
