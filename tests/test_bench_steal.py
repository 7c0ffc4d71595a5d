"""bench.steal needs two or more ranks and says how to get them."""

from __future__ import annotations

from bench import steal


def test_one_process_is_refused_with_the_torchrun_command(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert steal.main(["--config", "configs/tiny.yaml", "--steps", "1"]) == 1
    assert "torchrun --nproc-per-node=2" in capsys.readouterr().err
