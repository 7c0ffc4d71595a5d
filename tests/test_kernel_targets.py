"""The kernels' other vector target: on an AVX-512 host, the AVX2 build (`TAILSPEC_CPU_MARCH=
x86-64-v3`, 8-float vectors) passes the bit-for-bit, bf16 and training-attention tests too, so the code path an
AVX2-only machine compiles stays tested wherever the suite runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kernels.library import available, library

OK, WHY = available()
ROOT = Path(__file__).resolve().parents[1]
AVX2_TESTS = [
    "tests/test_kernels.py::test_skinny_product_equals_torch_with_bias_and_residual",
    "tests/test_kernels.py::test_skinny_row_does_not_depend_on_how_many_rows_share_the_call",
    "tests/test_kernels.py::test_a_verify_pass_reproduces_sequential_decoding_bit_for_bit",
    "tests/test_bf16_weights.py",
    "tests/test_drafter_bf16.py",  # bf16 products: the scalar sums without AVX512_BF16
    "tests/test_causal_attention.py::test_forward_and_gradients_match_float64_sdpa",  # kWeighRows 2, not 4
]


@pytest.mark.slow
@pytest.mark.skipif(not OK, reason=f"CPU kernels unavailable here: {WHY}")
def test_the_avx2_build_passes_the_exactness_tests_on_an_avx512_host():
    if library().skinny_vector_width() != 16:
        pytest.skip("this host builds the AVX2 path natively: the suite itself tests it")
    env = {**os.environ, "TAILSPEC_CPU_MARCH": "x86-64-v3", "TAILSPEC_CPU_TUNE": "0"}
    probe = "from engine.kernels.library import library; print(library().skinny_vector_width())"
    width = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert width.stdout.strip().splitlines()[-1] == "8", width.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *AVX2_TESTS],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-1000:]
