"""Benchmarks, run as entry points (`python -m bench.<name>`): importing this package sets the
OpenMP default before torch loads (engine.omp); library packages (engine, spot, pipeline) set
nothing."""

from engine.omp import openmp_default

openmp_default()
