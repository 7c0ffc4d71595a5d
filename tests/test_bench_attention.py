"""bench.attention on a tiny model: every table's ways run and the JSON holds each shape's ratios."""

from __future__ import annotations

import json

from bench import attention
from bench.attention import SHAPES
from engine.kernels.causal_attention import bf16_native
from pipeline.actors.precision import cpu_has_bf16


def test_every_shape_is_timed_both_ways_and_bf16_where_the_cpu_has_it(char_model_dir, capsys):
    rc = attention.main(["--model", str(char_model_dir), "--repeat", "1", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    keys = {f"{what} {r}x{t}" for what in ("attention", "model") for r, t in SHAPES}
    assert set(out["ratio"]) == keys and all(v > 0 for v in out["ratio"].values())
    if bf16_native() and cpu_has_bf16():
        assert set(out["bf16"]) == {f"attention {r}x{t}" for r, t in SHAPES} | {f"bf16-mixed model {r}x{t}" for r, t in SHAPES}
        assert all(v > 0 for v in out["bf16"].values())
    else:
        assert out["bf16"] == {}
