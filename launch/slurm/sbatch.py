"""The sbatch script of an RL run on Slurm: a pure function of the config (`render_sbatch`).

The job, as rendered:

    #SBATCH --nodes=N --ntasks-per-node=1 [--gpus-per-node=G] ...   one Slurm task per node
    preflight: srun ... python -m launch.slurm.preflight --in-job          CUDA / NCCL on every node, the
                                                                     rendezvous port free on the first
    srun --kill-on-bad-exit=1 python -m torch.distributed.run        one torchrun agent per node,
        --nnodes=N --nproc-per-node=P                                P ranks each,
        --rdzv-backend=c10d --rdzv-endpoint=HEAD_ADDR:PORT           meeting on the first node
        --rdzv-conf=join_timeout=T                                   a node missing after T s fails the job
        -m launch.train --config C run.dir=RUN_DIR trainer.resume=auto [overrides]
    srun python -m spot.buffer.segment --reclaim                            with spot training: a killed rank's
                                                                     DataBuffer segment is removed

Placement (`pipeline.placement`): colocated, every rank rolls out and trains; separated, ranks
0..K-1 train (`pipeline.actor_ranks: K`) and the others roll out, in the same single torchrun.
torchrun numbers the nodes in the sorted order of their host names and gives each node
`procs_per_node` consecutive ranks, so with K a multiple of it whole nodes take one role; the
script names the split (a job with no rollout rank is refused at rendering).

A separated placement with `spot.mode: pool` also starts the elastic spot pool (launch.spot_pool,
docs/SPOT_POOL.md) as a second job step beside the run: one torchrun agent on each node that has
rollout ranks (`srun --overlap`: it shares the node with the run's step, its one member on the
node's first GPU), attaching to the node's DataBuffer (`spot.buffer_name`, `tailspec-<job id>`
unless set) once the run has made it. The agents meet in a rendezvous of their own whose store the
script itself holds on the batch host (launch.pool_job store), so no agent's death takes it down,
and each node's agent runs under launch.pool_job agent, which starts it again when a signal kills
it: the pool shrinks and grows back. When the run's step ends, the script writes
`<spot.pool_dir>/STOP`, waits for the pool and stops the store; a requeued job removes STOP first,
so its pool resumes from its checkpoints.

The ranks' process group is the control plane (pipeline.dist, common.idle.states): its store is the
rendezvous's, at HEAD_ADDR:PORT, the first node's address as Slurm reaches it (`scontrol show node`'s
NodeAddr: its host name on most clusters, where a node's name may not resolve). RUN_DIR is `run.out_dir/<run.name>-<job id>`, stable across requeues,
so a requeued job resumes the latest checkpoint there (`trainer.resume=auto`). Requeue policy:
`--requeue` lets Slurm requeue a preempted job or one whose node failed; `--signal=B:USR1@S`
wakes the script S seconds before the time limit and it requeues itself; after
`cluster.max_restarts` restarts the job is let fail. Only local rank 0 of each node prints to the
job's output (labelled by node); every rank's full log is in RUN_DIR (rank{r}.log, torchrun/).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from launch.run.config import TrainConfig

ARGS_SEPARATOR = "# --- the run ---"


def directives(cfg: TrainConfig, job_name: str, log_dir: Path) -> list[str]:
    """The #SBATCH options, in the order sbatch documents them."""
    c = cfg.cluster
    opts = [f"--job-name={job_name}", f"--nodes={c.nodes}", "--ntasks-per-node=1"]
    if c.gpus_per_node:
        opts.append(f"--gpus-per-node={c.gpus_per_node}")
    if c.cpus_per_task:
        opts.append(f"--cpus-per-task={c.cpus_per_task}")
    if c.mem is not None:
        opts.append(f"--mem={c.mem}")
    opts.append(f"--time={c.time}")
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(c, key):
            opts.append(f"--{key}={getattr(c, key)}")
    if c.exclusive:
        opts.append("--exclusive")
    opts += [f"--output={log_dir}/%x-%j.out", "--open-mode=append"]
    if c.requeue:
        opts += ["--requeue", f"--signal=B:USR1@{c.signal_grace_s}"]
    else:
        opts.append("--no-requeue")
    return opts + list(c.sbatch_args)


def placement_lines(cfg: TrainConfig) -> list[str]:
    """Comment lines naming which ranks (and nodes) train and which roll out."""
    c, p = cfg.cluster, cfg.pipeline
    world, per_node = c.world_size, c.ranks_per_node
    actors, rollout = p.roles(world)
    if not p.separated:
        return [f"# placement: colocated: all {world} ranks roll out, then train"]
    lines = [f"# placement: separated: ranks 0-{actors - 1} train (pipeline.actor_ranks={actors}), ranks "
             f"{actors}-{world - 1} roll out ({rollout} ranks)",
             f"# torchrun orders the {c.nodes} node(s) by host name, {per_node} ranks each:"]
    for node in range(c.nodes):
        first, last = node * per_node, (node + 1) * per_node - 1
        if last < actors or first >= actors:
            role = f"ranks {first}-{last} " + ("train" if last < actors else "roll out")
        else:
            role = f"ranks {first}-{actors - 1} train, ranks {actors}-{last} roll out"
        lines.append(f"#   node {node}: {role}")
    return lines


