"""Per-GPU memory of a training job: weights, gradients, optimizer states and activations.

Mixed-precision Megatron accounting, per parameter: 2 B of 16-bit weights, 4 B of fp32 gradient
(`main_grad`) and 12 B of fp32 master weights + Adam moments (4 B weights, 8 B for fp32 training).
ZeRO stage 1 shards the optimizer states over the data-parallel group, 2 also the gradients,
3 also the weights.

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
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from .efficiency import Efficiency
from .model import Transformer
from .plans import TrainingPlan

#: Bytes per parameter held by mixed-precision training: 16-bit weights, fp32 gradient, fp32
#: master weights + two Adam moments.
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2.0, 4.0, 12.0


class TrainingMemory(eqx.Module):
    """Per-GPU memory of the most loaded (first) pipeline stage, B."""

    weights: jax.Array
    gradients: jax.Array
    optimizer: jax.Array
    activations: jax.Array
    reserved: jax.Array
    total: jax.Array


def params_per_gpu(model: Transformer, plan: TrainingPlan) -> jax.Array:
    """Parameters held by one GPU of the first pipeline stage before ZeRO sharding, count.

    Dense weights are split over `tp`; expert weights over `tp * ep`; the stage holds L / pp
    layers plus the input embedding (V h / tp).
    """
    expert = model.num_experts * model.mlp_matrices * model.hidden * model.ffn_hidden
    dense = model.layer_params() - expert
    per_layer = dense / plan.tp + expert / (plan.tp * plan.ep)
    return model.layers / plan.pp * per_layer + model.vocab * model.hidden / plan.tp


def activation_bytes_per_layer(model: Transformer, plan: TrainingPlan) -> jax.Array:
    """Activation bytes one transformer layer stores for one micro-batch (Korthikanti Table 2,
    generalised; see the module docstring), B."""
    t = plan.tp
    s = model.seq_len / plan.cp
    sbh = s * plan.micro_batch * model.hidden
    r = model.kv_heads / model.heads
    k = model.experts_per_token
    f_h = model.ffn_hidden / model.hidden
    # Parts replicated across the TP group unless sequence parallel shards them (Korthikanti's
    # "10"): two layer-norm inputs, QKV input, MLP input, two dropout masks (MLP input x top-k).
    replicated = 4.0 + 2.0 + 1.0 + 1.0 + 2.0 * k
    # Parts always sharded over TP (Korthikanti's "24"): Q, K, V, attention output, MLP hiddens.
    attention = 2.0 + 4.0 * r + 2.0
    mlp_hidden = jnp.where(model.gated_mlp > 0, 6.0, 4.0) * f_h * k
    sharded = attention + mlp_hidden
    sp = plan.sequence_parallel > 0
    per_token = jnp.where(sp, (replicated + sharded) / t, replicated + sharded / t)
    scores = 5.0 * model.heads * s / (model.hidden * t)  # softmax, its dropout mask and output
    keep_scores = (plan.recompute == 0) & (plan.flash_attention == 0)
    stored = sbh * (per_token + jnp.where(keep_scores, scores, 0.0))
    full = 2.0 * sbh / jnp.where(sp, t, 1.0)
    act16 = jnp.where(plan.recompute == 2, full, stored)
    return act16 * jnp.where(plan.precision == 0, 2.0, 1.0)  # fp32 training stores 4-byte values


def in_flight_factor(plan: TrainingPlan) -> jax.Array:
    """Micro-batches whose activations the first stage holds at once, times the interleaving
    overhead (1 + (p - 1) / (p v)) of Korthikanti Sec. 4.2.3."""
    p = plan.pp
    in_flight = jnp.minimum(p, plan.num_micro_batches)
    interleave = jnp.where(plan.vp > 1, 1.0 + (p - 1.0) / (p * plan.vp), 1.0)
    return in_flight * interleave


def training_memory(model: Transformer, plan: TrainingPlan, eff: Efficiency) -> TrainingMemory:
    """Per-GPU memory breakdown of the first pipeline stage (the most loaded one), B."""
    n = params_per_gpu(model, plan)
    shard = plan.dp * plan.cp
    wbytes = jnp.where(plan.precision == 0, 4.0, WEIGHT_BYTES)
    obytes = jnp.where(plan.precision == 0, 8.0, OPTIMIZER_BYTES)
    weights = n * wbytes / jnp.where(plan.zero >= 3, shard, 1.0)
    grads = n * GRAD_BYTES / jnp.where(plan.zero >= 2, shard, 1.0)
    optim = n * obytes / jnp.where(plan.zero >= 1, shard, 1.0)
    per_layer = activation_bytes_per_layer(model, plan)
    layers_per_stage = model.layers / plan.pp
    acts = layers_per_stage * per_layer * in_flight_factor(plan)
    # Full recompute rebuilds one layer's activations at a time during the backward pass.
    working = jnp.where(plan.recompute == 2,
                        activation_bytes_per_layer(model, eqx.tree_at(
                            lambda p: p.recompute, plan, jnp.zeros_like(plan.recompute))), 0.0)
    # Input-embedding dropout mask (s b h / t bytes per micro-batch in flight, Korthikanti Sec 4.3).
    embed = (model.seq_len / plan.cp * plan.micro_batch * model.hidden / plan.tp
             * jnp.minimum(plan.pp, plan.num_micro_batches))
    acts = acts + working + embed
    total = weights + grads + optim + acts + eff.memory_reserve
    return TrainingMemory(weights, grads, optim, acts, eff.memory_reserve, total)
