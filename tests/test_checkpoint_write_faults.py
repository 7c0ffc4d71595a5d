"""A checkpoint write that fails: the atomic writers leave the previous version and name the path
and the free space; a run whose checkpoint cannot be written stops with that error, its previous
checkpoint intact, and resuming from it gives the uninterrupted run. The disk fills for real on a
small tmpfs where this process may mount one (root), and by an injected ENOSPC everywhere."""

from __future__ import annotations

import errno
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from common.atomic import WriteError, atomic_file, atomic_folder, atomic_write
from launch.run.build import run
from pipeline.dist import Ranks
from pipeline.checkpoint.state import STATE, CheckpointWriteError, latest_checkpoint
from pipeline.trainer import Trainer
from tests.test_trainer import LEARNED, config, digits_task, step_rows, weights  # noqa: F401 (a fixture)

FREE = r"\d+(\.\d)? (B|KiB|MiB|GiB) free of \d+(\.\d)? \w+ on"


def full_disk(*_args, **_kw):
    raise OSError(errno.ENOSPC, "No space left on device")


def full_disk_in_rust(*_args, **_kw):  # what safetensors' save_file raised on the full tmpfs below
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("writer", ["file", "write", "folder", "rust"])
def test_an_atomic_write_that_runs_out_of_space_keeps_the_previous_version_and_names_path_and_free_space(
        tmp_path, writer):
    target = tmp_path / "out" / ("x" if writer not in ("folder", "rust") else "d")
    if writer in ("folder", "rust"):
        target.mkdir(parents=True)
        (target / "a").write_text("old")
    else:
        target.parent.mkdir()
        target.write_text("old")
    with pytest.raises(WriteError, match=rf"writing {target} failed: No space left on device \({FREE} "
                                         rf"{tmp_path / 'out'}\); free space there") as caught:
        if writer == "file":
            with atomic_file(target) as f:
                f.write("new")
                full_disk()
        elif writer == "write":
            atomic_write(target, lambda p: (p.write_text("new"), full_disk()))
        else:
            with atomic_folder(target) as tmp:
                (tmp / "a").write_text("new")
                (full_disk if writer == "folder" else full_disk_in_rust)()
    assert caught.value.errno == errno.ENOSPC
    assert (target / "a" if writer in ("folder", "rust") else target).read_text() == "old"
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no temporary left


def test_an_error_that_is_not_the_file_systems_passes_unchanged(tmp_path):
    with pytest.raises(FileNotFoundError, match="^missing input$"):
        with atomic_file(tmp_path / "x") as f:
            f.write("new")
            raise FileNotFoundError("missing input")


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs mounted at tmp_path/disk (root only), unmounted after."""
    disk = tmp_path / "disk"
    disk.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tailspec-test", str(disk)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip() or res.returncode}); the injected fault covers the run")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk: Path, leave: int) -> Path:
    """Writes disk/filler until `leave` bytes are free (the kernel's own ENOSPC follows)."""
    filler = disk / "filler"
    with filler.open("wb") as f:
        while (room := os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - leave) > 0:
            f.write(b"\0" * min(room, 1 << 20))
    return filler


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["injected", "tmpfs"])
def test_a_run_whose_checkpoint_cannot_be_written_stops_naming_it_and_resumes_from_the_previous_one_exactly(
        char_model_dir, digits_task, tmp_path, monkeypatch, request, fault):
    out = request.getfixturevalue("small_disk") if fault == "tmpfs" else tmp_path / "out"
    overrides = ["trainer.steps=4", "trainer.save_every=1", "engine.spec.enabled=false"]
    save = Trainer.save
    freed: list[Path] = []
    with monkeypatch.context() as patch:

        def save_into_a_full_disk(self):
            if self.step_index == 3:
                if fault == "tmpfs":
                    freed.append(fill(out, leave=32 << 10))
                else:
                    patch.setattr(torch, "save", full_disk)
            save(self)

        patch.setattr(Trainer, "save", save_into_a_full_disk)
        with pytest.raises(CheckpointWriteError) as caught:
            run(config(char_model_dir, out, *overrides), Ranks())
    run_dir = next(p for p in out.iterdir() if (p / "checkpoints").is_dir())
    ckpts = run_dir / "checkpoints"
    msg = str(caught.value)
    assert caught.value.errno == errno.ENOSPC
    assert f"checkpoint {ckpts / 'step-3'} could not be written, the run stops" in msg
    assert f"the previous checkpoint {ckpts / 'step-2'} is intact" in msg and "trainer.resume=auto" in msg
    assert "No space left on device" in msg and re.search(FREE, msg), msg
    assert latest_checkpoint(run_dir) == ckpts / "step-2"  # step-3 has no state.json: never resumed from
    assert not (ckpts / "step-3" / STATE).exists() and not list(ckpts.glob("*/*.tmp"))

    for filler in freed:
        filler.unlink()
    run(config(char_model_dir, out, *overrides, f"run.dir={run_dir}", "trainer.resume=auto"), Ranks())
    whole = run(config(char_model_dir, tmp_path / "whole", *overrides), Ranks())
    rows, rows_whole = step_rows(run_dir), step_rows(whole["run_dir"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for a, b in zip(rows_whole, rows):
        assert {k: a[k] for k in LEARNED} == {k: b[k] for k in LEARNED}
    w, w_whole = weights(run_dir, 4), weights(whole["run_dir"], 4)
    assert all(torch.equal(w[k], w_whole[k]) for k in w_whole)
