"""The actor's update: scored rollouts in, one PPO update of the actor out, in every placement.

- `learner`: the update itself, its advantages, losses and metrics combined over ranks;
- `train_batch`: rollouts to a right-padded `TrainBatch`;
- `old_logprobs`: where the PPO ratio's old log-probs come from;
- `reference`: the frozen reference policy of the KL term.
"""
