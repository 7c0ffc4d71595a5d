"""The memory plan of a run: for each rank role, the bytes of each part, against the device's memory.

`plan(cfg, model, world, device)` puts launch.memory.actor's actor parts and launch.memory.rollout's
rollout parts together per role of the run's placement (pipeline.placement, docs/PLACEMENT.md):

- colocated: every rank holds its engine and its shard of the actor;
- separated: the actor ranks hold the actor (sharded over `pipeline.actor_ranks`), the rollout
  ranks the engines (and spot training in their idle time);
- a spot pool member (spot.mode=pool) shares its node's first rollout GPU (docs/SPOT_POOL.md), so
  that GPU is planned as the rollout rank plus the member.

A role's peak is what it holds the whole run plus the larger of its rollout and update phases'
transients (a colocated rank never rolls out and trains at once). On a GPU the peak must fit the
device's memory less `MARGIN` (what torch's allocator does not count: the CUDA context, NCCL's
buffers, cuBLAS workspaces, fragmentation). On a CPU the "device" is the process: its resident
memory is the interpreter's runtime (measured: `CpuFacts.runtime_bytes`) plus the same parts in
host memory, float32, with the CPU kernels' packed copies and the checkpoint read while the engine
loads; every rank of the machine shares its memory, less `CPU_MARGIN` for glibc's heap. Host memory per node (the spot DataBuffer in /dev/shm, offloaded optimizer states pinned,
vLLM's sleeping weights) is listed beside, checked against cluster.mem when it names a size.

A plan that does not fit names the role, its largest parts and the knobs that shrink them.
Knows nothing of files or printing (launch.memory reads config.json and prints the tables).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from engine.model_config import ModelConfig
from launch.memory.rollout import (DTYPE_BYTES, buffer_part, engine_parts, pool_member_parts, spot_trainer_parts,
                                  vllm_parts)
from launch.memory.actor import (ALL, PHASES, TRAINING, ZERO3_MAX_LIVE_PARAMETERS, GiB, ModelStates, ParamCounts, Part,
                                 activation_parts, param_counts, torch_model_states, zero_model_states)
from launch.run.config import TrainConfig

MARGIN = 0.10  # of a GPU's memory, held back for what torch's allocator does not count
# Of a CPU machine's memory: glibc's malloc keeps freed activations of up to 32 MiB in its heap, which
# later allocations only partly reuse; a rank's resident peak exceeded the plan by up to 30% in
# bench.memory's runs (docs/BENCHMARKS.md, "Memory"), and was within 6% of it with the heap's holes
# given back (a fixed mmap threshold).
CPU_MARGIN = 0.25


@dataclass(frozen=True)
class Device:
    kind: Literal["gpu", "cpu"]
    bytes: int  # one GPU's memory; on a CPU, the machine's memory, which its ranks share
    margin: float = MARGIN

    @property
    def usable(self) -> int:
        return int(self.bytes * (1 - self.margin))


@dataclass(frozen=True)
class CpuFacts:
    """What a CPU rank holds beyond its tensors, and how the engine runs there."""

    runtime_bytes: int  # the interpreter with torch, transformers and the project imported (measured)
    tile_n: int | None  # the CPU kernels' panel width (engine.kernels); None where they do not serve


@dataclass
class RoleMemory:
    role: str
    ranks: int  # ranks of the job in this role
    parts: list[Part]

    def total(self, phase: str) -> int:
        return sum(p.bytes for p in self.parts if phase in p.phases)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.total)

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase)

    def at_peak(self) -> list[Part]:
        """The parts present at the peak, largest first."""
        return sorted((p for p in self.parts if self.peak_phase in p.phases), key=lambda p: -p.bytes)


@dataclass
class MemoryPlan:
    device: Device
    roles: list[RoleMemory]
    host: list[Part]  # per node
    host_capacity: int | None  # cluster.mem per node, when it names a size
    notes: list[str] = field(default_factory=list)
    shared_by: int = 1  # CPU: ranks sharing the machine's memory

    def failures(self) -> list[str]:
        """One line per thing that does not fit: the role, its peak, the largest parts and their knobs."""
        out = []
        usable = self.device.usable
        if self.device.kind == "cpu":
            need = sum(r.peak * r.ranks for r in self.roles)
            if need > usable:
                out.append(f"the {self.shared_by} ranks need {need / GiB:.1f} GiB together, the machine has "
                           f"{usable / GiB:.1f} GiB usable: " + _largest(max(self.roles, key=lambda r: r.peak)))
        else:
            for r in self.roles:
                if r.peak > usable:
                    out.append(f"a {r.role} rank needs {r.peak / GiB:.1f} GiB at its {r.peak_phase} peak, a GPU has "
                               f"{usable / GiB:.1f} GiB usable ({self.device.bytes / GiB:.0f} GiB less "
                               f"{self.device.margin:.0%}): " + _largest(r))
        host = sum(p.bytes for p in self.host)
        if self.host_capacity is not None and host > self.host_capacity:
            big = max(self.host, key=lambda p: p.bytes)
            out.append(f"host memory per node: {host / GiB:.1f} GiB wanted, cluster.mem gives {self.host_capacity / GiB:.1f} "
                       f"GiB; largest: {big.name} {big.bytes / GiB:.1f} GiB ({big.how})")
        out += [n for n in self.notes if n.startswith("does not fit")]
        return out


def _largest(r: RoleMemory, n: int = 3) -> str:
    return "; ".join(f"{p.name} {p.bytes / GiB:.1f} GiB ({p.how}) -> {p.knob}" for p in r.at_peak()[:n] if p.knob)


def plan(cfg: TrainConfig, model: ModelConfig, *, world: int, device: Device, cpu: CpuFacts | None = None) -> MemoryPlan:
    """The plan of `cfg` on `world` ranks of `device` for a model of config.json shape `model`."""
    if (device.kind == "cpu") != (cpu is not None):
        raise ValueError("a CPU plan needs CpuFacts (the runtime's bytes, the kernels' panel width), a GPU plan none")
    actor_ranks, rollout_ranks = cfg.pipeline.roles(world)
    per_node = cfg.cluster.ranks_per_node if device.kind == "gpu" else world
    notes: list[str] = []
    host: list[Part] = []
    states = _actor_states(cfg, model, actor_ranks, per_node)
    actor = states.device + _actor_transients(cfg, model)
    rollout, rollout_host = _rollout(cfg, model, device, cpu, notes)
    runtime = [Part("runtime (interpreter, torch, libraries; measured)", cpu.runtime_bytes, ALL,
                    "a fresh rank's resident memory after its imports")] if cpu is not None else []
    if cfg.spot.enabled:
        host.append(buffer_part(cfg.spot))
    if not cfg.pipeline.separated:
        roles = [RoleMemory("colocated", world, runtime + actor + rollout)]
        host += _per_node(states.host_per_node, 1) + _per_node(rollout_host, min(per_node, world))
    else:
        roles = [RoleMemory("actor", actor_ranks, runtime + actor), RoleMemory("rollout", rollout_ranks, runtime + rollout)]
        host += _per_node(states.host_per_node, 1) + _per_node(rollout_host, min(per_node, rollout_ranks))
    if cfg.spot.enabled and cfg.spot.mode == "pool":
        member = pool_member_parts(model, cfg.spot, cfg.engine.spec.drafter_spec.learned or "eagle")
        members = max(1, math.ceil(rollout_ranks / per_node))  # one a rollout node
        if device.kind == "gpu":  # on the GPU of its node's first rollout rank (docs/SPOT_POOL.md)
            roles.append(RoleMemory("rollout + pool member (the node's first GPU)", members, rollout + member))
        else:  # a process of its own beside the ranks
            roles.append(RoleMemory("pool member", members, runtime + member))
    capacity = _host_capacity(cfg.cluster.mem) if device.kind == "gpu" else None
    return MemoryPlan(device=device, roles=roles, host=host, host_capacity=capacity, notes=notes,
                      shared_by=world if device.kind == "cpu" else 1)


def _per_node(parts: list[Part], ranks: int) -> list[Part]:
    """Host parts of one rank, for the `ranks` of a node that hold them."""
    if ranks == 1:
        return parts
    return [Part(p.name, p.bytes * ranks, p.phases, f"{ranks} ranks x ({p.how})", p.knob) for p in parts]


def _deepspeed_states(cfg: TrainConfig, p: ParamCounts, ranks: int, per_node: int) -> ModelStates:
    a = cfg.actor
    if a.dtype not in ("bfloat16", "float32"):
        raise ValueError(f"the memory planner sizes DeepSpeed ZeRO with actor.dtype bfloat16 or float32, not "
                         f"{a.dtype!r}: set actor.dtype to one of them")
    return zero_model_states(p, stage=a.zero_stage, world=ranks, ranks_per_node=min(per_node, ranks),
                             offload_optimizer=a.offload_optimizer, offload_params=a.offload_params,
                             weight_bytes=DTYPE_BYTES[a.dtype])


def _torch_states(cfg: TrainConfig, p: ParamCounts, ranks: int, per_node: int) -> ModelStates:
    return torch_model_states(p, dtype_bytes=DTYPE_BYTES[cfg.actor.dtype], world=ranks)


def _deepspeed_transients(cfg: TrainConfig, p: ParamCounts) -> list[Part]:
    """Beyond DeepSpeed's model-state estimate: ZeRO-3 keeps gathered parameters alive between their
    uses up to stage3_max_live_parameters (and reuse distance), so a model under it stays whole from
    the forward to the backward."""
    if cfg.actor.zero_stage != 3:
        return []
    d, live = DTYPE_BYTES[cfg.actor.dtype], min(ZERO3_MAX_LIVE_PARAMETERS, p.total)
    return [Part("ZeRO-3 live gathered parameters", d * live, ("update",),
                 f"min(stage3_max_live_parameters {ZERO3_MAX_LIVE_PARAMETERS:.0e}, {p.total:.3g} params) x {d} B",
                 "stage3_max_live_parameters (pipeline.actors.deepspeed_actor.zero3_settings)")]


# The planner's model of each actor backend it sizes: its model states, and what its update holds
# beyond the activations every backend has. Megatron shards by tensor / pipeline parallelism and is
# sized with megatron's own tools.
ACTOR_MODELS = {
    "torch": (_torch_states, lambda cfg, p: []),
    "deepspeed": (_deepspeed_states, _deepspeed_transients),
}


def _actor_model(cfg: TrainConfig):
    try:
        return ACTOR_MODELS[cfg.actor.backend]
    except KeyError:
        raise ValueError(f"the memory planner sizes actor.backend {' and '.join(ACTOR_MODELS)}, not "
                         f"{cfg.actor.backend!r} (megatron shards by tensor / pipeline parallelism: size it with "
                         "megatron's own tools)") from None


def _actor_states(cfg: TrainConfig, model: ModelConfig, ranks: int, per_node: int) -> ModelStates:
    return _actor_model(cfg)[0](cfg, param_counts(model), ranks, per_node)


def _actor_transients(cfg: TrainConfig, model: ModelConfig) -> list[Part]:
    from pipeline.actors.precision import resolve

    a = cfg.actor
    d = DTYPE_BYTES[a.dtype]
    mixed = resolve(a) == "bf16-mixed"
    ctx = min(cfg.engine.max_len, model.max_position_embeddings)
    # A micro-batch holds at most micro_batch_tokens padded tokens, or one row longer than that.
    tokens = max(a.micro_batch_tokens, ctx)
    parts = activation_parts(model, tokens, dtype_bytes=d, checkpointing=a.gradient_checkpointing,
                             head_chunk_tokens=a.head_chunk_tokens, autocast=mixed)
    p = param_counts(model)
    if mixed:
        parts.append(Part("autocast's bf16 weight copies", 2 * p.matrices, ("update",), f"{p.matrices:.3g} params x 2 B",
                          "actor.precision=float32"))
    parts += _actor_model(cfg)[1](cfg, p)
    if cfg.algorithm.kl_coef > 0:
        parts.append(Part("reference policy weights", d * p.total, TRAINING, f"{p.total:.3g} params x {d} B, whole",
                          "algorithm.kl_coef=0"))
    return parts


def _vllm_engine(cfg: TrainConfig, model: ModelConfig, device: Device, cpu: CpuFacts | None,
                 notes: list[str]) -> tuple[list[Part], list[Part]]:
    """vLLM's share of the GPU: its own allocator and a paged KV cache in what the share leaves."""
    e = cfg.engine
    parts, host, kv = vllm_parts(model, e, device_bytes=device.bytes)
    per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * DTYPE_BYTES[e.dtype]
    per_token //= e.vllm.tensor_parallel_size
    ctx = min(e.max_len, model.max_position_embeddings)
    if kv < per_token * ctx:
        notes.append(f"does not fit: vLLM's share leaves {kv / GiB:.1f} GiB of KV cache on each GPU, less than one "
                     f"row of engine.max_len={ctx} tokens ({per_token * ctx / GiB:.1f} GiB): raise "
                     "engine.vllm.gpu_memory_utilization or engine.vllm.tensor_parallel_size")
    else:
        notes.append(f"vLLM's KV cache: {kv / GiB:.1f} GiB a GPU, {kv // per_token:,} tokens "
                     f"({kv // per_token // ctx} rows of {ctx} at once at most; paged, so more of shorter ones)")
    return parts, host


