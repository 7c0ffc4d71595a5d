"""Cluster jobs on Slurm: the sbatch script, the checks before and inside a job, a local test cluster.

- `python -m launch.slurm` (submit.py): render, preflight, sbatch;
- `sbatch`: the job script, a pure function of the config; `config`: the `cluster:` section;
- `preflight` (`python -m launch.slurm.preflight`), `preflight_data` and `check`: what is missing
  before a job runs, on the login node and on every node of the job;
- `local`: a real Slurm on this machine (`make test-slurm`); `rehearse`
  (`python -m launch.slurm.rehearse`): a shipped cluster config as a two-node job here.
"""