def pool_agents(cfg: TrainConfig) -> bool:
    """The job starts an elastic spot pool beside the run (a separated run with spot.mode=pool)."""
    return cfg.pipeline.separated and cfg.spot.enabled and cfg.spot.mode == "pool"


def pool_start_lines(cfg: TrainConfig) -> list[str]:
    """Variables of the spot pool's step, set before the run starts (the run names its buffer after them)."""
    c = cfg.cluster
    actors, _ = cfg.pipeline.roles(c.world_size)
    first = actors // c.ranks_per_node  # the first node with a rollout rank
    buffer = shlex.quote(cfg.spot.buffer_name) if cfg.spot.buffer_name else 'tailspec-"$SLURM_JOB_ID"'
    return [f"# spot.mode=pool: one elastic spot-pool agent on each node with rollout ranks (nodes {first}-{c.nodes - 1})",
            f"POOL_DIR={shlex.quote(cfg.spot.pool_dir)}",
            f"POOL_BUFFER={buffer}",
            f'POOL_NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tail -n +{first + 1} | paste -sd, -)',
            'POOL_ADDR=$(node_addr "$SLURMD_NODENAME")  # the pool\'s rendezvous store runs in this script',
            'rm -f "$POOL_DIR/STOP"  # a requeued job: the pool resumes from its checkpoints',
            'mkdir -p "$RUN_DIR"']


def pool_step_lines(cfg: TrainConfig) -> list[str]:
    """The spot pool's rendezvous store (`POOL_STORE`) and job step (`POOL`), both in the background:
    one agent per rollout node, started again by launch.pool_job when a signal kills it."""
    c, s = cfg.cluster, cfg.spot
    actors, _ = cfg.pipeline.roles(c.world_size)
    nodes = c.nodes - actors // c.ranks_per_node
    q = shlex.quote
    pool_args = ["--target", cfg.model.path, "--drafter", str(cfg.engine.spec.drafter_path),
                 "--device", "cuda" if c.gpus_per_node else "cpu", "--buffer-wait-s", str(cfg.pipeline.timeout_s),
                 "--rows-per-step", str(s.rows_per_step), "--window", str(s.window),
                 "--offset-ratio", str(s.offset_ratio),
                 "--lr", str(s.lr), "--warmup-steps", str(s.warmup_steps), "--weight-decay", str(s.weight_decay),
                 "--grad-clip", str(s.grad_clip), "--ce-weight", str(s.ce_weight), "--seed", str(cfg.run.seed)]
    return [
        '"$PY" -m launch.pool_job store --port $(( PORT + 1 )) &',
        "POOL_STORE=$!",
        f'srun --overlap --nodes={nodes} --ntasks-per-node=1 --nodelist="$POOL_NODES" \\',
        '    --output="$RUN_DIR/spot-pool-%N.log" \\',
        '    "$PY" -m launch.pool_job agent --stop "$POOL_DIR/STOP" -- \\',
        '    env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "$PY" -m torch.distributed.run --nproc-per-node=1 \\',
        f'    --nnodes=1:{nodes} --rdzv-backend=c10d --rdzv-endpoint="$POOL_ADDR:$(( PORT + 1 ))" \\',
        '    --rdzv-id="$SLURM_JOB_ID-pool" --rdzv-conf=is_host=false \\',
        "    --max-restarts=100 --monitor-interval=5 \\",
        f'    -m launch.spot_pool {" ".join(q(a) for a in pool_args)} --buffer "$POOL_BUFFER" --out "$POOL_DIR" &',
        "POOL=$!",
    ]


