"""Per-GPU memory of a training job: weights, gradients, optimizer states and activations.

Mixed-precision Megatron accounting, per parameter: 2 B of 16-bit weights (1 B of fp8 weights in
fp8 recipes), 4 B of fp32 gradient (`main_grad`; 2 B with `fp32_gradients = 0`) and 12 B of
fp32 master weights + Adam moments (8 B with bf16 moments, `fp32_optimizer_moments = 0`;
4 B weights and 8 B of moments for fp32 training: `TrainingPlan.optimizer_state_bytes`).
ZeRO stage 1 shards the optimizer states over the data-parallel group, 2 also the gradients,
3 also the weights. Offloading (`diffperf.training._offload`) moves a share f of the optimizer
states (with an fp32 gradient copy: (S + 4) B per parameter; ZeRO-2 / 3 then keep no gradients
of that share) and, with weight offload, the held weights (HBM keeps two layers' worth) to host
memory, `TrainingMemory.host`.

Activations follow Korthikanti et al. 2022 (arXiv:2205.05198), Table 2, per layer and micro-batch
in 16-bit, with s the (context-parallel local) sequence, b the micro-batch, h the width, a heads,
t the TP degree:

    no recompute, TP only:   s b h (10 + 24/t + 5 a s / (h t))
    + sequence parallel:     s b h / t (34 + 5 a s / h)
    selective recompute:     the 5 a s / h term (attention scores, softmax, dropout) is dropped
    full recompute:          2 s b h (/ t with sequence parallel): only the layer input

generalised to GQA (K and V of g kv-heads: 7 + 4 g/a instead of 11 for attention), to any MLP
width and to gated MLPs (3 + 4 f/h, or 3 + 6 f/h for SwiGLU, instead of 19), to MoE (MLP
activations x top-k) and to flash attention (never stores the s x s scores). The first pipeline
stage holds min(p, m) micro-batches in flight, times (1 + (p - 1) / (p v)) with v interleaved
chunks (Korthikanti Sec. 4.2.3).

Without pipeline parallelism the stage also holds the LM head's 16-bit logits of one
micro-batch, 2 s b v / t bytes (a fused cross entropy keeps only those; the unfused loss adds an
fp32 copy, Korthikanti Sec 4.3).

Beyond Korthikanti's GPT:
- dropout-free models (`Transformer.dropout = 0`: Llama and most models since) store no dropout
  masks (2 of the "10") and no dropout output of the scores (3 of the 5 a s / h);
- FP8 / FP4 recipes (Transformer Engine) keep the low-precision copy of each linear layer's input
  for the weight-gradient GEMM instead of the 16-bit tensor: the QKV, MLP and second-MLP-GEMM
  inputs shrink to 1 B (0.5625 B in NVFP4, its scales included) per element, and the output
  projection adds a copy next to the 16-bit attention output that the fused attention kernel keeps;
- `TrainingPlan.recompute_layers` fully recomputes the first layers of each pipeline chunk, and
  `TrainingPlan.offload_layers` keeps the activations of some layers in host memory; each adds
  one layer's activations of working space while it runs.
"""

from __future__ import annotations

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from ..costs._roofline import bytes_per_element
from ..specs._efficiency import Efficiency
from ..specs._training_plan import TrainingPlan
from ..specs._transformer import Transformer

#: Bytes per 16-bit weight (gradients: `TrainingPlan.gradient_bytes`; optimizer states:
#: `TrainingPlan.optimizer_state_bytes`).
WEIGHT_BYTES = 2.0
#: Bytes per parameter of the fp32 gradient copy that CPU Adam steps on in host memory
#: (optimizer offload, `diffperf.training._offload`).
HOST_GRADIENT_BYTES = 4.0


class TrainingMemory(eqx.Module):
    """Per-GPU memory of the most loaded (first) pipeline stage, B. `total` is the HBM the GPU
    needs (`weights` and `optimizer` only what stays in HBM); `host` the host (CPU) memory its
    offloads take (not in `total`): `host_activations + host_weights + host_optimizer`."""

    weights: jax.Array
    gradients: jax.Array
    optimizer: jax.Array
    activations: jax.Array
    reserved: jax.Array
    total: jax.Array
    host: jax.Array
    host_activations: jax.Array
    host_weights: jax.Array
    host_optimizer: jax.Array


def weight_bytes(plan: TrainingPlan) -> jax.Array:
    """Bytes per model weight a GPU holds (and gathers): 4 in fp32 training, 1 in fp8 recipes,
    which keep fp8 parameters (Megatron's `fp8_param_gather`, on in the NeMo and Megatron-Bridge
    fp8 recipes; the fp32 master copy is in the optimizer states), else 2: 16-bit mixed
    precision and fp4 recipes (Megatron-Bridge's NVFP4 recipe keeps bf16 parameters, "FP4
    currently doesn't support param gather")."""
    return jnp.where(plan.precision == 0, 4.0, jnp.where(plan.precision == 2, 1.0, WEIGHT_BYTES))


