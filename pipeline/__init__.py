import engine  # noqa: F401  (OpenMP defaults, set before torch loads)
