"""Projection of a scenario: each technique alone and combined at every device count (`project`),
the trend checks (`sweeps`), and their Markdown report (`report`) and PNGs (`plots`)."""
