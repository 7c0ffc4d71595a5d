"""Offline drafter warm-start: the target writes its own training data, the drafter learns it.

`python -m spot.warmstart` (train.py); `data`: the target's responses and features; `ranks`: the
same over torchrun's ranks; `draft_vocab`: the reduced draft vocabulary (EAGLE-3's d2t).
"""
