"""Rollout backends other than the native engine (engine.engine.RolloutEngine, the CPU default and
the reference for exactness): vLLM (`engine.backend: vllm`, vllm_engine.py) for GPU clusters."""
