"""Build, load and describe the project's compiled CPU kernels (engine/kernels/*.cpp).

The sources are compiled on first use with the machine's compiler (`g++ -O3 -march=native
-fopenmp`, a few seconds; decode_ops.cpp adds no-trapping-math by pragma so that GCC vectorises
the compare-and-select in its exp and softmax) into one library in engine/kernels/build/, keyed by a hash of the
sources, flags and host, and loaded with ctypes; their OpenMP threads come from the runtime
torch already loaded (same soname). Where they cannot be built (no compiler, not x86-64 Linux),
`available()` says why and the engine uses torch's ops: the same results up to float summation
order, only slower. `TAILSPEC_CPU_KERNELS=0` turns them off (for side-by-side measurements);
`TAILSPEC_CPU_MARCH` overrides `-march=native`.

After loading, the skinny kernel's loop parameters are tuned for the host once and cached beside
the build (engine/kernels/tuning_cache.py). If, tuned, the kernels are still slower than torch's
products here, `available()` says so and the engine uses torch's ops for the whole model (never
a mix: see engine/kernels/tune.py). `python -m engine.kernels --report` prints all of it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

from engine.kernels import tuning_cache

HERE = Path(__file__).parent
SOURCES = ("skinny.cpp", "decode_ops.cpp", "eagle_chain.cpp", "causal_attention.cpp", "causal_attention_bf16.cpp", "noise.cpp",
           "fingerprint.cpp")
BUILD_DIR = HERE / "build"  # or, where the package is read-only, ~/.cache/tailspec/kernels
# TAILSPEC_CPU_MARCH picks another target (e.g. x86-64-v3 to test the AVX2 code path on an AVX-512 machine).
FLAGS = ["-O3", f"-march={os.environ.get('TAILSPEC_CPU_MARCH', 'native')}", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


class KernelUnavailable(RuntimeError):
    pass


def library() -> ctypes.CDLL:
    """The built, loaded and tuned kernel library (KernelUnavailable where it cannot be built)."""
    return _loaded()[0]


def tuning() -> tuning_cache.Tuning:
    """This host's kernel parameters, how they were found, and the guard's kernel-vs-torch table."""
    return _loaded()[1]


def loaded() -> bool:
    """Whether this process has built / loaded (and tuned) the kernels already (a bench on a GPU never does)."""
    return _loaded.cache_info().currsize > 0


@lru_cache(maxsize=1)
def _loaded() -> tuple[ctypes.CDLL, tuning_cache.Tuning]:
    if os.environ.get("TAILSPEC_CPU_KERNELS", "1") == "0":
        raise KernelUnavailable("turned off by TAILSPEC_CPU_KERNELS=0")
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise KernelUnavailable(f"built for x86-64 Linux only (this is {sys.platform} / {platform.machine()})")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise KernelUnavailable("no C++ compiler (install g++)")
    sources = [HERE / name for name in SOURCES]
    digest = hashlib.sha256(" ".join([cxx, *FLAGS, platform.node()]).encode())
    for src in [*sources, *sorted(HERE.glob("*.h"))]:
        digest.update(src.read_bytes())
    build_dir = _build_dir()
    lib_path = build_dir / f"tailspec_cpu-{digest.hexdigest()[:16]}.so"
    if not lib_path.exists():
        with tempfile.TemporaryDirectory(dir=build_dir) as tmp:
            out = Path(tmp) / lib_path.name
            proc = subprocess.run([cxx, *FLAGS, *map(str, sources), "-o", str(out)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise KernelUnavailable(f"{cxx} failed to build {', '.join(SOURCES)}: {proc.stderr.strip()[-500:]}")
            os.replace(out, lib_path)  # atomic: a concurrent builder sees a whole library or none
        for stale in build_dir.glob("*.so"):  # builds of older sources (a loaded one stays mapped)
            if stale != lib_path and stale.stat().st_mtime < lib_path.stat().st_mtime - 60:
                stale.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(lib_path))
    P, I, F32, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    signatures = {
        "skinny_gemm": [P, I, P, P, P, I, P, I, I, I, I, INT],
        "skinny_gemm_bf16": [P, I, P, P, P, I, P, I, I, I, I, INT],
        "skinny_pack": [P, I, P, I, I],
        "skinny_pack_bf16": [P, I, P, I, I],
        "skinny_gemm_bf16dot": [P, I, P, P, P, I, P, I, I, I, I, INT],
        "skinny_pack_bf16dot": [P, I, P, I, I],
        "rms_norm_rows": [P, I, P, F32, P, I, I, I],
        "attend_rows": [P, I, I, P, P, I, I, P, P, I, I, I, I, I, I, F32, INT],
        "rope_write_attend": [P, P, P, P, P, P, I, I, P, P, I, I, I, I, I, I, F32, INT],
        "silu_mul_rows": [P, P, I, I],
        "causal_attention_forward": [P, I, I, I, P, P, I, I, I, P, P, I, I, I, I, I, F32, INT],
        "causal_attention_backward": [P, I, I, I, P, P, I, I, I, P, P, P, P, P, P, I, I, I, I, I, F32, INT],
        "causal_attention_forward_bf16": [P, I, I, I, P, P, I, I, I, P, P, I, I, I, I, I, F32, INT],
        "causal_attention_backward_bf16": [P, I, I, I, P, P, I, I, I, P, P, P, P, P, P, I, I, I, I, I, F32, INT],
        "uniform_rows": [P, P, P, I, I, P, INT],
        "eagle_draft": [I] * 10 + [P, P, I, P, P, P, P, F32, P, P] + [P] * 7 + [P, F32, P, P, I, I, P, F32, P, P, INT, INT],
        "eagle_tree_draft": [I] * 12 + [P, P, I, P, P, P, P, F32, F32, P, P] + [P] * 8 + [F32, P, P, I, I, P, P, P, INT, INT],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    lib.sample_bytes_differ.argtypes, lib.sample_bytes_differ.restype = [P, I, P], I
    lib.skinny_set_params.argtypes, lib.skinny_set_params.restype = [INT, INT, I, I, INT], INT
    lib.skinny_wide_rows.argtypes, lib.skinny_wide_rows.restype = [], I
    lib.causal_attention_bf16_native.argtypes, lib.causal_attention_bf16_native.restype = [], INT
    lib.skinny_max_rows.argtypes, lib.skinny_max_rows.restype = [INT], INT
    return lib, tuning_cache.settle(lib, build_dir, digest.hexdigest()[:16], [cxx, *FLAGS])


def _build_dir() -> Path:
    for candidate in (BUILD_DIR, Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tailspec" / "kernels"):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            if os.access(candidate, os.W_OK):
                return candidate
        except OSError:
            continue
    raise KernelUnavailable(f"no writable folder to build the kernels in ({BUILD_DIR} or ~/.cache/tailspec/kernels)")


@lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """(usable, reason): whether the kernels build and load here, and if not, why (asked once per
    process: a failed build is not retried on every call)."""
    try:
        t = tuning()
    except (KernelUnavailable, OSError) as e:
        warnings.warn(f"TailSpec CPU kernels unavailable, using torch ops (slower): {e}", stacklevel=2)
        return False, str(e)
    if not t.serves:
        why = (f"slower than torch's products on this CPU ({t.cpu}) even tuned (at rows {t.slower_rows}): the engine "
               "uses torch's ops for the whole model, so a verify pass equals sequential decoding up to float rounding "
               "only, not bit for bit (python -m engine.kernels --report)")
        warnings.warn(f"TailSpec CPU kernels not used: {why}", stacklevel=2)
        return False, why
    return True, "ok"