def params_per_gpu(model: Transformer, plan: TrainingPlan) -> jax.Array:
    """Parameters held by one GPU of the first pipeline stage before ZeRO sharding, count.

    Dense weights are split over `tp`; expert weights over `etp * ep`
    (`TrainingPlan.expert_layout`); the stage holds L / pp layers
    (`TrainingPlan.end_stage_layers`) plus the input embedding (V h / tp), and with pp = 1 also
    the output head unless it is tied to the embedding.
    """
    dense = model.layer_params() - model.expert_params()
    tables = 1.0 + jnp.where(plan.pp == 1, 1.0 - model.tied_embeddings, 0.0)
    return (plan.end_stage_layers(model.layers) * dense / plan.tp
            + tables * model.vocab * model.hidden / plan.tp + expert_params_per_gpu(model, plan))


def expert_params_per_gpu(model: Transformer, plan: TrainingPlan) -> jax.Array:
    """The expert-MLP part of `params_per_gpu` (a dense model's MLP weights), count."""
    etp = plan.expert_layout(model)[0]
    return plan.end_stage_layers(model.layers) * model.expert_params() / (etp * plan.ep)


def sharded_params_per_gpu(model: Transformer, plan: TrainingPlan) -> jax.Array:
    """`params_per_gpu` after sharding each weight over the ranks that hold a copy of it (ZeRO,
    the distributed optimizer): dense weights over dp * cp, expert weights over their
    expert-data-parallel ranks (`TrainingPlan.expert_layout`; dp * cp / ep when expert_tp = tp),
    count (`param_counts(...).sharded`)."""
    return param_counts(model, plan).sharded


class ParamCounts(NamedTuple):
    """The parameter counts of one GPU that memory, the optimizer and offloading share,
    computed once (`param_counts`): `local` all its weights (`params_per_gpu`), `sharded` its
    ZeRO shard of them (`sharded_params_per_gpu`), count."""

    local: jax.Array
    sharded: jax.Array

    def held(self, plan: TrainingPlan) -> jax.Array:
        """Parameters whose weights the GPU holds, in HBM or (weight offload) in host memory:
        its ZeRO-3 shard, else all its local weights, count."""
        return jnp.where(plan.zero >= 3, self.sharded, self.local)

    def held_weight_bytes(self, plan: TrainingPlan) -> jax.Array:
        """`held` at `weight_bytes` each, B."""
        return self.held(plan) * weight_bytes(plan)

    def optimizer_shard(self, plan: TrainingPlan) -> jax.Array:
        """Parameters whose optimizer states the GPU keeps and updates: its ZeRO shard (ZeRO
        >= 1), else all its local parameters, count."""
        return jnp.where(plan.zero >= 1, self.sharded, self.local)


def param_counts(model: Transformer, plan: TrainingPlan, local=None) -> ParamCounts:
    """`ParamCounts` of the plan (`local`: `params_per_gpu` if already computed)."""
    local = params_per_gpu(model, plan) if local is None else local
    expert = expert_params_per_gpu(model, plan)
    sharded = (local - expert) / (plan.dp * plan.cp) + expert / plan.expert_layout(model)[1]
    return ParamCounts(local, sharded)


def host_optimizer_bytes(plan: TrainingPlan, counts: ParamCounts) -> jax.Array:
    """Host memory the offloaded optimizer share takes per GPU, B: f * shard * (S + 4)."""
    return (plan.offload_optimizer * counts.optimizer_shard(plan)
            * (plan.optimizer_state_bytes + HOST_GRADIENT_BYTES))


def host_weight_bytes(plan: TrainingPlan, counts: ParamCounts) -> jax.Array:
    """Host memory the offloaded weights take per GPU, B: the weights it holds, or 0."""
    return plan.offload_weights * counts.held_weight_bytes(plan)


def hbm_weight_bytes(model: Transformer, plan: TrainingPlan, counts: ParamCounts) -> jax.Array:
    """HBM the weights take per GPU, B: all it holds, or with weight offload two layers'
    worth (the layer computing and the one being copied in): 2 / L of them, at most all."""
    held = counts.held_weight_bytes(plan)
    buffer = jnp.minimum(2.0 / plan.end_stage_layers(model.layers), 1.0) * held
    return jnp.where(plan.offload_weights > 0, buffer, held)


