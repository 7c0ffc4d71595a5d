"""The RL loop (trainer.py) and its stages, one package each, in the order of a step: tasks and
rewards (tasks/, data/), the rollout (rollout/), advantages and losses (algorithms/), the actor's
update (update/, actors/), then metrics/ and checkpoint/; drafts/ holds the run's side of bubble
and history drafts, separated/ the separated placement's loops and transfers."""
