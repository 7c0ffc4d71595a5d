"""Drafter training: the node's DataBuffer and its producers (buffer/), the training step and the
online spot trainer (training/), the offline warm start (warmstart/), the elastic spot pool
(pool/), and here the rank coordinator and spot training on a placement's rollout ranks."""