def _layer_bytes(model: Transformer, plan: TrainingPlan, keep_scores) -> jax.Array:
    """Bytes one layer stores per micro-batch when it is not fully recomputed (see the module
    docstring); `keep_scores` says whether the s x s attention tensors are kept, B."""
    t = plan.tp
    s = model.seq_len / plan.cp
    sbh = s * plan.micro_batch * model.hidden
    # MLP inputs kept per token (the MoE dispatch copies a token to each of its top-k experts;
    # a shared expert reads the undispatched input) and MLP width per token, mean over the MoE
    # and a MoE model's dense-MLP layers.
    dense = model.dense_fraction
    shared = model.shared_ffn_hidden
    k = (1.0 - dense) * (model.experts_per_token + jnp.where(shared > 0, 1.0, 0.0)) + dense
    kf_h = ((1.0 - dense) * (model.experts_per_token * model.ffn_hidden + shared)
            + dense * model.dense_width) / model.hidden
    drop = model.dropout
    # FP8 / FP4 recipes (Transformer Engine): each linear layer keeps the low-precision copy of
    # its input that the weight-gradient GEMM reads, not the 16-bit tensor. The fused attention
    # kernel still keeps its 16-bit output, so the output projection adds its own copy.
    low = plan.precision >= 2
    q = jnp.where(low, bytes_per_element(plan.precision), 2.0)
    attn_out = jnp.where(low, jnp.where(plan.flash_attention > 0, 2.0 + q, q), 2.0)
    # Parts replicated across the TP group unless sequence parallel shards them (Korthikanti's
    # "10"): two layer-norm inputs, the QKV input, two dropout masks, the MLP input (x top-k).
    # MLA also keeps its query and KV latents, the inputs of the up-projections.
    latents = model.mla * (model.q_lora_rank + model.kv_lora_rank + model.rope_head_dim)
    replicated = 4.0 + q + 2.0 * drop + q * k + q * latents / model.hidden
    # Parts always sharded over TP (Korthikanti's "24"): Q, K, V, the attention output, the first
    # MLP GEMM's output(s) (two for a gated MLP) and the activation output (second GEMM's input).
    # (These are a * d wide per token: h unless the model sets `head_width`; with MLA's widths
    # a * d_qk for Q and K, a * d_v for V and the output.)
    a, g = model.heads, model.attention_kv_heads
    qk, v = model.qk_dim, model.v_dim
    attention = (2.0 * a * qk + 2.0 * g * (qk + v) + attn_out * a * v) / model.hidden
    mlp_hidden = (2.0 * (1.0 + model.gated_mlp) + q) * kf_h
    # Selectively recomputed modules (`TrainingPlan.recompute_norms` ...; Megatron-LM 0d8e0714)
    # free what stored their outputs. Norms that are modules of their own (with Transformer
    # Engine, MLA's input norm and a MoE layer's pre-MLP norm; the others are fused into the
    # next linear layer): MLA's down-projections' input and a shared expert's input (q each;
    # under fp8 those linears then save the 16-bit original, which is freed; the router's
    # 16-bit input, also freed, is not counted above). The routed experts' activation: the
    # down projection's input (q, likewise). MLA's up-projections: Q, K and V, what the
    # attention core keeps. A dense MLP: everything but its input.
    moe = jnp.where(model.num_experts > 1, 1.0, 0.0)
    has_shared = jnp.where(shared > 0, 1.0, 0.0)
    norm_outputs = model.mla + moe * (1.0 - dense) * has_shared
    replicated = replicated - plan.recompute_norms * q * norm_outputs
    dense_mlp = ((1.0 - moe) * (1.0 - dense) * model.ffn_hidden
                 + dense * model.dense_width) / model.hidden
    mlp_hidden = (mlp_hidden
                  - plan.recompute_moe_act * moe * q * (1.0 - dense)
                  * model.experts_per_token * model.ffn_hidden / model.hidden
                  - plan.recompute_mlp * (2.0 * (1.0 + model.gated_mlp) + q) * dense_mlp)
    attention = attention - (plan.recompute_mla_up * model.mla
                             * (2.0 * a * qk + 2.0 * g * (qk + v)) / model.hidden)
    sharded = attention + mlp_hidden
    sp = plan.sequence_parallel > 0
    per_token = jnp.where(sp, (replicated + sharded) / t, replicated + sharded / t)
    # Softmax output (2), its dropout mask (1) and dropout output (2) per score element.
    scores = (2.0 + 3.0 * drop) * model.heads * s / (model.hidden * t)
    stored = sbh * (per_token + jnp.where(keep_scores, scores, 0.0))
    return stored * jnp.where(plan.precision == 0, 2.0, 1.0)  # fp32 training: 4-byte values


def _full_recompute_bytes(model: Transformer, plan: TrainingPlan) -> jax.Array:
    """Bytes a fully recomputed layer stores per micro-batch: its 16-bit input, B."""
    sbh = model.seq_len / plan.cp * plan.micro_batch * model.hidden
    full = 2.0 * sbh / jnp.where(plan.sequence_parallel > 0, plan.tp, 1.0)
    return full * jnp.where(plan.precision == 0, 2.0, 1.0)


