"""Shared pieces of the benchmarks: prompts, timing, and the `--json` output convention.

Every bench prints a human table and, with `--json`, a last line holding one JSON object whose
`ratio` maps each batch size to ours / baseline, with the CPU model and the compiled kernels'
report (engine/kernels/report.py: tuned parameters, kernel vs torch, whether they served).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

BENCH_PROMPTS = [
    "Explain why the sky is blue in a few sentences.",
    "Write a short poem about the sea.",
    "What is the capital of France, and what is it known for?",
    "Give three tips for learning to program.",
    "Describe how a bicycle works.",
    "Why do leaves change colour in autumn?",
    "Summarise the plot of Romeo and Juliet.",
    "How does a refrigerator keep food cold?",
    "What are prime numbers? Give examples.",
    "Tell me a fun fact about octopuses.",
    "How do airplanes stay in the air?",
    "What is photosynthesis?",
    "Write a haiku about autumn.",
    "What causes earthquakes?",
    "Explain the rules of chess briefly.",
    "Why is exercise good for health?",
]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """n prompt token lists, chat-formatted when the tokenizer has a template."""
    out = []
    for i in range(n):
        text = BENCH_PROMPTS[i % len(BENCH_PROMPTS)]
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        out.append(list(ids))
    return out


def timed(fn, repeat: int = 1):
    """Runs fn `repeat` times; returns (last result, best seconds)."""
    best, result = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t)
    return result, best


def best_interleaved(runs: dict, repeat: int) -> dict[str, float]:
    """{name: closure} -> {name: best seconds}: one warm call each (first-touch allocations), then
    `repeat` rounds in turn (a, b, a, b, ...), so that a slow spell of the machine hits every way."""
    for fn in runs.values():
        fn()
    best = {name: float("inf") for name in runs}
    for _ in range(repeat):
        for name, fn in runs.items():
            best[name] = min(best[name], timed(fn)[1])
    return best


def batch_list(text: str) -> list[int]:
    """argparse type for --batch: comma-separated positive integers."""
    try:
        batches = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects comma-separated integers like 1,8; got {text!r}") from None
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"needs positive batch sizes, got {text!r}")
    return batches


def cpu_model() -> str:
    """The CPU's model name (benchmarks are labelled with it: machines differ between sessions)."""
    from engine.kernels.tuning_cache import cpu_model as model

    return model()


def kernel_report(load: bool = False) -> dict:
    """engine.kernels' report (host, tuned parameters, kernel-vs-torch table, whether the engine
    uses the kernels); without `load`, only if this run loaded them (a GPU run never does)."""
    from engine.kernels.report import report

    return report(load)


def print_host(load: bool = True) -> None:
    """The CPU model and the kernel report, on stderr: a bench's numbers mean little without them."""
    from engine.kernels.report import text

    print(text(kernel_report(load)), file=sys.stderr)


def prefault_memory(gb: float) -> dict:
    """Writes one float per 4 KB page of `gb` GiB, then frees it; -> {"gb", "s", "us_per_fault"}.

    On virtual machines whose host backs guest memory lazily, the first touch of a guest page
    never used since boot costs several times a warm one (docs/BENCHMARKS.md, spot training). A
    run that uses more memory than another (spot training: the sink's blocks, the buffer) then
    pays for first touches in phases it does not even run in, such as the actor's update.
    Touching the free memory once before the runs takes that cost off both ways of a side-by-side
    bench."""
    import resource

    import torch

    n = int(gb * 2**30) // 4
    r0, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    x = torch.empty(n)
    x.view(-1, 1024)[:, 0] = 0.0  # one write per 4 KB page
    del x
    dt, faults = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0
    return {"gb": gb, "s": round(dt, 2), "us_per_fault": round(dt / max(faults, 1) * 1e6, 2)}


def finish(result: dict, as_json: bool) -> None:
    """A bench's last words: the JSON line (with the host and kernel report), or the report alone."""
    if as_json:
        emit_json(result)
    else:
        print_host(load=False)  # the kernels as this run loaded them (a GPU run: none)


def save_plot(fig, ax, path, title: str) -> None:
    """Title, grid, legend, then the PNG at `path` (the benches' plots share their finish)."""
    import matplotlib.pyplot as plt

    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def emit_json(obj: dict) -> None:
    """The last line of a bench: one JSON object, with the CPU model it ran on and the kernel report
    (printed to stderr too)."""
    kernels = kernel_report()
    from engine.kernels.report import text

    print(text(kernels), file=sys.stderr)
    print(json.dumps({"cpu": cpu_model(), "kernels": kernels, **obj}, sort_keys=True))


def record_ms(result: dict, key: str, baseline_s: float, ours_s: float) -> None:
    """Stores a side-by-side timing under `key`: ms of both and the ratio baseline / ours."""
    result["baseline_ms"][key] = round(baseline_s * 1e3, 2)
    result["ms"][key] = round(ours_s * 1e3, 2)
    result["ratio"][key] = round(baseline_s / ours_s, 3)
