"""The actor's memory on one rank, part by part: pure arithmetic on a model's config.json shape.

What the planner (launch.memory.plan) adds up for the actor, each part a `Part` with its bytes,
the phases of a rank's life that hold it (building its engine, rolling out, training the actor) and
the formula it came from:

- **parameter counts** of a Llama / Qwen2 / Qwen3 decoder (`ParamCounts`), and the largest single
  module (DeepSpeed's `largest_layer_params`: the parameters of one module, not recursing);
- **model states** (weights, gradients, optimizer) by backend. DeepSpeed ZeRO's follow DeepSpeed's
  own estimators (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`
  in deepspeed/runtime/zero/): bf16 weights 2 bytes a parameter, gradients 2 + 4 and the optimizer
  4 (fp32 master) + 8 (Adam's two moments) sharded over the data-parallel ranks, ZeRO-3 holding
  4 bytes a parameter of its largest module gathered; offloaded states go to pinned host memory
  with DeepSpeed's buffer factor of 1.5. ZeRO-1, which those estimators leave out, keeps whole
  bf16 gradients. The torch backend (DDP): weights, gradients and AdamW's two moments in the
  actor's dtype, plus DDP's gradient buckets (a second copy of the gradients) when world > 1;
- **activations** of one micro-batch of M tokens: what autograd saves in an HF Llama block, per
  token and layer, in the actor's dtype d (bytes): two RMSNorms (each its float32 input, its
  normalised output and its weighted output: 4H + 2dH, and one float32 rsqrt), q, k, v and the
  attention output (d (2 Hq D + 2 Hkv D); SDPA and the project's causal kernels keep q, k, v,
  out and a float32 log-sum-exp per head), and the SwiGLU MLP's gate, up, SiLU and product (4 d I);
  Qwen3 adds its q / k norms (float32 input, normalised output and rsqrt per head). This is the
  shape of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
  sbh(34 + 5as/h) for GPT) for a Llama block with a memory-efficient attention (no s^2 term);
  tests/test_memory_planner.py checks it against the bytes autograd saves in a transformers model
  (saved_tensors_hooks) and the update's total against the peak of its live tensors. With gradient checkpointing
  (HF's, per decoder layer) only each layer's input is kept. The backward's working set comes on
  top: the larger of the LM head's backward and (with checkpointing) one layer recomputed;
- **the LM head** as pipeline/actors/chunked_head.py computes it: the forward keeps the hidden
  states it scores and two floats a token; at most `head_chunk_tokens` tokens' logits exist at a
  time, three [chunk, V] float32 buffers in the backward (logits, softmax, their gradient), and the
  weight's gradient is summed over chunks in a float32 [V, H] buffer (plus its cast, and a
  per-chunk product, when the weights are bf16).

Knows nothing of config files, devices or roles (launch.memory.plan), nor of the engine
(launch.memory.rollout).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import ModelConfig

GiB = 2**30
# pipeline.actors.deepspeed_actor.zero3_settings' stage3_max_live_parameters (a test keeps them equal):
# ZeRO-3 keeps up to this many gathered parameters alive between their uses (stage3_max_reuse_distance
# is as large), so a model under it stays gathered from its forward through its backward.
ZERO3_MAX_LIVE_PARAMETERS = 10**9
DEEPSPEED_BUFFER_FACTOR = 1.5  # DeepSpeed's estimators' additional_buffer_factor for offloaded (host) states

PHASES = ("build", "rollout", "update")  # building the engine, rolling out, training the actor
ALL = PHASES
UPDATE = ("update",)
TRAINING = ("rollout", "update")  # what exists from the first step on (a colocated rank builds its engine first)


@dataclass(frozen=True)
class Part:
    """One thing a rank holds: `bytes` in each of `phases` (PHASES), computed as `how` says; `knob`
    names what makes it smaller."""

    name: str
    bytes: int
    phases: tuple[str, ...]
    how: str
    knob: str = ""

    def __post_init__(self) -> None:
        if self.bytes < 0:
            raise ValueError(f"part {self.name!r} has negative bytes {self.bytes}")
        if not self.phases or any(p not in PHASES for p in self.phases):
            raise ValueError(f"part {self.name!r}: phases must be some of {PHASES}, got {self.phases}")

    @property
    def when(self) -> str:
        """The phases, for a table: all, or their names."""
        return "all" if set(self.phases) == set(PHASES) else "+".join(self.phases)


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # V x H
    head: int  # V x H, 0 when tied to the embedding
    layer: int  # one decoder layer
    layers: int  # L
    final_norm: int
    largest_module: int  # DeepSpeed's largest_layer_params: one module's own parameters
    layer_vectors: int  # norms and biases of one layer

    @property
    def total(self) -> int:
        return self.embedding + self.head + self.layers * self.layer + self.final_norm

    @property
    def matrices(self) -> int:
        """Parameters in 2-D weights (what bf16 autocast casts): all but norms and biases."""
        return self.total - self.layers * self.layer_vectors - self.final_norm


def param_counts(m: ModelConfig) -> ParamCounts:
    H, I, D = m.hidden_size, m.intermediate_size, m.head_dim
    q, kv = m.num_attention_heads * D, m.num_key_value_heads * D
    attn = H * q + 2 * H * kv + q * H
    vectors = 2 * H + ((q + 2 * kv) if m.qkv_bias else 0) + (2 * D if m.qk_norm else 0)
    layer = attn + 3 * H * I + vectors
    embedding = m.vocab_size * H
    # nn.Linear modules hold their weight and bias: q_proj is H x q (+ q), gate / up / down H x I.
    largest = max(embedding, H * I, H * q + (q if m.qkv_bias else 0))
    return ParamCounts(embedding=embedding, head=0 if m.tie_word_embeddings else embedding, layer=layer,
                       layers=m.num_hidden_layers, final_norm=H, largest_module=largest, layer_vectors=vectors)


# -- model states ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelStates:
    """The actor's weights, gradients and optimizer on one rank's device, and what goes to the
    node's host memory (offloaded states, pinned: the host bytes of the whole node)."""

    device: list[Part]
    host_per_node: list[Part]


