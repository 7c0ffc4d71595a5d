"""Run checkpoints: what a resumed run needs (`state`), and which checkpoints stay on disk (`keep`)."""
