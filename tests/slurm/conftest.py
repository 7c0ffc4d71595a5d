"""The rehearsals' shared parts (test_rehearse.py, test_rehearse_pool.py): their data and drafter, made
once, and a two-node Slurm cluster on this machine, stopped after the last of this folder's tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from launch.slurm.local import LocalSlurm, SlurmUnavailable
from launch.slurm.rehearse import prepare_inputs


@pytest.fixture(scope="package")
def inputs(tmp_path_factory, smollm2_dir) -> Path:
    """The rehearsal's data and drafter; the overlays' model, checkpoints/smollm2-135m-instruct, provisioned."""
    assert smollm2_dir.resolve() == (Path(__file__).resolve().parents[2] / "checkpoints/smollm2-135m-instruct").resolve()
    root = tmp_path_factory.mktemp("rehearse")
    prepare_inputs(root)
    return root


@pytest.fixture(scope="package")
def cluster(inputs):
    try:
        slurm = LocalSlurm(inputs / "cluster", nodes=2)
        slurm.__enter__()
    except SlurmUnavailable as e:
        pytest.skip(str(e))
    yield slurm
    slurm.close()
    leftover = subprocess.run(["pgrep", "-f", str(inputs / "cluster")], capture_output=True, text=True).stdout
    assert not leftover.strip(), f"daemons left running: {leftover}"