def zero_model_states(p: ParamCounts, *, stage: int, world: int, ranks_per_node: int, offload_optimizer: bool,
                      offload_params: bool, weight_bytes: int = 2) -> ModelStates:
    """DeepSpeed ZeRO over `world` data-parallel ranks, as DeepSpeed's estimators count with bf16 weights
    (zero_init: ZeRO-3 builds the model partitioned; the actor uses deepspeed.zero.Init). With float32
    weights (`weight_bytes` 4: a CPU run) the model's weights and gradients take 4 B, and DeepSpeed
    still keeps its fp32 partitions beside them for the optimizer."""
    P, N, LL, w = p.total, world, p.largest_module, weight_bytes
    wname = "bf16" if w == 2 else "fp32"
    nodes = -(-world // ranks_per_node)
    knob_opt = "actor.offload_optimizer=true, more data-parallel ranks"
    dev: list[Part] = []
    host: list[Part] = []
    if stage in (1, 2):
        dev.append(Part(f"actor weights ({wname})", w * P, TRAINING, f"{P:.3g} params x {w} B, whole on every rank",
                        "actor.zero_stage=3"))
        if offload_optimizer:
            # DeepSpeed's ZeRO-1/2 estimate counts the whole fp32 model loaded by every rank before it shards.
            host.append(Part("offloaded optimizer (pinned)", int(P * max(4 * world, 16) * DEEPSPEED_BUFFER_FACTOR),
                             TRAINING, f"{P:.3g} params x max(4 x {world} ranks, 16) B x {DEEPSPEED_BUFFER_FACTOR} "
                             "(DeepSpeed's ZeRO-1/2 estimate)"))
        else:
            grads = w * P if stage == 1 else 0
            how = (f"{P:.3g} x {w} B {wname} whole + {P:.3g} x 4 B fp32 / {N}" if stage == 1
                   else f"{P:.3g} x ({w} + 4) B / {N} ranks")
            dev.append(Part("actor gradients", grads + (4 if stage == 1 else w + 4) * P // N, TRAINING, how,
                            "actor.zero_stage=2" if stage == 1 else "actor.zero_stage=3"))
            dev.append(Part("actor optimizer (fp32 master + Adam)", 12 * P // N, TRAINING, f"{P:.3g} x 12 B / {N} ranks",
                            knob_opt))
        return ModelStates(dev, host)
    if stage != 3:
        raise ValueError(f"actor.zero_stage must be 1, 2 or 3, got {stage}")
    dev.append(Part("ZeRO-3 gathered module", 4 * LL, TRAINING, f"largest module {LL:.3g} params x 4 B (DeepSpeed's "
                    "largest_layer_memory)"))
    if offload_optimizer and offload_params:
        host.append(Part("offloaded weights + optimizer (pinned)", int(P * 18 / nodes * DEEPSPEED_BUFFER_FACTOR), TRAINING,
                         f"{P:.3g} x 18 B / {nodes} nodes x {DEEPSPEED_BUFFER_FACTOR}"))
        return ModelStates(dev, host)
    dev.append(Part(f"actor weights ({wname} shard)", w * P // N, TRAINING, f"{P:.3g} x {w} B / {N} ranks",
                    "more data-parallel ranks, actor.offload_params=true"))
    if offload_optimizer:
        host.append(Part("offloaded optimizer (pinned)", int(P * 16 / nodes * DEEPSPEED_BUFFER_FACTOR), TRAINING,
                         f"{P:.3g} x 16 B / {nodes} nodes x {DEEPSPEED_BUFFER_FACTOR}"))
    else:
        dev.append(Part("actor gradients + optimizer (fp32)", 16 * P // N, TRAINING, f"{P:.3g} x (4 + 4 + 8) B / {N} ranks",
                        knob_opt))
    return ModelStates(dev, host)


def torch_model_states(p: ParamCounts, *, dtype_bytes: int, world: int) -> ModelStates:
    """The torch backend: weights, gradients and AdamW's moments in the parameters' dtype; DDP's
    gradient buckets (a flat copy of every gradient, gradient_as_bucket_view off) when world > 1."""
    P, d = p.total, dtype_bytes
    dev = [Part("actor weights", d * P, TRAINING, f"{P:.3g} params x {d} B", "actor.backend=deepspeed actor.zero_stage=3"),
           Part("actor gradients", d * P, TRAINING, f"{P:.3g} x {d} B", "actor.backend=deepspeed actor.zero_stage=2"),
           Part("actor optimizer (AdamW)", 2 * d * P, TRAINING, f"{P:.3g} x 2 x {d} B", "actor.backend=deepspeed")]
    if world > 1:
        dev.append(Part("DDP gradient buckets", d * P, TRAINING, f"{P:.3g} x {d} B (a flat copy of the gradients)",
                        "actor.backend=deepspeed"))
    return ModelStates(dev, [])


# -- activations -----------------------------------------------------------------------------------

def layer_activation_bytes(m: ModelConfig, dtype_bytes: int) -> int:
    """Bytes autograd saves per token in one decoder layer (the module docstring's count)."""
    H, I, D, d = m.hidden_size, m.intermediate_size, m.head_dim, dtype_bytes
    q, kv = m.num_attention_heads * D, m.num_key_value_heads * D
    norm = 4 * H + 2 * d * H + 4  # float32 input, normalised and weighted outputs, rsqrt
    attention = d * (2 * q + 2 * kv) + 4 * m.num_attention_heads  # q, k, v, out; log-sum-exp
    # Qwen3's per-head q / k norms: float32 input, normalised output, rsqrt (their weighted output feeds RoPE, which keeps none).
    qk_norm = ((4 + d) * (q + kv) + 4 * (m.num_attention_heads + m.num_key_value_heads)) if m.qk_norm else 0
    return 2 * norm + attention + qk_norm + 4 * d * I


def head_input_bytes(m: ModelConfig, dtype_bytes: int) -> int:
    """Bytes saved per token outside the layers: the final norm, the scored hidden state, the
    log-sum-exp and entropy, the token id and the RoPE tables' row."""
    H, d = m.hidden_size, dtype_bytes
    return (4 * H + 2 * d * H + 4) + d * H + 8 + 8 + 2 * 4 * m.head_dim


def activation_parts(m: ModelConfig, tokens: int, *, dtype_bytes: int, checkpointing: bool, head_chunk_tokens: int,
                     autocast: bool = False) -> list[Part]:
    """The update's activations for a micro-batch of `tokens` padded tokens (phase update): what the
    forward keeps, and the backward's working set on top of it, the larger of its two moments. The
    LM head's backward comes first, with every kept tensor still alive: its chunk buffers and weight
    gradient (`head_bytes`). Then each layer's: without checkpointing a layer's gradients take the
    place of the saved tensors they free; with it, the layer's forward is recomputed first, one
    layer's saved tensors beside the kept inputs.

    `autocast` (bf16-mixed: float32 weights, products in bf16) saves the products' inputs in bf16
    (d = 2) and holds bf16 copies of the weights' matrices while autocast runs (counted by the caller)."""
    L, H = m.num_hidden_layers, m.hidden_size
    d = 2 if autocast else dtype_bytes
    per_layer = layer_activation_bytes(m, d)
    head_in = head_input_bytes(m, d)
    knob = "actor.micro_batch_tokens" + ("" if checkpointing else " (or actor.gradient_checkpointing=true)")
    if checkpointing:
        kept = Part("activations: layer inputs kept (checkpointing)", L * tokens * H * dtype_bytes, UPDATE,
                    f"{L} layers x {tokens} tokens x {H} x {dtype_bytes} B", knob)
    else:
        kept = Part("activations: every layer's saved tensors", L * tokens * per_layer, UPDATE,
                    f"{L} layers x {tokens} tokens x {per_layer} B per token and layer", knob)
    # The head's backward also fills the hidden states' gradient, [tokens, H] in the actor's dtype.
    head = head_bytes(m, min(head_chunk_tokens, tokens), weight_bytes=dtype_bytes, float32_head=autocast) + tokens * H * d
    layer = tokens * per_layer if checkpointing else 0
    if head >= layer:
        work = Part("backward: the LM head's chunk buffers + weight gradient", head, UPDATE,
                    _head_how(m, min(head_chunk_tokens, tokens), dtype_bytes, autocast) + f" + {tokens} x {H} x {d} B"
                    + (f"; more than one layer recomputed, {layer / GiB:.2f} GiB" if checkpointing else ""),
                    "actor.head_chunk_tokens")
    else:
        work = Part("backward: one layer recomputed", layer, UPDATE, f"{tokens} tokens x {per_layer} B; more than "
                    f"the LM head's backward, {head / GiB:.2f} GiB", knob)
    return [kept, Part("activations: final norm + head inputs", tokens * head_in, UPDATE,
                       f"{tokens} tokens x {head_in} B", "actor.micro_batch_tokens"), work]


def _narrow(weight_bytes: int, float32_head: bool) -> bool:
    """The head's products in bf16 (bf16 weights without bf16-mixed's float32 head)."""
    return weight_bytes < 4 and not float32_head


def head_bytes(m: ModelConfig, chunk_tokens: int, *, weight_bytes: int, float32_head: bool) -> int:
    """The chunked LM head's backward buffers (chunked_head.ChunkedHead.backward): three [chunk, V]
    float32 buffers (logits, softmax, their gradient; bf16 weights add its cast), the weight's float32
    [V, H] gradient sum and, for bf16 weights, each chunk's [V, H] product and the sum's cast back."""
    V, H, c = m.vocab_size, m.hidden_size, chunk_tokens
    narrow = _narrow(weight_bytes, float32_head)
    return 3 * c * V * 4 + (c * V * 2 if narrow else 0) + V * H * 4 + (2 * V * H * weight_bytes if narrow else 0)


def _head_how(m: ModelConfig, c: int, weight_bytes: int, float32_head: bool) -> str:
    V, H = m.vocab_size, m.hidden_size
    if _narrow(weight_bytes, float32_head):
        return f"(3 x 4 + 2) B x {c} tokens x {V} vocab + (4 + 2 x {weight_bytes}) B x {V} x {H}"
    return f"3 x 4 B x {c} tokens x {V} vocab + 4 B x {V} x {H}"
