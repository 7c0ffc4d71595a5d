"""The run's side of draft sources the engine cannot make alone, each a step hook.

- `bubble`: idle ranks pre-generate the next step's rollouts, which become its drafts;
- `history`: every rank's responses gathered into every rank's history store (engine.spec.history).
"""
