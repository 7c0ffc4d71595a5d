"""The cluster section (`cluster:` in configs/*.yaml): where and how a Slurm job runs the RL run.

`python -m launch.slurm` renders it into an sbatch script (launch.slurm.sbatch). One Slurm task per
node runs torchrun, which starts `procs_per_node` ranks there; the ranks meet at a c10d
rendezvous on the allocation's first node. Nothing here is read by `python -m launch.train`
itself: a run on one machine ignores this section.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")  # Slurm's [days-]hours[:minutes[:seconds]]
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(kw_only=True)
class ClusterSection:
    nodes: int = 1
    gpus_per_node: int = 0  # 0: a CPU job (gloo); > 0: one rank per GPU (NCCL)
    procs_per_node: int = 0  # ranks per node; 0 = gpus_per_node, or 1 on CPU
    cpus_per_task: int = 0  # CPU cores for each node's task (all its ranks); 0 = Slurm's default
    mem: str | None = None  # per node, e.g. "800G"; None = Slurm's default; "0" = the whole node
    time: str = "24:00:00"  # the job's time limit
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = True  # whole nodes: the ranks' idle windows are only free if nobody else uses the GPUs
    # Requeue policy: a preempted or failed-node job goes back to the queue (Slurm's --requeue);
    # near the time limit the script requeues itself. Each restart resumes from the last checkpoint.
    requeue: bool = True
    max_restarts: int = 3  # requeues of one job before it is let fail
    signal_grace_s: int = 300  # seconds before the time limit at which the job requeues itself
    rdzv_port: int = 29500  # the c10d rendezvous (and the control-plane store) on the first node
    # How long the rendezvous waits for every node to join before it fails the job (torchrun's
    # join_timeout): a node that never starts ends the job with RendezvousTimeoutError, not a hang.
    rdzv_timeout_s: int = 600
    setup: list[str] = field(default_factory=list)  # shell lines run first on the batch node, e.g. "module load cuda/12.4"
    python: str = ".venv/bin/python"  # the interpreter on the compute nodes (relative to the repo)
    env: list[str] = field(default_factory=list)  # KEY=VALUE exported for every rank, e.g. "NCCL_IB_DISABLE=0"
    sbatch_args: list[str] = field(default_factory=list)  # extra #SBATCH options, e.g. "--reservation=rl"
    log_dir: str = "runs/slurm"  # the job's stdout (rank 0 of each node) and the rendered scripts
    min_free_disk_gb: float = 0.0  # preflight: the least free space at run.out_dir; 0 = estimate from the model
    # One GPU's memory in GiB as its vendor names it (80: an H100 / A100 80GB; 141: an H200): the memory
    # planner (launch.memory, also run by the preflight) checks every rank role against it.
    gpu_memory_gb: float = 80.0

    @property
    def ranks_per_node(self) -> int:
        return self.procs_per_node or self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def validate(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"cluster.nodes must be >= 1, got {self.nodes}")
        if self.rdzv_timeout_s < 1:
            raise ValueError(f"cluster.rdzv_timeout_s must be >= 1 second, got {self.rdzv_timeout_s}")
        for key in ("gpus_per_node", "procs_per_node", "cpus_per_task", "max_restarts", "signal_grace_s"):
            if getattr(self, key) < 0:
                raise ValueError(f"cluster.{key} must be >= 0, got {getattr(self, key)}")
        if self.gpus_per_node and self.procs_per_node > self.gpus_per_node:
            raise ValueError(f"cluster.procs_per_node={self.procs_per_node} is more ranks than GPUs "
                             f"(cluster.gpus_per_node={self.gpus_per_node}): each rank needs its own GPU")
        if not _TIME.match(self.time):
            raise ValueError(f"cluster.time must be Slurm's [days-]hours[:minutes[:seconds]], e.g. '24:00:00' or "
                             f"'2-00:00:00', got {self.time!r}")
        if not 1024 <= self.rdzv_port < 65536:
            raise ValueError(f"cluster.rdzv_port must be a port in [1024, 65535], got {self.rdzv_port}")
        bad = [e for e in self.env if not _ENV.match(e)]
        if bad:
            raise ValueError(f"cluster.env entries must be KEY=VALUE, got {bad[0]!r}")
        bad = [a for a in self.sbatch_args if not a.startswith("--")]
        if bad:
            raise ValueError(f"cluster.sbatch_args entries must be long sbatch options such as '--reservation=rl', "
                             f"got {bad[0]!r}")
        if not self.gpu_memory_gb > 0:
            raise ValueError(f"cluster.gpu_memory_gb must be > 0 (one GPU's memory in GiB, e.g. 80), got {self.gpu_memory_gb}")
        if self.min_free_disk_gb < 0:
            raise ValueError(f"cluster.min_free_disk_gb must be >= 0, got {self.min_free_disk_gb}")
