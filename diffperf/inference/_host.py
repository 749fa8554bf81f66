"""The host stream of a serving step: kernel launches under CUDA graphs, the CPU time an eager
engine spends issuing a pass, and the time the GPU waits for it.

Launches. Without a CUDA graph every kernel costs the accelerator's `launch_overhead` plus the
`Efficiency.kernel_overhead` tail (the calibration set: TensorRT-LLM 0.x without graphs). A
phase captured in a graph (`Runtime.prefill_graph` / `decode_graph` = g, where the pass has at
most `Runtime.graph_max_tokens` tokens: `graph_share`) replays its kernels
back to back: each costs `Runtime.graph_node_time` plus the same tail. Per kernel

    t_kernel = (1 - g) (launch_overhead + kernel_overhead) + g (graph_node_time + kernel_overhead)

(`diffperf.inference.inference_ops` mixes the two as (1 - g) x eager + g x replayed, so the
default runtime's launches are, to float rounding, those of the model without a runtime).

Host issue. An eager engine (Python model code) spends host time on every framework operator
and collective of every layer; the host runs ahead of the GPU and binds only when issuing a
pass takes longer than the GPU needs to run it. Per pass (a prefill pass, or one decode step)

    wait = s t_step + x(H / pp, G / pp),   H = (1 - g) s L (n t_op + c t_coll)

with x = `exposed_after_overlap` (a smooth clip(H - G, 0, H)), G the pass's GPU time (every
operation of every stage, s), L layers, n = `Runtime.ops_per_layer`, c the layer's
collective calls (`model.tp_reductions_per_pass` all-reduces when tp > 1), t the `Runtime`
host times, s = `Efficiency.host_overhead` x `Accelerator.host_time_factor` (the calibrated
host speed, 1 by default, times the host CPU's time against a DGX H100's x86 host: 2.75 on
Grace) and
t_step = `Runtime.host_step_time` (scheduler, sampling: CPU work between steps,
during which the GPU idles). A Python engine's per-request work (`Runtime.host_seq_time` per
sequence of the pass) joins H: the engine runs it one step ahead, beside the GPU. Each
pipeline stage has its own host process, issuing its L / pp layers while the earlier stages
compute, so the first stage binds: x(H / pp, G / pp). x is
homogeneous of degree one, so over the S decode steps the wait is S t_step + x(S H, S G) / pp
with S G the decode phase's GPU time (exact when every step takes the same time; the steps'
attention grows with the context, and the mean step stands for them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..costs._roofline import exposed_after_overlap
from ..specs._efficiency import Efficiency
from ..specs._hardware import Accelerator
from ..specs._inference_plan import InferencePlan
from ..specs._runtime import Runtime
from ..specs._transformer import Transformer


def graph_share(graph, tokens, runtime: Runtime) -> jax.Array:
    """A phase's CUDA-graph share: `graph` (`Runtime.prefill_graph` or `decode_graph`) where the
    pass of `tokens` tokens has a captured graph (tokens <= `Runtime.graph_max_tokens`), else 0
    (the engine runs it eagerly)."""
    return jnp.where(tokens <= runtime.graph_max_tokens, graph, 0.0)


def graph_padded_batch(batch, runtime: Runtime) -> jax.Array:
    """The batch a padded CUDA-graph decode step runs, sequences: the next size of the engine's
    captured ladder at or above `batch`,

        b_pad = min(f r^k, B),  k = ceil(log(b / f) / log r)   for f < b <= B (else b_pad = b)

    with r = `Runtime.graph_pad_ratio`, f = `Runtime.graph_pad_from` and B =
    `Runtime.graph_max_tokens`, the ladder's top (a larger step has no graph: not padded). The
    serving simulator caps B at the engine's `max_num_seqs` (`iteration_cost`'s `max_seqs`).
    r = 1 turns padding off. TensorRT-LLM pads a decode batch to its next captured size when
    `cuda_graph_config.enable_padding` is set, and caps the ladder at the executor's
    `max_batch_size` (tensorrt_llm/_torch/pyexecutor/model_engine.py,
    `_filter_cuda_graph_batch_sizes`: a listed size above it is replaced by it); its default
    ladder and the sizes the performance-overview pages list double above 128 (NVIDIA's blog
    'Tuning CUDA Graph Batch Sizes for Higher Output Throughput': gaps of up to 1,024
    sequences, up to 50 % padding waste, 1.3x throughput from a finer ladder). Exact
    ceilings forward, the gradient of b (straight-through)."""
    return padded_size(batch, runtime.graph_pad_ratio, runtime.graph_pad_from,
                       runtime.graph_max_tokens)


def padded_size(batch, ratio, start, top) -> jax.Array:
    """`graph_padded_batch` from the ladder's parts: `ratio` r, `start` f, `top` B."""
    b = jnp.asarray(batch, dtype=float)
    r = jnp.maximum(ratio, 1.0 + 1e-6)  # log r > 0 where padding is off
    q = jnp.log(jnp.maximum(b, start) / start) / jnp.log(r)
    k = jnp.ceil(q)
    k = jnp.where(start * r ** (k - 1.0) >= b, k - 1.0, k)  # an exact power lands on itself
    k = jnp.where(start * r ** k < b, k + 1.0, k)  # float rounding of the log at large b
    ladder = jnp.minimum(start * r ** k, jnp.maximum(top, b))
    on = (ratio > 1.0) & (b > start)
    return b + jax.lax.stop_gradient(jnp.where(on, jnp.maximum(ladder, b), b) - b)


