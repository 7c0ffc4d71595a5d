#!/usr/bin/env bash
# Every GPU check in one short run, for when an accelerator is at hand: the gpu-marked tests,
# then SmolLM2 provisioning (the benches run on CPU for now).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" || exit 1
$PY -m pytest -q -m gpu tests/test_gpu.py tests/test_graphs.py 2>&1 | tail -3
$PY -m engine.provision smollm2 --out checkpoints/smollm2-135m-instruct
