"""TailSpec's rollout engine. Importing it has no side effects (entry points set the OpenMP
default: engine.omp)."""
