"""The rollout side's memory on one rank, part by part: pure arithmetic on the model's shape and the
engine and spot config sections.

- **native engine** (engine.engine.RolloutEngine): the target's weights in engine.dtype; on a CPU
  with the compiled kernels, the kernels' packed copy of every decoder product and of the LM head
  (engine.packed: panels of `tile_n` columns); the KV cache, preallocated as
  2 x L x max_batch x Hkv x (max_len + margin) x D x dtype bytes (engine.kv_cache; the margin,
  verify_tokens + 1 slots a row, exists once a drafter is attached); the learned drafter
  (engine.spec.eagle: fc, one decoder layer, its own [H, V] copy of the target's head, a one-layer
  KV cache with room for a draft tree, its pending features up to PENDING_BYTES); CUDA graph pools
  (engine.graphs: every captured graph keeps its outputs, and the largest one's transients are
  the pool's working set); and the rollout's transients: one prefill pass of the prompts admitted
  at once (ceil(max_batch / n) prompts of up to max_len - max_new_tokens tokens: one layer's
  tensors at a time) and one verify pass's float32 logits (logits, masked logits, noise);
- **vLLM** (engine.backend=vllm): `gpu_memory_utilization` of every GPU it spans, held, or only
  while rolling out when `sleep_level` frees it during the update (level 1 keeps the weights in
  host memory); its weights split over `tensor_parallel_size` GPUs, its KV cache the rest of the share;
- **spot training**: the trainable copy of the drafter with gradients and AdamW's moments, and one
  chunk's activations (window pairs x chunk_windows, its soft cross-entropy over V in float32);
  the node's DataBuffer in /dev/shm (spot.buffer_mb, host memory); an elastic pool member
  (spot.mode=pool: launch.spot_pool), which loads the whole target in float32 (spot.pool.elastic's
  `open_inputs`) on the GPU it shares with its node's first rollout rank.

Knows nothing of roles or devices' sizes (launch.memory.plan), nor of the actor (launch.memory.actor).
"""

from __future__ import annotations

import math

from engine.config import EngineConfig
from engine.graphs import capture_plan, config_arms
from engine.model_config import ModelConfig
from engine.spec.drafter import DraftShape
from engine.spec.eagle_drafter import PENDING_BYTES
from launch.memory.actor import ALL, TRAINING, UPDATE, Part, ParamCounts, param_counts
from spot.config import SpotConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}
MiB = 2**20
ROLLOUT = ("rollout",)
BUILD = ("build",)


def kv_bytes(m: ModelConfig, rows: int, slots: int, dtype_bytes: int, layers: int | None = None) -> int:
    """Keys and values of `rows` x `slots` tokens over `layers` (default: every layer)."""
    L = m.num_hidden_layers if layers is None else layers
    return 2 * L * rows * m.num_key_value_heads * slots * m.head_dim * dtype_bytes


def packed_copy_bytes(m: ModelConfig, tile_n: int, elem_bytes: int = 4) -> int:
    """The CPU kernels' packed copies (engine.packed.Product / engine.kernels.skinny.SkinnyMatrix):
    each [K, N] product padded to whole panels of tile_n columns, for every layer and the LM head."""
    H, I, D = m.hidden_size, m.intermediate_size, m.head_dim
    q, kv = m.num_attention_heads * D, m.num_key_value_heads * D
    panel = lambda K, N: math.ceil(N / tile_n) * tile_n * K * elem_bytes  # noqa: E731
    layer = panel(H, q + 2 * kv) + panel(q, H) + panel(H, 2 * I) + panel(I, H)
    return m.num_hidden_layers * layer + panel(H, m.vocab_size)


def drafter_counts(m: ModelConfig, kind: str) -> tuple[int, int]:
    """(parameters of a learned drafter shaped for target m, its feature size F): fc over
    [embed; features], one decoder layer (EAGLE's without an input norm), eagle3's fc_out."""
    H = m.hidden_size
    aux = 2 if kind in ("eagle3",) else 3 if kind == "eagle3_vllm" else 0
    F = H * (aux + 1)
    p = param_counts(ModelConfig(family="llama", vocab_size=m.vocab_size, hidden_size=H, intermediate_size=m.intermediate_size,
                                 num_hidden_layers=1, num_attention_heads=m.num_attention_heads,
                                 num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim))
    return (H + F) * H + p.layer + (F - H) * H, F


