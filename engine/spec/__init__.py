"""Speculative decoding: draft trees, verification, drafters.

Vocabulary (used throughout): the *root* of a row's tree is its last sampled token, not yet in
the KV cache; *nodes* are drafted candidates for the following positions; *accepted* nodes are
those the verifier keeps; the *bonus* (all drafts on a path accepted) or *correction* (a miss)
token is the target's own sample after the last accepted node, which becomes the next root.
"""
