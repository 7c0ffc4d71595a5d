"""The rehearsal overlays (configs/rehearse/*.yaml) change only sizes, devices and where files are:
the resolved rehearsal config minus the overlay's keys is the shipped config, and the script it
renders is the shipped one's code path (two nodes, the rendezvous with its join timeout)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from common.config import load_config, to_dict
from launch.slurm.rehearse import CONFIGS, OVERLAY_KEYS, job_overrides
from launch.run.config import TrainConfig
from launch.slurm.submit import render

REPO = Path(__file__).resolve().parent.parent


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, dotted + "."))
        else:
            out[dotted] = value
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_resolved_rehearsal_config_minus_the_overlays_keys_is_the_shipped_config(name):
    overlay = yaml.safe_load(CONFIGS[name].read_text())
    assert overlay.pop("base") == f"../{name}.yaml"
    keys = set(flat(overlay))
    assert keys <= OVERLAY_KEYS, f"the overlay changes more than sizes and devices: {sorted(keys - OVERLAY_KEYS)}"
    shipped = flat(to_dict(load_config(TrainConfig, REPO / f"configs/{name}.yaml", [])))
    rehearsal = flat(to_dict(load_config(TrainConfig, CONFIGS[name], [])))
    assert shipped.keys() == rehearsal.keys()
    differ = {k for k in shipped if shipped[k] != rehearsal[k]}
    assert differ <= keys, f"keys that differ but are not in the overlay: {sorted(differ - keys)}"
    for key in keys:  # and the overlay's value is what the rehearsal runs with
        assert rehearsal[key] == flat(overlay)[key], key


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_rehearsal_keeps_the_shipped_runs_parts(name):
    shipped = load_config(TrainConfig, REPO / f"configs/{name}.yaml", [])
    cfg = load_config(TrainConfig, CONFIGS[name], job_overrides(REPO / "runs/rehearse"))
    for part in (lambda c: (c.actor.backend, c.actor.zero_stage, c.actor.gradient_checkpointing),
                 lambda c: (c.pipeline.placement, c.algorithm.name, c.algorithm.dynamic_sampling),
                 lambda c: (c.spot.enabled, c.spot.mode, c.bubble.enabled),
                 lambda c: (c.engine.spec.enabled, c.engine.spec.drafter, c.engine.spec.tuner_arms),
                 lambda c: (c.metrics.wandb, c.trainer.old_logprobs, c.cluster.requeue)):
        assert part(cfg) == part(shipped)
    assert (cfg.cluster.nodes, cfg.cluster.world_size) == (2, 2)  # two nodes, one CPU rank each
    assert (cfg.actor.device, cfg.engine.device, cfg.model.path) == ("cpu", "cpu", "checkpoints/smollm2-135m-instruct")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_rehearsals_script_is_the_shipped_scripts_code_path_on_two_nodes(name):
    cfg = load_config(TrainConfig, CONFIGS[name], [])
    script = render(cfg, str(CONFIGS[name]), [])
    shipped = render(load_config(TrainConfig, REPO / f"configs/{name}.yaml", []), f"configs/{name}.yaml", [])
    assert "#SBATCH --nodes=2" in script and "--gpus-per-node" not in script
    for line in ("-m launch.slurm.preflight --in-job --rdzv-port \"$PORT\"", "--rdzv-backend=c10d --rdzv-endpoint=\"$HEAD_ADDR:$PORT\"",
                 f"--rdzv-conf=join_timeout={cfg.cluster.rdzv_timeout_s}", "trainer.resume=auto"):
        assert line in script and line in shipped
    reclaim = "-m spot.buffer.segment --reclaim"
    assert (reclaim in script) == (reclaim in shipped) == cfg.spot.enabled
