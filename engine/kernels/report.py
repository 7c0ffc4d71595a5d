"""What the kernels do on this host, as a dict and as text (`python -m engine.kernels --report`).

`report()` -> {"cpu", "flags", "threads", "params", "source", "serves", "bit_for_bit",
"guard": {rows: {"kernel_ms", "torch_ms", "ratio"}}, ...}, or {"available": False, "why"} where
the kernels do not build; every bench records it in its JSON (bench/common.py).
"""

from __future__ import annotations

from dataclasses import asdict

from engine.kernels import tune
from engine.kernels.library import KernelUnavailable, available, loaded, tuning
from engine.kernels.params import from_dict
from engine.kernels.tuning_cache import cpu_model


def report(load: bool = True) -> dict:
    """The report; with load=False, where this process has not loaded the kernels, only says so."""
    if not load and not loaded():
        return {"available": False, "cpu": cpu_model(), "why": "not loaded by this run (no CPU model served)",
                "bit_for_bit": False}
    try:
        t = tuning()
    except (KernelUnavailable, OSError) as e:
        return {"available": False, "cpu": cpu_model(), "why": str(e), "bit_for_bit": False}
    ok, why = available()
    out = asdict(t)
    out.pop("search")
    out.update(available=ok, why=why, label=from_dict(t.params).label(), bit_for_bit=ok,
               shapes=[list(s) for s in tune.SHAPES])
    return out


def text(r: dict) -> str:
    """The report as lines for a terminal."""
    if "params" not in r:
        return f"CPU: {r['cpu']}\nkernels: unavailable ({r['why']}); the engine uses torch's ops"
    lines = [
        f"CPU: {r['cpu']} ({r['vector_width'] * 32}-bit vectors, {r['threads']} threads)",
        f"build: {' '.join(r['flags'])}",
        f"parameters: {r['label']} ({r['source']}; defaults {from_dict(r['defaults']).label()})",
        "engine path: " + ("the compiled kernels (a verify pass reproduces sequential decoding bit for bit)"
                           if r["available"] else f"torch's ops for the whole model: {r['why']}"),
    ]
    if r["guard"]:
        lines.append(f"products of {'+'.join(f'{k}x{n}' for k, n in r['shapes'])}, kernel vs torch:")
        lines.append(f"{'rows':>6} {'kernel ms':>10} {'torch ms':>9} {'torch/kernel':>12}")
        for m, v in r["guard"].items():
            flag = "  slower" if v["ratio"] < 1.0 else ""
            lines.append(f"{m:>6} {v['kernel_ms']:>10.2f} {v['torch_ms']:>9.2f} {v['ratio']:>12.2f}{flag}")
    else:
        lines.append("no kernel-vs-torch measurements (tuning skipped or failed): python -m engine.kernels --retune")
    return "\n".join(lines)
