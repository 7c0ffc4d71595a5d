"""Calibration: a measured run read (`runs`), fitted into a scenario (`fit`), and checked by
predicting another run (`validation`)."""