def graph_kernel_time(eff: Efficiency, runtime: Runtime) -> jax.Array:
    """Fixed cost of one kernel replayed from a CUDA graph: graph_node_time + kernel_overhead,
    s (an eager launch costs launch_overhead + kernel_overhead)."""
    return runtime.graph_node_time + eff.kernel_overhead


def collectives_per_layer(model: Transformer, plan: InferencePlan) -> jax.Array:
    """Collective calls one layer issues per pass when tp > 1, count: its tensor-parallel
    all-reduces (`model.tp_reductions_per_pass`), or with attention data parallelism the
    gather and scatter of a MoE layer's tokens (one collective pair, counted as one, in the
    share of the layers that have experts)."""
    moe = jnp.where(model.num_experts > 1, 1.0 - model.dense_fraction, 0.0)
    calls = jnp.where(plan.attention_dp > 0, moe, model.tp_reductions_per_pass)
    return jnp.where(plan.tp > 1, calls, 0.0)


def host_scale(eff: Efficiency, accelerator: Accelerator) -> jax.Array:
    """s, the factor on every host time of an inference or serving runtime:
    `Efficiency.host_overhead` (the calibrated host speed) x `Accelerator.host_time_factor`
    (the host CPU against a DGX H100's x86 host: 2.75 on Grace), ratio."""
    return eff.host_overhead * accelerator.host_time_factor


def host_issue_time(model: Transformer, plan: InferencePlan, runtime: Runtime,
                    graph, host_overhead=1.0) -> jax.Array:
    """H: host time to issue one pass's layers (all stages), s: (1 - g) s L (n t_op + c t_coll)
    with s = `host_overhead`, the factor on every host time (`host_scale` in `infer` and the
    serving iteration; module docstring)."""
    per_layer = (runtime.ops_per_layer * runtime.host_op_time
                 + collectives_per_layer(model, plan) * runtime.host_collective_time)
    return (1.0 - graph) * host_overhead * model.layers * per_layer


def host_wait(model: Transformer, plan: InferencePlan, runtime: Runtime, gpu_time, passes,
              graph, host_overhead=1.0, seqs=0.0) -> jax.Array:
    """Time the GPU waits for the host over `passes` passes whose GPU time is `gpu_time` in
    all, s: passes s t_step + x(passes (H + s b t_seq), gpu_time) / pp with b = `seqs` the
    sequences of a pass, t_seq = `Runtime.host_seq_time` and s = `host_overhead` (`host_scale`
    in `infer`; module docstring)."""
    issue = passes * (host_issue_time(model, plan, runtime, graph, host_overhead)
                      + host_overhead * seqs * runtime.host_seq_time)
    return (passes * host_overhead * runtime.host_step_time
            + exposed_after_overlap(issue, gpu_time) / plan.pp)
