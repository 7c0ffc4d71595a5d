"""The node's DataBuffer: hidden-state entries in one shared-memory segment per node and run.

- `ring`: the DataBuffer, a ring of entries bounded in bytes; `entries`: what it stores and lists;
- `segment`: a segment's name, its header's owner, and reclaiming a dead run's;
- `gate`: the record in the segment's header through which rollout ranks tell spot-pool members
  when they may train;
- `sink` and `actor_features`: its producers, the engine's feature sink and the actor's forward.
"""
