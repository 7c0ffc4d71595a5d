"""The rollout stage of an RL step: problems in, scored rollouts out.

- `stage`: problems -> requests -> the rollout backend -> scored rollouts (`ScoredRollouts`);
- `schedule`: where and in what order a step's rollouts are generated, and which rank trains which;
- `stealing`: work units claimed once each through the job's store; `lengths`: each prompt's
  predicted response length, for long-first admission;
- `report`: a step's rollout metrics from one report per generating rank.
"""
