"""Does a run fit its devices? The memory planner, from a model's config.json and the run config.

`python -m launch.memory` (report.py) prints the plan: per rank role, the bytes of each part
(plan.py), the actor's (actor.py) and the rollout side's (rollout.py), each pure arithmetic on
the model's shape. Nothing here loads a model or touches a device.
"""
