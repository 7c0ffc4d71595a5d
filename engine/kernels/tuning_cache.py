"""When the kernels are tuned, and where the result is kept: `settle(lib, ...)` -> `Tuning`.

The first process that loads a build on a host measures (engine/kernels/tune.py, with its
progress on stderr) and writes the choice beside the build as tuning-<key>.json; later ones
read it. The key hashes the CPU model, the compiler and its flags, the kernel sources (the
build's own digest), the tuner's sources and the thread count, so a change to any of them tunes
again. Concurrent first processes (two ranks) take a file lock: one measures, the others wait
and read. If tuning fails, the hand-tuned defaults are used with one warning (nothing is
written, so the next process tries again). `TAILSPEC_CPU_TUNE=0` skips tuning: defaults, no
measurements, and the guard is not consulted; `TAILSPEC_CPU_TUNE=force` measures again and
replaces the cached choice (`python -m engine.kernels --retune`).

A cached choice that lost to torch at some row count is measured again by the next process, up
to MEASURES times in all, and the better of the two (by the geometric mean of the guard's
ratios) is kept: a tuning made while other work shared the machine is not final.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.kernels import params as kparams
from engine.kernels import tune

BUDGET_S = 30.0
MEASURES = 3  # tunings in all for a key whose cached choice still loses somewhere
HERE = Path(__file__).parent


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or the platform's processor string)."""
    import platform

    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass
class Tuning:
    """What a host's tuning chose and measured (the JSON beside the build)."""

    key: str
    cpu: str
    flags: list[str]
    threads: int
    vector_width: int
    params: dict  # KernelParams.as_dict()
    defaults: dict
    source: str  # "measured", "cached", "defaults (TAILSPEC_CPU_TUNE=0)", "defaults (tuning failed: ...)"
    serves: bool = True  # the guard: the kernels are the faster path here (engine uses them)
    slower_rows: list[int] = field(default_factory=list)
    guard: dict = field(default_factory=dict)  # rows -> {"kernel_ms", "torch_ms", "ratio"} (torch / kernel)
    search: dict = field(default_factory=dict)  # stage -> candidate -> rows -> seconds
    seconds: float = 0.0
    measures: int = 1  # how many tunings this choice is the best of

    @property
    def score(self) -> float:
        """Geometric mean of torch / kernel over the guard's row counts (0 when not measured)."""
        ratios = [v["ratio"] for v in self.guard.values()]
        return math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else 0.0

    @property
    def chosen(self) -> kparams.KernelParams:
        return kparams.from_dict(self.params)


def key(build_digest: str, flags: list[str], threads: int) -> str:
    h = hashlib.sha256(json.dumps([cpu_model(), flags, build_digest, threads]).encode())
    for name in ("tune.py", "params.py", "tuning_cache.py"):
        h.update((HERE / name).read_bytes())
    return h.hexdigest()[:16]


def settle(lib, build_dir: Path, build_digest: str, flags: list[str]) -> Tuning:
    """Applies this host's parameters to `lib` (cached, measured now, or the defaults) -> Tuning."""
    threads = torch.get_num_threads()
    k = key(build_digest, flags, threads)
    base = dict(key=k, cpu=cpu_model(), flags=flags, threads=threads, vector_width=lib.skinny_vector_width(),
                defaults=kparams.defaults(lib).as_dict())
    if os.environ.get("TAILSPEC_CPU_TUNE", "1") == "0":
        t = Tuning(**base, params=base["defaults"], source="defaults (TAILSPEC_CPU_TUNE=0)")
    else:
        path = build_dir / f"tuning-{k}.json"
        try:
            with open(build_dir / "tuning.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                force = os.environ.get("TAILSPEC_CPU_TUNE") == "force"
                t = None if force else _read(path)
                if t is None:
                    t = _measure(lib, base, path)
                elif t.slower_rows and t.measures < MEASURES:
                    t = _remeasure(lib, base, path, t)
        except Exception as e:  # any failure of the measurement: the defaults still work (warned once)
            warnings.warn(f"TailSpec CPU kernels: tuning failed, using the default parameters: {e!r}", stacklevel=3)
            t = Tuning(**base, params=base["defaults"], source=f"defaults (tuning failed: {e!r})")
    kparams.apply(lib, t.chosen)
    return t


def _read(path: Path) -> Tuning | None:
    if not path.exists():
        return None
    t = Tuning(**json.loads(path.read_text()))
    t.source = "cached"
    return t


def _remeasure(lib, base: dict, path: Path, cached: Tuning) -> Tuning:
    """Tunes again for a cached choice that lost at rows `cached.slower_rows`; keeps the better."""
    print(f"engine.kernels: the cached tuning lost to torch at {cached.slower_rows} rows; measuring again "
          f"({cached.measures + 1} of at most {MEASURES})", file=sys.stderr, flush=True)
    fresh = _measure(lib, base, path)
    best = fresh if fresh.score >= cached.score else cached
    best.measures, best.source = cached.measures + 1, "measured" if best is fresh else "cached"
    _write(path, best)
    return best


def _write(path: Path, t: Tuning) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(t), indent=1))
    os.replace(tmp, path)


def _measure(lib, base: dict, path: Path) -> Tuning:
    t0 = time.perf_counter()
    print(f"engine.kernels: tuning the CPU kernels for this host, once (<= {BUDGET_S:.0f} s; cached in {path.name})",
          file=sys.stderr, flush=True)
    timer = tune.Timer(lib, base["threads"])
    start = kparams.from_dict(base["defaults"])
    chosen, log = tune.search(
        timer.kernel, start, tune.tiles(lib.skinny_vector_width(), lib.skinny_max_rows),
        out_of_time=lambda: time.perf_counter() - t0 > 0.6 * BUDGET_S,  # the guard takes the rest
        progress=lambda s: print(f"\r  {s:<24}", end="", file=sys.stderr, flush=True), measure_core=timer.one_core,
    )
    best: dict[int, tuple[float, float]] = {}  # rows -> (kernel s, torch s)
    for rounds in (3, 6):  # the second pass re-measures only the row counts the kernel lost
        for m in [m for m in tune.GUARD_ROWS if m not in best or best[m][1] < best[m][0]]:
            ours, theirs = timer.versus(chosen, m, rounds)
            best[m] = (min(ours, best.get(m, (ours, theirs))[0]), min(theirs, best.get(m, (ours, theirs))[1]))
    table = {str(m): {"kernel_ms": round(k * 1e3, 3), "torch_ms": round(t * 1e3, 3), "ratio": round(t / k, 3)}
             for m, (k, t) in best.items()}
    serves, slower = tune.guard({int(m): v["ratio"] for m, v in table.items()})
    t = Tuning(**base, params=chosen.as_dict(), source="measured", serves=serves, slower_rows=slower, guard=table,
               search=log, seconds=round(time.perf_counter() - t0, 2))
    print(f"\r  chose {chosen.label()} in {t.seconds:.1f} s" + ("" if serves else "; slower than torch here: kernels off"),
          file=sys.stderr, flush=True)
    _write(path, t)
    return t
