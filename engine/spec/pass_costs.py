"""What one target pass costs on this machine, by rows and entries per row: measured once, cached.

A decode step runs the target over `rows` active rows x `entries` per row (the root, plus the
draft nodes when speculating), then samples the target's token at every entry (the noise-indexed
sampler draws a vocabulary of noise per entry). On a GPU a verify of a few dozen entries costs
about one decode step; on a CPU the pass costs about per entry once it holds more than a few
dozen rows x entries (compute-bound), so whether a draft pays depends on the batch size as much
as on its acceptance. `PassCosts` is that dependence as a table: seconds measured on a grid of
(rows, entries), predicted elsewhere by bilinear interpolation (linear extrapolation past the
grid's edge).

`measure(runtime, ...)` times the engine's own runtime (its packed layers and kernels) and its
sampler on a private KV cache at a representative context; `cached(...)` keeps the table in a JSON
file keyed by the CPU model, the model's shape and dtype, the thread count and the grid, in
`$TAILSPEC_CACHE` or `~/.cache/tailspec/pass-costs/`, so a host measures once (as the kernels'
tuning does). It knows nothing about drafters or acceptance: engine.spec.cost_policy combines the
two.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common.atomic import atomic_file

VERSION = 1  # bump when what is measured changes: older caches are measured again


@dataclass(frozen=True)
class PassCosts:
    """Seconds of one target pass (forward + sampling) over rows x entries, on a measured grid."""

    rows: tuple[int, ...]  # increasing
    entries: tuple[int, ...]  # increasing, from 1 (a plain decode step)
    seconds: tuple[tuple[float, ...], ...]  # [len(rows)][len(entries)]

    def __post_init__(self) -> None:
        for name, axis in (("rows", self.rows), ("entries", self.entries)):
            if not axis or axis[0] < 1 or any(b <= a for a, b in zip(axis, axis[1:])):
                raise ValueError(f"PassCosts.{name} must be positive and increasing, got {axis}")
        if self.entries[0] != 1:
            raise ValueError(f"PassCosts.entries must start at 1 (a plain decode step), got {self.entries}")
        if len(self.seconds) != len(self.rows) or any(len(r) != len(self.entries) for r in self.seconds):
            raise ValueError("PassCosts.seconds must be a rows x entries table")
        if any(s <= 0 for r in self.seconds for s in r):
            raise ValueError("PassCosts.seconds must be positive")

    @classmethod
    def make_dummy(cls, fixed: float = 0.07, per_token: float = 0.003, rows=(1, 2, 4, 8, 16, 32),
                   entries=(1, 2, 3, 5, 9)) -> PassCosts:
        """A CPU-like table for tests: `fixed` seconds a pass (the weights streamed once) plus
        `per_token` per row x entry (the products)."""
        return cls(tuple(rows), tuple(entries), tuple(tuple(fixed + per_token * b * t for t in entries) for b in rows))

    def __call__(self, rows: int, entries: int) -> float:
        """Predicted seconds of a pass over `rows` x `entries` (both >= 1)."""
        i, wr = _segment(self.rows, rows)
        j, we = _segment(self.entries, entries)
        s = self.seconds
        lo = s[i][j] + (s[i][j + 1] - s[i][j]) * we if len(self.entries) > 1 else s[i][j]
        if len(self.rows) == 1:
            return max(lo, 1e-9)
        hi = s[i + 1][j] + (s[i + 1][j + 1] - s[i + 1][j]) * we if len(self.entries) > 1 else s[i + 1][j]
        return max(lo + (hi - lo) * wr, 1e-9)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PassCosts:
        return cls(tuple(d["rows"]), tuple(d["entries"]), tuple(tuple(r) for r in d["seconds"]))


def _segment(axis: tuple[int, ...], x: float) -> tuple[int, float]:
    """(i, w): x lies at axis[i] + w * (axis[i + 1] - axis[i]); w < 0 or > 1 extrapolates at the edges."""
    if len(axis) == 1:
        return 0, 0.0
    i = min(max(bisect.bisect_right(axis, x) - 1, 0), len(axis) - 2)
    return i, (x - axis[i]) / (axis[i + 1] - axis[i])


def grid(max_rows: int, max_entries: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The measured grid: rows 1, 2, 4, ... up to `max_rows` (included); entries 1, 2, 3, 5, 9, 17, ...
    (a chain of 0, 1, 2, 4, 8, 16 draft tokens) up to `max_entries` (included)."""
    rows = sorted({*(1 << k for k in range(max_rows.bit_length()) if 1 << k <= max_rows), max_rows})
    entries = sorted({1, *(e for e in (2, 3, 5, 9, 17, 33, 65) if e <= max_entries), max_entries})
    return tuple(rows), tuple(entries)


