"""Compiled CPU kernels (built on first use; see skinny.py)."""
