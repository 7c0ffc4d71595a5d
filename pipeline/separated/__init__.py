"""The separated placement: actor ranks train, rollout ranks generate (pipeline.placement=separated).

- `placement`: each rank's role and the actor, rollout and push process groups, built once;
- `rollout`: the rollout ranks' loop (generate, send, load); `actor`: the actor ranks' loop
  (receive, train, push);
- `shipment`: a step's scored rollouts from the rollout ranks to the actor ranks;
- `weight_sync`: the actor's weights pushed to the rollout ranks in versioned buckets.
"""