def render_sbatch(cfg: TrainConfig, config_path: str, overrides: list[str], repo: Path, *, job_name: str) -> str:
    """The batch script for `python -m launch.train --config config_path overrides` under cfg.cluster.

    `repo`: the checkout's absolute path on the shared file system (the job runs there); relative
    paths in the config (run.out_dir, cluster.log_dir, cluster.python) are relative to it.
    """
    c = cfg.cluster
    repo = Path(repo).resolve()
    log_dir = (repo / c.log_dir).resolve()
    q = shlex.quote
    run_dir = q(cfg.run.dir) if cfg.run.dir else f'{q(cfg.run.out_dir)}/{q(cfg.run.name)}-"$SLURM_JOB_ID"'
    train_args = " ".join(q(a) for a in ["--config", config_path, *overrides])
    exports = ["HF_HUB_OFFLINE=1", "TOKENIZERS_PARALLELISM=false", *c.env]
    if not c.gpus_per_node and c.cpus_per_task:
        exports.append(f"OMP_NUM_THREADS={max(1, c.cpus_per_task // c.ranks_per_node)}")
    lines = ["#!/bin/bash",
             f"# Rendered by `python -m launch.slurm --config {config_path}`; re-render rather than edit.",
             *(f"#SBATCH {d}" for d in directives(cfg, job_name, log_dir)),
             "set -euo pipefail",
             f"cd {q(str(repo))}",
             *c.setup,
             *(f"export {k}={q(v)}" for k, _, v in (e.partition("=") for e in exports)),
             f"PY={q(c.python)}",
             f"RUN_DIR={run_dir}",
             'RESTARTS="${SLURM_RESTART_COUNT:-0}"',
             f"if [ \"$RESTARTS\" -gt {c.max_restarts} ]; then",
             f'  echo "job $SLURM_JOB_ID was restarted $RESTARTS times (cluster.max_restarts={c.max_restarts}): giving up"'
             "; exit 1",
             "fi",
             "node_addr() {  # the address Slurm reaches a node at (NodeAddr; its host name unless set)",
             '  scontrol show node "$1" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\'',
             "}",
             'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             'HEAD_ADDR=$(node_addr "$HEAD_NODE")',
             f"PORT=$(( {c.rdzv_port} + SLURM_JOB_ID % 1000 ))  # two jobs sharing a node do not collide",
             *placement_lines(cfg),
             *(pool_start_lines(cfg) if pool_agents(cfg) else []),
             'echo "job $SLURM_JOB_ID restart $RESTARTS on $SLURM_JOB_NODELIST: run folder $RUN_DIR; '
             'rendezvous and control-plane store at $HEAD_NODE ($HEAD_ADDR:$PORT)"',
             ]
    if c.requeue:
        lines += [
            "requeue() {",
            f"  if [ \"$RESTARTS\" -lt {c.max_restarts} ]; then",
            '    echo "time limit near: requeueing job $SLURM_JOB_ID; it resumes from the latest checkpoint in $RUN_DIR"',
            '    scontrol requeue "$SLURM_JOB_ID"',
            "  else",
            f'    echo "time limit near and {c.max_restarts} restarts used (cluster.max_restarts): not requeueing"',
            "  fi",
            "}",
            "trap requeue USR1",
        ]
    srun = "srun --kill-on-bad-exit=1 --ntasks-per-node=1 --label"
    lines += [
        f"{srun} \"$PY\" -m launch.slurm.preflight --in-job --rdzv-port \"$PORT\" {train_args}",
        ARGS_SEPARATOR,
        f"{srun} \"$PY\" -m torch.distributed.run --nnodes=\"$SLURM_JOB_NUM_NODES\" --nproc-per-node={c.ranks_per_node} \\",
        '    --rdzv-backend=c10d --rdzv-endpoint="$HEAD_ADDR:$PORT" --rdzv-id="$SLURM_JOB_ID" --max-restarts=0 \\',
        f'    --rdzv-conf=join_timeout={c.rdzv_timeout_s} \\',
        '    --log-dir="$RUN_DIR/torchrun" --tee=3 --local-ranks-filter=0 \\',
        f'    -m launch.train {train_args} run.dir="$RUN_DIR" trainer.resume=auto'
        + (' spot.buffer_name="$POOL_BUFFER"' if pool_agents(cfg) else "") + " &",
        "STEP=$!",
        *(pool_step_lines(cfg) if pool_agents(cfg) else []),
        "while true; do  # a USR1 interrupts wait; the step goes on until it ends or Slurm stops it",
        '  set +e; wait "$STEP"; rc=$?; set -e',
        '  if [ "$rc" -gt 128 ] && kill -0 "$STEP" 2>/dev/null; then continue; fi',
        "  break",
        "done",
        'echo "job $SLURM_JOB_ID: the run exited with status $rc"',
    ]
    if pool_agents(cfg):
        lines += ['touch "$POOL_DIR/STOP"  # the pool checkpoints, publishes and exits',
                  'set +e; wait "$POOL"; echo "job $SLURM_JOB_ID: the spot pool exited with status $?"',
                  'kill "$POOL_STORE"; wait "$POOL_STORE"; set -e']
    if cfg.spot.enabled:  # a rank killed mid-step (a lost node, the OOM killer) leaves its node's DataBuffer segment
        lines.append(f'{srun} "$PY" -m spot.buffer.segment --reclaim || true  # each node: remove the dead ranks\' segments')
    lines += ['exit "$rc"']
    return "\n".join(lines) + "\n"