def _native_engine(cfg: TrainConfig, model: ModelConfig, device: Device, cpu: CpuFacts | None,
                   notes: list[str]) -> tuple[list[Part], list[Part]]:
    """The native engine: its weights, a KV cache of max_len per row, the CPU kernels' packed copies."""
    e = cfg.engine
    stored = model.extra.get("torch_dtype") or model.extra.get("dtype") or "float32"
    parts = engine_parts(model, e, n=cfg.rollout.n, max_new_tokens=cfg.rollout.max_new_tokens,
                         cuda=device.kind == "gpu", cpu_tile_n=cpu.tile_n if cpu is not None and e.dtype == "float32"
                         and e.weights == "float32" else None, stored_bytes=DTYPE_BYTES.get(stored, 4))
    return parts, []


# The planner's model of each engine backend.
ENGINE_MODELS = {"native": _native_engine, "vllm": _vllm_engine}


def _rollout(cfg: TrainConfig, model: ModelConfig, device: Device, cpu: CpuFacts | None,
             notes: list[str]) -> tuple[list[Part], list[Part]]:
    """A rollout rank's device parts and its host parts."""
    e = cfg.engine
    if e.max_len > model.max_position_embeddings:
        notes.append(f"engine.max_len={e.max_len} is capped at the model's {model.max_position_embeddings} positions "
                     "(config.json's max_position_embeddings): the engine and the plan use that")
    parts, host = ENGINE_MODELS[e.backend](cfg, model, device, cpu, notes)
    learned = e.spec.drafter_spec.learned if e.spec.enabled else None
    if cfg.spot.enabled and cfg.spot.mode == "colocated" and learned is not None:
        parts += spot_trainer_parts(model, cfg.spot, learned, DTYPE_BYTES[e.dtype])
    return parts, host


def _host_capacity(mem: str | None) -> int | None:
    """cluster.mem ("800G", "512000M") in bytes; None for Slurm's default or "0" (the whole node)."""
    if not mem or mem == "0":
        return None
    m = re.fullmatch(r"(\d+)([KMGT]?)B?", mem.strip().upper())
    if m is None:
        return None
    return int(m.group(1)) * {"": 2**20, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)]