def engine_parts(m: ModelConfig, e: EngineConfig, *, n: int, max_new_tokens: int, cuda: bool, cpu_tile_n: int | None,
                 stored_bytes: int = 2) -> list[Part]:
    """The native engine's parts on one rank; `n`: samples per prompt (rollout.n); `cpu_tile_n`:
    the CPU kernels' panel width where they serve this engine (None: no packed copies);
    `stored_bytes`: bytes a parameter in the checkpoint file (read into host memory while loading)."""
    p = param_counts(m)
    b = DTYPE_BYTES[e.dtype]
    ctx = min(e.max_len, m.max_position_embeddings)
    spec = e.spec
    learned = spec.drafter_spec.learned if spec.enabled else None
    depth, topk, verify = spec.limits()
    margin = verify + 1 if spec.enabled else 0
    rows_knob = "engine.max_batch, engine.max_len"
    kv = kv_bytes(m, e.max_batch, ctx + margin, b)
    parts = [Part("engine weights", p.total * b, ALL, f"{p.total:.3g} params x {b} B",
                  "pipeline.placement=separated (actor ranks hold no engine)"),
             Part("engine KV cache", kv, ALL,
                  f"2 x {m.num_hidden_layers} layers x {e.max_batch} rows x {m.num_key_value_heads} kv heads x "
                  f"{ctx + margin} slots x {m.head_dim} x {b} B", rows_knob)]
    if spec.enabled:
        parts.append(Part("engine KV cache built twice", kv_bytes(m, e.max_batch, ctx, b), BUILD,
                          "attaching the drafter allocates the cache with its margin before the first is freed "
                          "(RolloutEngine.attach_drafter)", "engine.max_batch, engine.max_len"))
    if spec.enabled and spec.tuner == "cost" and spec.tuner_arms:
        from engine.spec.cost_policy import entries
        from engine.spec.tuner import parse_arm

        widest = max(entries(a) for a in map(parse_arm, spec.tuner_arms) if a is not None)
        probe = min(ctx // 2, ctx - widest - 1) + widest + 1  # engine.spec.pass_costs.measure's private cache
        parts.append(Part("cost tuner's pass measurement", kv_bytes(m, e.max_batch, probe, b)
                          + 2 * e.max_batch * widest * m.vocab_size * 4, BUILD,
                          f"a KV cache of {e.max_batch} rows x {probe} slots and a pass's logits, once per host "
                          "(engine.spec.pass_costs; cached after)", "engine.spec.tuner"))
    if not cuda:
        parts.append(Part("checkpoint tensors while loading", p.total * stored_bytes, BUILD,
                          f"{p.total:.3g} params x {stored_bytes} B read beside the model (engine.checkpoint)"))
    if cpu_tile_n is not None:
        parts.append(Part("engine packed copies (CPU kernels)", packed_copy_bytes(m, cpu_tile_n), ALL,
                          f"every layer's products and the head in panels of {cpu_tile_n} columns x 4 B",
                          "TAILSPEC_CPU_KERNELS=0 (slower)"))
    if learned is not None:
        parts += _drafter_parts(m, e, learned, b, ctx=ctx, margin=margin, depth=depth, topk=topk, verify=verify,
                                cpu_tile_n=cpu_tile_n)
    if cuda and e.cuda_graphs:
        parts.append(_graph_part(m, e, learned is not None, ctx, b))
    prompt = max(1, ctx - max_new_tokens)
    rows = math.ceil(e.max_batch / n)
    M = rows * prompt
    H, I, D = m.hidden_size, m.intermediate_size, m.head_dim
    per_token = b * (3 * H + (m.num_attention_heads + 2 * m.num_key_value_heads) * D + 3 * I)
    parts.append(Part("engine prefill pass", M * per_token, ROLLOUT,
                      f"{rows} prompts x {prompt} tokens x {per_token} B (one layer's tensors)", "engine.max_batch"))
    width = 1 + (verify if spec.enabled else 0)
    parts.append(Part("engine step logits", 3 * e.max_batch * width * m.vocab_size * 4, ROLLOUT,
                      f"3 x {e.max_batch} rows x {width} tokens x {m.vocab_size} x 4 B", "engine.max_batch"))
    return parts


def _drafter_parts(m: ModelConfig, e: EngineConfig, kind: str, b: int, *, ctx: int, margin: int, depth: int, topk: int,
                   verify: int, cpu_tile_n: int | None) -> list[Part]:
    params, F = drafter_counts(m, kind)
    V, H = m.vocab_size, m.hidden_size
    tentative = depth * topk + 1
    slots = ctx + margin + tentative
    per_pair = F * b * e.max_batch
    pending = max(2 * (verify + 2), min(ctx + margin + verify + 2, PENDING_BYTES // per_pair)) * per_pair
    parts = [Part(f"drafter ({kind}) weights + head copy", params * b + V * H * b, ALL,
                  f"{params:.3g} params x {b} B + its [H, V] head copy {V} x {H} x {b} B", "engine.spec.enabled=false"),
             Part("drafter KV cache + pending features", kv_bytes(m, e.max_batch, slots, b, layers=1) + pending, TRAINING,
                  f"1 layer x {e.max_batch} rows x {slots} slots + pending {pending / MiB:.0f} MiB", "engine.max_batch")]
    if cpu_tile_n is not None:
        one = ModelConfig(family="llama", vocab_size=V, hidden_size=H, intermediate_size=m.intermediate_size,
                          num_hidden_layers=1, num_attention_heads=m.num_attention_heads,
                          num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim)
        fc = math.ceil(H / cpu_tile_n) * cpu_tile_n * (H + F) * 4
        parts.append(Part("drafter packed copies (CPU kernels)", packed_copy_bytes(one, cpu_tile_n) + fc, ALL,
                          f"its layer, fc and head in panels of {cpu_tile_n} columns x 4 B", "TAILSPEC_CPU_KERNELS=0"))
    return parts


def _graph_part(m: ModelConfig, e: EngineConfig, speculative: bool, ctx: int, b: int) -> Part:
    """The CUDA graphs' pool: every graph's static outputs stay allocated, and the largest graph's
    transients are the working set the others reuse (engine.graphs.GraphRunner: one pool, largest first)."""
    spec = e.spec
    shape = DraftShape(depth=spec.depth, topk=spec.topk, verify_tokens=spec.verify_tokens)
    arms, thresholds, bucket_arms = config_arms(spec, shape) if speculative else ([None], [1], None)
    plan = capture_plan(arms, thresholds, e.max_batch, m, context=ctx, bucket_arms=bucket_arms, dtype_bytes=b)
    outputs = [g.batch * g.tokens * (m.hidden_size * b + m.vocab_size * 4) for g in plan.target]
    largest = max(plan.target, key=lambda g: g.bytes)
    total = sum(outputs) + largest.bytes
    return Part("CUDA graph pool", total, TRAINING, f"{len(plan.target)} target graphs' outputs + the largest's "
                f"({largest.batch} rows x {largest.tokens} tokens) transients", "engine.cuda_graphs=false")


def vllm_parts(m: ModelConfig, e: EngineConfig, *, device_bytes: int) -> tuple[list[Part], list[Part], int]:
    """vLLM on one GPU of its tensor-parallel group: (device parts, host parts per rank, the KV bytes
    its share leaves on this GPU, negative when the weights alone overflow the share)."""
    v = e.vllm
    p = param_counts(m)
    b = DTYPE_BYTES[e.dtype]
    tp = v.tensor_parallel_size
    weights = p.total * b // tp
    if v.kv_cache_gb is not None:
        share, how = weights + int(v.kv_cache_gb * 2**30), f"weights / {tp} GPUs + engine.vllm.kv_cache_gb={v.kv_cache_gb:g}"
    else:
        share = int(v.gpu_memory_utilization * device_bytes)
        how = f"engine.vllm.gpu_memory_utilization={v.gpu_memory_utilization:g} x the GPU's memory"
    phases = ("build", "rollout") if v.sleep_level else ALL
    parts = [Part("vLLM share (weights + KV cache)", share, phases, how + (f"; freed while the actor trains "
                  f"(sleep_level={v.sleep_level})" if v.sleep_level else ""),
                  "engine.vllm.gpu_memory_utilization, engine.vllm.tensor_parallel_size, engine.vllm.sleep_level")]
    host = [Part("vLLM weights asleep (host)", weights, UPDATE, f"{p.total:.3g} x {b} B / {tp} (sleep_level=1)")] \
        if v.sleep_level == 1 else []
    return parts, host, share - weights


def spot_trainer_parts(m: ModelConfig, s: SpotConfig, kind: str, dtype_bytes: int) -> list[Part]:
    """Spot training of the drafter on a rollout rank (its idle windows: phase rollout): the trainable
    copy with its own head copy, gradients, AdamW's moments, and one chunk's activations."""
    params, F = drafter_counts(m, kind)
    V, H, b = m.vocab_size, m.hidden_size, dtype_bytes
    tokens = s.window * s.chunk_windows
    per_token = 3 * V * 4 + (F + 4 * m.intermediate_size + 8 * H) * b  # soft CE over V in fp32; the layer's tensors
    return [Part("spot drafter copy + grads + AdamW", params * b * 4 + V * H * b, TRAINING,
                 f"{params:.3g} params x {b} B x (weights, grads, 2 moments) + head copy {V} x {H} x {b} B",
                 "spot.enabled=false"),
            Part("spot micro-step activations", tokens * per_token, ROLLOUT,
                 f"{tokens} pairs (spot.window x spot.chunk_windows) x {per_token} B", "spot.window, spot.chunk_windows")]


def pool_member_parts(m: ModelConfig, s: SpotConfig, kind: str) -> list[Part]:
    """An elastic pool member (launch.spot_pool): the target in float32 (its embedding and head are the
    drafter's), the drafter in float32 with gradients and AdamW, one micro-step's activations."""
    p: ParamCounts = param_counts(m)
    return [Part("pool: target weights (float32)", p.total * 4, ALL, f"{p.total:.3g} params x 4 B (spot.pool.elastic loads "
                 "the whole target)", "spot.mode=colocated"),
            *spot_trainer_parts(m, s, kind, 4)]


def buffer_part(s: SpotConfig) -> Part:
    return Part("spot DataBuffer (/dev/shm)", s.buffer_mb * MiB, ALL, f"spot.buffer_mb={s.buffer_mb}", "spot.buffer_mb")