def stored_bytes_per_layer(model: Transformer, plan: TrainingPlan) -> jax.Array:
    """Activation bytes a layer that is not fully recomputed stores per micro-batch under the
    plan's `recompute` (none or selective); also what an offloaded layer copies to host
    memory, B."""
    keep_scores = (plan.recompute == 0) & (plan.flash_attention == 0)
    return _layer_bytes(model, plan, keep_scores)


def activation_bytes_per_layer(model: Transformer, plan: TrainingPlan) -> jax.Array:
    """Activation bytes one transformer layer stores for one micro-batch in the plan's
    `recompute` mode (Korthikanti Table 2, generalised; see the module docstring), B.
    Per layer of that mode only: `training_memory` mixes in the `recompute_layers` fully
    recomputed layers and drops the `offload_layers` offloaded ones."""
    return jnp.where(plan.recompute == 2, _full_recompute_bytes(model, plan),
                     stored_bytes_per_layer(model, plan))


def in_flight_factor(plan: TrainingPlan) -> jax.Array:
    """Micro-batches whose activations the first stage holds at once, times the interleaving
    overhead (1 + (p - 1) / (p v)) of Korthikanti Sec. 4.2.3."""
    p = plan.pp
    in_flight = jnp.minimum(p, plan.num_micro_batches)
    interleave = jnp.where(plan.vp > 1, 1.0 + (p - 1.0) / (p * plan.vp), 1.0)
    return in_flight * interleave


def training_memory(model: Transformer, plan: TrainingPlan, eff: Efficiency) -> TrainingMemory:
    """Per-GPU memory breakdown of the first pipeline stage (the most loaded one), B."""
    counts = param_counts(model, plan)
    n, shard = counts
    weights = hbm_weight_bytes(model, plan, counts)
    # ZeRO-2 / 3 keep the gradients of their shard, less the offloaded optimizer share's,
    # which go to the host as they are reduced (`_offload.gradient_copy_exposed`).
    kept = jnp.where(plan.zero >= 2, (1.0 - plan.offload_optimizer) * shard, n)
    grads = kept * plan.gradient_bytes
    optim = ((1.0 - plan.offload_optimizer) * counts.optimizer_shard(plan)
             * plan.optimizer_state_bytes)
    # Per layer: fully recomputed layers keep their input, offloaded ones nothing, the others
    # what their `recompute` mode stores.
    full_frac = plan.recomputed_fraction(model.layers)
    off_frac = plan.offloaded_fraction(model.layers)
    stored = stored_bytes_per_layer(model, plan)
    per_layer = (full_frac * _full_recompute_bytes(model, plan)
                 + (1.0 - full_frac - off_frac) * stored)
    stage_layers = plan.end_stage_layers(model.layers)
    acts = stage_layers * per_layer * in_flight_factor(plan)
    host_acts = stage_layers * off_frac * stored * in_flight_factor(plan)
    # Recomputation rebuilds one layer's full set of activations at a time during the backward
    # pass; offloading stages one layer's activations in HBM while they are copied.
    no_recompute = _layer_bytes(model, plan, plan.flash_attention == 0)
    working = (jnp.where(full_frac > 0, no_recompute, 0.0)
               + jnp.where(off_frac > 0, stored, 0.0))
    # Input-embedding dropout mask (s b h / t bytes per micro-batch in flight, Korthikanti Sec 4.3).
    embed = (model.dropout * model.seq_len / plan.cp * plan.micro_batch * model.hidden / plan.tp
             * jnp.minimum(plan.pp, plan.num_micro_batches))
    # The last stage's logits (this stage's only without pipeline parallelism): the LM head's
    # 16-bit output (4-byte in fp32 training) for one micro-batch, s b v / t elements, which the
    # loss keeps for its backward pass. That is what a fused cross entropy (Megatron-core's loss
    # fusion) holds; the unfused vocab-parallel loss also keeps an fp32 copy (Korthikanti Sec 4.3's
    # 4 s b v / t), so this is a lower bound.
    logits = jnp.where(plan.pp > 1, 0.0, 2.0 * model.seq_len / plan.cp * plan.micro_batch
                       * model.vocab / plan.tp * jnp.where(plan.precision == 0, 2.0, 1.0))
    acts = acts + working + embed + logits
    total = weights + grads + optim + acts + eff.memory_reserve
    host_w, host_o = host_weight_bytes(plan, counts), host_optimizer_bytes(plan, counts)
    return TrainingMemory(weights, grads, optim, acts, eff.memory_reserve, total,
                          host_acts + host_w + host_o, host_acts, host_w, host_o)