def measure(runtime, params, rows: tuple[int, ...], entries: tuple[int, ...], *, context: int = 192,
            repeat: int = 3, progress: bool = True) -> PassCosts:
    """Times `runtime` (an engine.runtime.TargetRuntime: what decode steps call) plus the sampler
    over every (rows, entries) of the grid, after a `context`-token prefix per row; the best of
    `repeat` calls each (a one-off stall is not the cost)."""
    from engine.kv_cache import KVCache
    from engine.model import causal_mask
    from engine.sampling import sample

    model = runtime.model
    cfg = model.config
    B, T = max(rows), max(entries)
    cache = KVCache.for_model(cfg, B, context + T + 1, model.dtype, model.device)
    g = torch.Generator().manual_seed(0)
    table = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        prefix = torch.randint(0, cfg.vocab_size, (B, context), generator=g).to(model.device)
        runtime(prefix, torch.arange(context, device=model.device).expand(B, context), cache=cache, logits=False)
        cache.lengths[:] = context
        for b in rows:
            line = []
            for t in entries:
                ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g).to(model.device)
                slots = context + torch.arange(t, device=model.device).expand(b, t)  # [b, t] positions and slots
                mask = causal_mask(slots, context + t)
                keys = torch.arange(b * t, device=model.device)

                def one_pass() -> float:
                    s = time.perf_counter()
                    out = runtime(ids, slots, cache=cache.rows(0, b), cache_pos=slots, attn_mask=mask)
                    sample(out.logits.float().view(b * t, -1), keys, slots.reshape(-1), params)
                    return time.perf_counter() - s

                one_pass()  # first-touch allocations: not counted
                line.append(min(one_pass() for _ in range(repeat)))
            table.append(tuple(line))
            if progress:
                print(f"\rengine.spec.pass_costs: measured {b} row(s) x {entries} entries ({time.perf_counter() - t0:.0f} s)",
                      end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return PassCosts(rows, entries, tuple(table))


def cache_dir() -> Path:
    return Path(os.environ.get("TAILSPEC_CACHE") or Path.home() / ".cache" / "tailspec") / "pass-costs"


def cache_key(runtime, rows, entries, temperature: float, context: int) -> str:
    """Hash of what the costs depend on: the CPU, the model's shape and dtype, the runtime's kernels,
    the thread count, the grid and whether the sampler draws noise."""
    from engine.kernels.tuning_cache import cpu_model

    c = runtime.model.config
    parts = [VERSION, cpu_model(), str(runtime.model.device), str(runtime.model.dtype), runtime.kernels, runtime.bf16_weights,
             runtime.bf16_products, c.hidden_size,
             c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.vocab_size,
             torch.get_num_threads(), list(rows), list(entries), temperature > 0, context, torch.__version__]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def cached(runtime, params, max_rows: int, max_entries: int, context: int) -> PassCosts:
    """The host's table for this runtime, grid and `context` (committed tokens per row while
    measuring): read from the cache, else measured (with a line of progress on stderr, some
    seconds for a small model) and written atomically."""
    rows, entries = grid(max_rows, max_entries)
    path = cache_dir() / f"{cache_key(runtime, rows, entries, params.temperature, context)}.json"
    if path.exists():
        try:
            return PassCosts.from_dict(json.loads(path.read_text())["costs"])
        except (ValueError, KeyError, TypeError) as e:
            print(f"engine.spec.pass_costs: {path} is unreadable ({e}); measuring again", file=sys.stderr)
    costs = measure(runtime, params, rows, entries, context=context)
    from engine.kernels.tuning_cache import cpu_model

    with atomic_file(path) as f:
        json.dump({"cpu": cpu_model(), "threads": torch.get_num_threads(), "costs": costs.as_dict()}, f)
    return costs
