"""The host stream of a training step: the CPU time that issues a layer's operators and
collectives, and the time the GPU waits for it.

The host runs ahead of the GPU, queueing kernels; it binds when issuing a layer's work takes
longer than the GPU needs to run it. Per layer and micro-batch (the layers of a stage are
alike, so this equals the comparison per synchronisation segment: a pipeline stage's pass of
one micro-batch, or the whole step without pipelining), the GPU waits

    wait = x(H, G),   x = `exposed_after_overlap` (a smooth clip(H - G, 0, H)),

with G the layer's GPU time (compute and exposed communication, s) and H its host time (s):

    H = (1 - graph) s (n (1 + f) t_op + n b t_bwd + c t_coll)

n = `forward_ops_per_layer` forward operators (`Runtime.ops_per_layer`, plus in a MoE layer
`moe_ops_per_layer` and `moe_ops_per_expert` per local expert), f the recomputed share of the
layer (its forward operators run again), b backward operators per forward operator, c the
layer's collective calls, t the `Runtime` host times, s = `Efficiency.host_overhead` (the
calibrated host speed, 1 by default) and graph = `Runtime.train_graph`. A layer thus takes about
max(G, H); with every host time 0 (the default runtime) the wait is exactly 0.

Outside the layers, each micro-batch issues `Runtime.micro_batch_ops` more operators (embedding,
LM head, loss, the engine's wrappers) and `input_ops` to prepare its inputs, each at t_op. Where
the host runs ahead through the step (`Runtime.pass_sync` = 0) they are one more segment
against the LM head's GPU time. Where the framework synchronises the device around every pass
(`pass_sync` = 1: Megatron's timers), the segments are the passes themselves, and the input
preparation is host time with an idle GPU (`micro_batch_host_wait`). Where every MoE layer's
forward waits on the host for a device value (`Runtime.moe_layer_sync`, Megatron-Core's dropless
token dispatcher), the host cannot carry the forward's slack into the backward either: the
layers' forward and backward passes are separate segments, as with `pass_sync`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..costs._roofline import exposed_after_overlap
from ..specs._runtime import Runtime
from ..specs._training_plan import TrainingPlan
from ..specs._transformer import Transformer
from ._layer import LayerTimes


def collectives_per_layer(model: Transformer, plan: TrainingPlan) -> jax.Array:
    """Collective calls one layer issues per micro-batch (forward, recomputed forward and
    backward), count.

    Tensor parallelism: the layer's reductions per pass (`tp_reductions_per_pass`), each one
    all-reduce, or an all-gather and a reduce-scatter with sequence parallelism, in 2 + f
    passes. Context parallelism: one K / V all-gather per pass. Expert parallelism: a dispatch
    and a combine all-to-all per pass in the MoE layers (share 1 - r)."""
    passes = 2.0 + plan.recomputed_fraction(model.layers)
    per_reduction = jnp.where(plan.sequence_parallel > 0, 2.0, 1.0)
    tp = jnp.where(plan.tp > 1, model.tp_reductions_per_pass * per_reduction, 0.0)
    cp = jnp.where(plan.cp > 1, 1.0, 0.0)
    ep = jnp.where((plan.ep > 1) & (model.num_experts > 1),
                   2.0 * (1.0 - model.dense_fraction), 0.0)
    return passes * (tp + cp + ep)


def forward_ops_per_layer(model: Transformer, plan: TrainingPlan, runtime: Runtime) -> jax.Array:
    """n: framework operators of one layer's forward, mean over the layers, count:
    `ops_per_layer` + r (`moe_ops_per_layer` + E / ep `moe_ops_per_expert`), r the share of
    the layers with experts (0 for a dense model), E / ep the local experts."""
    moe = jnp.where(model.num_experts > 1, 1.0 - model.dense_fraction, 0.0)
    local = model.num_experts / jnp.maximum(plan.ep, 1.0)
    return runtime.ops_per_layer + moe * (runtime.moe_ops_per_layer
                                          + local * runtime.moe_ops_per_expert)


def host_time_per_layer(model: Transformer, plan: TrainingPlan, runtime: Runtime,
                        host_overhead=1.0) -> jax.Array:
    """H: host time to issue one layer's work for one micro-batch, s (module docstring);
    `host_overhead` = s, the factor on every host time."""
    n = forward_ops_per_layer(model, plan, runtime)
    full = plan.recomputed_fraction(model.layers)
    ops = (n * (1.0 + full) * runtime.host_op_time
           + n * runtime.backward_ops_per_op * runtime.host_backward_op_time)
    colls = collectives_per_layer(model, plan) * runtime.host_collective_time
    return (1.0 - runtime.train_graph) * host_overhead * (ops + colls)


def host_wait(model: Transformer, plan: TrainingPlan, layer: LayerTimes,
              runtime: Runtime, host_overhead=1.0) -> jax.Array:
    """Time the GPU waits for the host per layer and micro-batch, s: x(H, G) with G =
    compute + exposed communication of the layer (module docstring)."""
    return exposed_after_overlap(host_time_per_layer(model, plan, runtime, host_overhead),
                                 layer.compute + layer.comm)


def micro_batch_host_wait(model: Transformer, plan: TrainingPlan, layer: LayerTimes, head,
                          runtime: Runtime, host_overhead=1.0) -> jax.Array:
    """Time the GPU of the last stage waits for the host per micro-batch, s.

    With L = the stage's layers (`end_stage_layers`), P = 2 + f passes that issue the layer's
    c collectives (`collectives_per_layer`), s' = s (1 - graph), H_mb = s' N_mb t_op and
    H_in = s' N_in t_op (N = `Runtime.micro_batch_ops`, `input_ops`), and head the LM head's
    GPU time (`head_time`, forward + backward, s):

    - host running ahead (`pass_sync` = 0): each layer is a segment (`host_wait`), and the
      work outside the layers another against the head:
      w_0 = L x(H, G) + x(H_mb + H_in, head); in a MoE model whose layers' forward syncs
      (`moe_layer_sync` = y), L [(1 - y) x(H, G) + y (x(H_lf, G_lf) + x(H_lb, G_lb))] for
      the layers, with the one layer's shares of H_f, H_b, G_f, G_b below.
    - a device synchronisation at each pass boundary and around the input preparation
      (`pass_sync` = 1; Megatron's timers call `torch.cuda.synchronize()` in `start` and
      `stop`, and time `batch-generator`, `forward-compute` and `backward-compute` once per
      micro-batch): the passes are the segments, and the inputs are prepared with the GPU idle:
      w_1 = x(H_f, G_f) + x(H_b, G_b) + H_in, where

          H_f = s' L (n t_op + c t_coll / P) + H_mb
          H_b = s' L (n f t_op + n b t_bwd + c t_coll (1 + f) / P)
          G_f = L (forward + comm / P) + head / 3
          G_b = L (backward + recompute + comm (1 + f) / P) + 2 head / 3

      (the layer's exposed communication split evenly over the passes that issue it; the
      head's three GEMMs are one forward and two backward; the operators outside the layers
      are charged to the forward pass, a simplification: about a third of them are backward
      autograd nodes).

    The wait is (1 - pass_sync) w_0 + pass_sync w_1; x = `exposed_after_overlap`. With every
    host time 0 (the default runtime) it is exactly 0, and with N_mb = N_in = 0 and
    pass_sync = 0 it is L `host_wait`, the layers' wait alone."""
    layers = plan.end_stage_layers(model.layers)
    scale = (1.0 - runtime.train_graph) * host_overhead
    n, b = forward_ops_per_layer(model, plan, runtime), runtime.backward_ops_per_op
    f = plan.recomputed_fraction(model.layers)
    passes = 2.0 + f
    calls = collectives_per_layer(model, plan) * runtime.host_collective_time
    outside = scale * runtime.micro_batch_ops * runtime.host_op_time
    inputs = scale * runtime.input_ops * runtime.host_op_time
    # one layer's forward and backward pass: host time and GPU time, s
    h_layer_f = scale * (n * runtime.host_op_time + calls / passes)
    h_layer_b = scale * (n * f * runtime.host_op_time + n * b * runtime.host_backward_op_time
                         + calls * (1.0 + f) / passes)
    g_layer_f = layer.forward + layer.comm / passes
    g_layer_b = layer.backward + layer.recompute + layer.comm * (1.0 + f) / passes
    # the layers' passes as separate segments when a MoE layer's forward syncs (moe_layer_sync)
    split = (exposed_after_overlap(h_layer_f, g_layer_f)
             + exposed_after_overlap(h_layer_b, g_layer_b))
    pooled = host_wait(model, plan, layer, runtime, host_overhead)
    sync = runtime.moe_layer_sync * jnp.where(model.num_experts > 1, 1.0, 0.0)
    free = (layers * ((1.0 - sync) * pooled + sync * split)
            + exposed_after_overlap(outside + inputs, head))
    h_fwd = layers * h_layer_f + outside
    h_bwd = layers * h_layer_b
    g_fwd = layers * g_layer_f + head / 3.0
    g_bwd = layers * g_layer_b + 2.0 * head / 3.0
    synced = exposed_after_overlap(h_fwd, g_fwd) + exposed_after_overlap(h_bwd, g_bwd) + inputs
    return (1.0 - runtime.pass_sync) * free + runtime.pass_sync * synced
