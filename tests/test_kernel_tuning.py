"""The kernels' per-host tuning: a deterministic choice from measurements, the guard, the cache
and its keys, the fallback, and that every candidate keeps the bit-for-bit row independence."""

from __future__ import annotations

import itertools
import json
import warnings

import pytest
import torch

from engine.kernels import params as kparams
from engine.kernels import tune, tuning_cache
from engine.kernels.library import available, library, tuning
from engine.kernels.params import CHUNK_ALL, KernelParams
from engine.kernels.skinny import SkinnyMatrix

OK, WHY = available()
needs_kernels = pytest.mark.skipif(not OK, reason=f"CPU kernels unavailable or not serving here: {WHY}")


def P(nv, r, pf=32, mc=CHUNK_ALL, rw=0):
    return KernelParams(panel_vectors=nv, block_rows=r, prefetch=pf, chunk_rows=mc, wide_block_rows=rw)


def test_choose_takes_the_least_total_log_slowdown_not_the_least_total_time():
    # b loses 2x at 1 row (2 ms) but wins 1.5x at 64 rows (100 ms): by total time a would win (102 < 153)
    costs = {P(1, 4): {1: 1.0, 64: 150.0}, P(2, 6): {1: 2.0, 64: 100.0}}
    assert tune.choose(costs) == P(1, 4)  # log 1 + log 1.5 < log 2 + log 1
    costs[P(2, 6)] = {1: 1.2, 64: 100.0}
    assert tune.choose(costs) == P(2, 6)


def test_choose_breaks_ties_by_candidate_order_whatever_the_dict_order():
    a, b = {1: 1.0, 4: 2.0}, {1: 1.0, 4: 2.0}
    assert tune.choose({P(2, 6): a, P(1, 8): b}) == tune.choose({P(1, 8): b, P(2, 6): a}) == P(1, 8)


def test_choose_ignores_candidates_missing_a_row_count_and_refuses_an_empty_table():
    assert tune.choose({P(1, 4): {1: 0.1}, P(2, 6): {1: 1.0, 4: 1.0}}) == P(2, 6)
    with pytest.raises(ValueError, match="every row count"):
        tune.choose({P(1, 4): {1: 0.1}, P(2, 6): {4: 1.0}})


def synthetic(p: KernelParams, m: int) -> float:
    """A cost model with one best point: nv=2, r=4 for narrow passes and 6 for wide ones (>= 128
    rows), prefetch 64, chunks of about 128 rows."""
    wide = m >= 128
    r = (p.wide_block_rows or p.block_rows) if wide else p.block_rows
    tile = abs(p.panel_vectors - 2) + abs(r - (6 if wide else 4)) / 4
    return (1 + tile) * m + abs(p.prefetch - 64) / 64 + (0 if 100 <= p.chunk_rows <= 130 else 0.5) * m / 256


