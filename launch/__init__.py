"""Entry points (`python -m <package>.<module>`): importing this package sets the OpenMP default
before torch loads (engine.omp); library packages (engine, spot, pipeline) set nothing."""

from engine.omp import openmp_default

openmp_default()
