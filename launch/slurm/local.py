"""A real Slurm cluster on this machine: one node, or several on one host, for `make test-slurm`
and the cluster rehearsals (launch.slurm.rehearse).

    with LocalSlurm(tmp_dir, nodes=2) as slurm:   # installs slurm-wlm + munge if missing (root, apt)
        subprocess.run(["sbatch", ...], env=slurm.env)

It starts `munged`, `slurmctld` and one `slurmd` per node in the foreground as child processes (so
their pids are ours to stop), from a generated `slurm.conf` whose state, spool, pid and log files
all lie under `root`, on free loopback ports, with every node in one partition. One node is this
host by its own name; several are `<host>-n1`, `<host>-n2`, ... (`slurmd -N`), each a slurmd of its
own at 127.0.0.1 on a port of its own: jobs span them as they would span machines (srun starts one
task per node, `SLURMD_NODENAME` and `SLURM_NODEID` tell them apart), though they share the host's
cores, memory and /dev/shm. Their names do not resolve: a job reaches a node by its NodeAddr
(launch.slurm.sbatch asks `scontrol show node`). A requeued job waits cred_expire seconds before it is
eligible again (Slurm's default 120; 10 here). On exit it cancels every job, stops the daemons by
pid and removes `root`. Nothing is written outside `root` except what apt installs.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "mungekey")
PACKAGES = ("slurm-wlm", "munge")
# The states of a job that has not ended yet (None: scontrol does not know it yet).
NOT_ENDED = (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED")


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed and cannot be (not root, or apt failed): the message says which."""


def install(timeout_s: float = 600) -> None:
    """apt-get install slurm-wlm and munge if any of their programs is missing (needs root)."""
    if all(shutil.which(d) or Path(f"/usr/sbin/{d}").exists() for d in DAEMONS):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable(f"Slurm is not installed and this is not a root Debian machine: install {' '.join(PACKAGES)} "
                               "(apt-get install -y slurm-wlm munge)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    for attempt in range(2):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode == 0:
            return
        if attempt == 0:  # a fresh machine may have no package lists yet
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=timeout_s)
    raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {proc.stderr.strip()[-800:]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_conf(root: Path, host: str, cpus: int, ctld_port: int, nodes: dict[str, int]) -> str:
    """The cluster's slurm.conf: `nodes` maps each node name to its slurmd's port."""
    node_lines = "\n".join(f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} "
                           "State=UNKNOWN" for name, port in nodes.items())
    return f"""\
ClusterName=tailspec-local
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket,cred_expire=10
CredType=cred/munge
SlurmctldPort={ctld_port}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=3600
KillWait=5
{node_lines}
PartitionName=local Nodes={",".join(nodes)} Default=YES MaxTime=INFINITE State=UP
"""


class LocalSlurm:
    """`cpus`: the CPUs each node declares (default: the host's); `nodes`: slurmd daemons on this host."""

    def __init__(self, root: str | Path, *, cpus: int | None = None, nodes: int = 1, start_timeout_s: float = 60) -> None:
        if nodes < 1:
            raise ValueError(f"a local cluster needs at least one node, got nodes={nodes}")
        self.root = Path(root).resolve()
        self.host = socket.gethostname().split(".")[0]
        self.cpus = cpus or os.cpu_count() or 1
        self.nodes = [self.host] if nodes == 1 else [f"{self.host}-n{i}" for i in range(1, nodes + 1)]
        self.start_timeout_s = start_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment in which sbatch / squeue / scontrol talk to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def __enter__(self) -> LocalSlurm:
        install()
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "w")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        log.close()

    def _start(self) -> None:
        key = self.root / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}", "--bits=1024"], check=True, capture_output=True)
        key.chmod(0o600)
        r = self.root
        self._spawn("munged", ["munged", "--foreground", "--force", f"--socket={r}/munge.socket", f"--key-file={key}",
                               f"--pid-file={r}/munged.pid", f"--log-file={r}/log/munged.log", f"--seed-file={r}/munged.seed"])
        self._wait(lambda: (r / "munge.socket").exists(), "munged's socket")
        self.conf.write_text(slurm_conf(r, self.host, self.cpus, free_port(), {n: free_port() for n in self.nodes}))
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._wait(lambda: self._run(["scontrol", "ping"]).returncode == 0, "slurmctld to answer `scontrol ping`")
        for node in self.nodes:
            (r / "spool" / node).mkdir(parents=True, exist_ok=True)
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait(self._nodes_idle, f"node(s) {', '.join(self.nodes)} to be idle")

    def _run(self, cmd: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30)

    def _nodes_idle(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n, "").startswith("idle") for n in self.nodes)

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0]} exited with status {self.procs[dead[0]].returncode} while waiting for "
                                   f"{what}: {self.log_tail(dead[0])}")
            if ready():
                return
            time.sleep(0.3)
        raise RuntimeError(f"timed out after {self.start_timeout_s:.0f} s waiting for {what}: "
                           + " | ".join(self.log_tail(n) for n in self.procs))

    def log_tail(self, name: str, chars: int = 600) -> str:
        parts = [p.read_text(errors="replace")[-chars:] for p in (self.root / "log").glob(f"{name}*") if p.is_file()]
        return " ".join(parts).strip() or "(no log)"

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = self._run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait_job(self, job_id: str, timeout_s: float) -> dict[str, str]:
        """Polls until the job has ended (COMPLETED, FAILED, CANCELLED, TIMEOUT, ...)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") not in NOT_ENDED:
                return info
            time.sleep(1)
        self._run(["scancel", job_id])
        raise TimeoutError(f"job {job_id} did not end within {timeout_s:.0f} s (cancelled): {self.job(job_id)}")

    def close(self) -> None:
        """Cancels the jobs, stops the daemons by pid (the slurmds first) and removes the folder."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self._run(["scancel", "--full", "--user=root"])
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self._run(["squeue", "-h"]).stdout.strip():
                time.sleep(0.5)
        for name in (*(f"slurmd-{n}" for n in self.nodes), "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        shutil.rmtree(self.root, ignore_errors=True)