def test_search_is_deterministic_and_finds_the_synthetic_optimum_with_its_own_wide_block():
    tiles = tune.tiles(8, lambda nv: (15 - nv) // nv)
    runs = [tune.search(synthetic, P(2, 6), tiles) for _ in range(2)]
    assert runs[0] == runs[1]
    chosen, log = runs[0]
    assert chosen == P(2, 4, 64, 126, rw=6)  # 126: whole wide blocks of 6 rows
    assert set(log) == {"tile", "prefetch", "wide"}


def test_wide_candidates_share_the_panel_width_and_name_the_narrow_block_zero():
    tiles = tune.tiles(8, lambda nv: (15 - nv) // nv)
    cands = tune.wide_candidates(P(2, 4, 64), tiles)
    assert {c.panel_vectors for c in cands} == {2} and len(set(cands)) == len(cands)
    assert {c.wide_block_rows for c in cands} == {0, 2, 6}  # 4, the narrow block, is 0
    assert all(c.chunk_rows == CHUNK_ALL or c.chunk_rows % (c.wide_block_rows or 4) == 0 for c in cands)


def test_params_from_an_older_record_take_the_defaults_and_unknown_keys_are_refused():
    old = {"panel_vectors": 3, "block_rows": 8, "prefetch": 16, "chunk_rows": 512}
    assert kparams.from_dict(old) == P(3, 8, 16, 512, rw=0)
    assert kparams.from_dict(P(2, 4, rw=6).as_dict()) == P(2, 4, rw=6)
    with pytest.raises(ValueError, match="unknown skinny kernel parameters"):
        kparams.from_dict({**old, "blok_rows": 4})


def test_search_out_of_time_keeps_the_starting_point_measured():
    chosen, log = tune.search(synthetic, P(2, 6), tune.tiles(8, lambda nv: (15 - nv) // nv), out_of_time=lambda: True)
    assert chosen == P(2, 6)  # only the start was measured in each stage
    assert all(len(stage) == 1 for stage in log.values())


def test_tiles_fit_the_register_file():
    for vw, nreg in ((8, 16), (16, 32)):
        for t in tune.tiles(vw, lambda nv: min(12, (nreg - 1 - nv) // nv)):
            assert t.block_rows * t.panel_vectors + t.panel_vectors + 1 <= nreg


def test_guard_serves_on_the_geometric_mean_and_names_the_rows_it_lost():
    assert tune.guard({1: 0.95, 16: 1.5, 1024: 1.1}) == (True, [1])
    assert tune.guard({1: 0.5, 16: 1.2, 1024: 1.2}) == (False, [1])
    with pytest.raises(ValueError):
        tune.guard({})


def test_cache_key_changes_with_the_build_the_flags_the_threads_and_the_host(monkeypatch):
    k = tuning_cache.key("abc", ["-O3"], 2)
    assert k == tuning_cache.key("abc", ["-O3"], 2)
    assert len({k, tuning_cache.key("abd", ["-O3"], 2), tuning_cache.key("abc", ["-O2"], 2),
                tuning_cache.key("abc", ["-O3"], 1)}) == 4
    monkeypatch.setattr(tuning_cache, "cpu_model", lambda: "Some Other CPU")
    assert tuning_cache.key("abc", ["-O3"], 2) != k


class FakeLib:
    """The ctypes surface settle() uses, without a build."""

    def __init__(self):
        self.applied = None

    def skinny_vector_width(self):
        return 8

    def skinny_max_rows(self, nv):
        return (15 - nv) // nv

    def skinny_set_params(self, nv, r, pf, mc, rw):
        self.applied = (nv, r, pf, mc, rw)
        return 0


def test_a_failed_tuning_falls_back_to_the_defaults_with_one_warning_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("TAILSPEC_CPU_TUNE", raising=False)

    def broken(*a, **kw):
        raise RuntimeError("timer exploded")

    monkeypatch.setattr(tune, "Timer", broken)
    lib = FakeLib()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = tuning_cache.settle(lib, tmp_path, "digest", ["-O3"])
    assert [str(w.message) for w in caught if "TailSpec" in str(w.message)] == [
        "TailSpec CPU kernels: tuning failed, using the default parameters: RuntimeError('timer exploded')"], caught
    assert t.chosen == KernelParams(block_rows=6) and lib.applied == (2, 6, 32, CHUNK_ALL, 0)
    assert t.serves and t.source.startswith("defaults (tuning failed")
    assert not list(tmp_path.glob("tuning-*.json"))


def fake_measurements(monkeypatch, results) -> list:
    """Replaces the tuner's measurement: each call takes the next (params, {rows: torch / kernel}) of
    `results`, writes it as the cache file would be and returns it; the list returned records the calls."""
    calls = []

    def fake_measure(lib, base, path):
        params, ratios = next(results)
        calls.append(params)
        guard = {m: {"kernel_ms": 1.0, "torch_ms": r, "ratio": r} for m, r in ratios.items()}
        t = tuning_cache.Tuning(**base, params=params.as_dict(), source="measured", guard=guard,
                                slower_rows=sorted(int(m) for m, r in ratios.items() if r < 1))
        path.write_text(json.dumps(t.__dict__))
        return t

    monkeypatch.setattr(tuning_cache, "_measure", fake_measure)
    return calls


def test_a_cached_choice_is_read_back_and_a_changed_key_measures_again(tmp_path, monkeypatch):
    monkeypatch.delenv("TAILSPEC_CPU_TUNE", raising=False)
    calls = fake_measurements(monkeypatch, itertools.repeat((P(1, 8, 16, 64), {})))
    lib = FakeLib()
    first = tuning_cache.settle(lib, tmp_path, "digest-a", ["-O3"])
    again = tuning_cache.settle(lib, tmp_path, "digest-a", ["-O3"])
    assert len(calls) == 1 and again.source == "cached" and again.chosen == first.chosen == P(1, 8, 16, 64)
    assert lib.applied == (1, 8, 16, 64, 0)
    tuning_cache.settle(lib, tmp_path, "digest-b", ["-O3"])  # new kernel sources
    assert len(calls) == 2
    monkeypatch.setenv("TAILSPEC_CPU_TUNE", "force")
    tuning_cache.settle(lib, tmp_path, "digest-a", ["-O3"])
    assert len(calls) == 3


def test_a_cached_choice_that_lost_somewhere_is_measured_again_and_the_better_one_kept(tmp_path, monkeypatch):
    monkeypatch.delenv("TAILSPEC_CPU_TUNE", raising=False)
    calls = fake_measurements(monkeypatch, iter([
        (P(1, 8, 16, 64), {"1": 1.5, "256": 0.8}),  # measured under load: lost at 256 rows
        (P(2, 6, 32, 64), {"1": 1.2, "256": 0.9}),  # worse overall: the first is kept
        (P(2, 6, 0, 64), {"1": 1.6, "256": 1.1})]))  # better, and wins everywhere
    lib = FakeLib()
    first = tuning_cache.settle(lib, tmp_path, "digest", ["-O3"])
    second = tuning_cache.settle(lib, tmp_path, "digest", ["-O3"])
    assert first.chosen == second.chosen == P(1, 8, 16, 64) and second.measures == 2 and second.source == "cached"
    third = tuning_cache.settle(lib, tmp_path, "digest", ["-O3"])
    assert third.chosen == P(2, 6, 0, 64) and third.measures == 3 and not third.slower_rows
    assert tuning_cache.settle(lib, tmp_path, "digest", ["-O3"]).chosen == P(2, 6, 0, 64)  # settled: read back
    assert len(calls) == 3 and lib.applied == (2, 6, 0, 64, 0)


def test_a_choice_that_still_loses_after_the_last_measure_is_kept_without_measuring_more(tmp_path, monkeypatch):
    monkeypatch.delenv("TAILSPEC_CPU_TUNE", raising=False)
    calls = fake_measurements(monkeypatch, itertools.repeat((P(1, 8, 16, 64), {"1": 0.9})))
    for _ in range(tuning_cache.MEASURES + 2):
        t = tuning_cache.settle(FakeLib(), tmp_path, "digest", ["-O3"])
    assert len(calls) == tuning_cache.MEASURES and t.measures == tuning_cache.MEASURES and t.slower_rows == [1]


@needs_kernels
def test_every_tuning_candidate_keeps_rows_bit_for_bit_independent_and_equal_across_candidates():
    lib = library()
    chosen = tuning().chosen
    torch.manual_seed(0)
    K, N = 96, 200
    wide = int(lib.skinny_wide_rows())
    w, bias, x = torch.randn(K, N), torch.randn(N), torch.randn(wide + 33, K)  # a wide pass, its rows alone and 40 at once
    cands = tune.tiles(lib.skinny_vector_width(), lib.skinny_max_rows)
    cands += [P(2, 4, pf, mc, rw) for pf in (0, 128) for mc in (4, 12, CHUNK_ALL) for rw in (0, 3, 6)]
    reference = None
    try:
        for p in cands:
            kparams.apply(lib, p)
            sm = SkinnyMatrix(w)
            full = sm.matmul(x, bias=bias)
            assert torch.equal(sm.matmul(x[:40], bias=bias), full[:40]), p.label()  # narrow pass = wide pass
            for i in (0, 7, 39, wide + 32):
                assert torch.equal(sm.matmul(x[i : i + 1], bias=bias), full[i : i + 1]), p.label()
            if reference is None:
                reference = full
            assert torch.equal(full, reference), p.label()  # one accumulator per element, k in order
            torch.testing.assert_close(full, x @ w + bias, rtol=1e-5, atol=1e-4)
    finally:
        kparams.apply(lib, chosen)
    assert lib.skinny_tile_n() == chosen.panel_vectors * lib.skinny_vector_width()
