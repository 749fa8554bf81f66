"""The host stream of a training step: the CPU time that issues a layer's operators and
collectives, and the time the GPU waits for it.

The host runs ahead of the GPU, queueing kernels; it binds when issuing a layer's work takes
longer than the GPU needs to run it. Per layer and micro-batch (the layers of a stage are
alike, so this equals the comparison per synchronisation segment: a pipeline stage's pass of
one micro-batch, or the whole step without pipelining), the GPU waits

    wait = x(H, G),   x = `exposed_after_overlap` (a smooth clip(H - G, 0, H)),

with G the layer's GPU time (compute and exposed communication, s) and H its host time (s):

    H = (1 - graph) s (n (1 + f) t_op + n b t_bwd + c t_coll)

n = `Runtime.ops_per_layer` forward operators, f the recomputed share of the layer (its
forward operators run again), b backward operators per forward operator, c the layer's
collective calls, t the `Runtime` host times, s = `Efficiency.host_overhead` (the calibrated
host speed, 1 by default) and graph = `Runtime.train_graph`. A layer thus
takes about max(G, H); with every host time 0 (the default runtime) the wait is exactly 0.
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


def host_time_per_layer(model: Transformer, plan: TrainingPlan, runtime: Runtime,
                        host_overhead=1.0) -> jax.Array:
    """H: host time to issue one layer's work for one micro-batch, s (module docstring);
    `host_overhead` = s, the factor on every host time."""
    n = runtime.ops_per_layer
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
