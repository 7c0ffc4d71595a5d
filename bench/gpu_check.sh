#!/usr/bin/env bash
# Every GPU check in one bounded run (under 8 minutes), for when an accelerator is at hand: the
# gpu-marked tests, then the GPU benchmarks, then a short table (bench/gpu_check.py says which).
# Carry checkpoints/tiny-reason, checkpoints/tiny-reason-drafter and checkpoints/tiny-reason-drafter-prompts.jsonl
# (what `make train` builds) for the tiny benches.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" -m bench.gpu_check "$@"
