"""Weights and optimizer states in host memory: ZeRO-Offload, ZeRO-Infinity's parameter
offload, Megatron-core's optimizer CPU offload and weight offloading. (Activation offloading,
the third kind, is `_terms.offload_exposed`.)

**Optimizer offload** (`TrainingPlan.offload_optimizer` = f, the share of the optimizer states
on the host; Ren et al., "ZeRO-Offload", USENIX ATC'21, Sec. 4; Megatron-core's
`HybridDeviceOptimizer`). The GPU keeps its 16-bit weights and gradient buffers; the fp32
master weights and Adam moments of a share f of its optimizer shard live in host memory. Each
step, per offloaded shard parameter:

    gradient to the host (PCIe / C2C):   g B          over host_bandwidth
    CPU Adam (read + write the states,   2 S + g + w  over host_memory_bandwidth
      read the gradient, write the weight)   B          * CPU_ADAM_SHARE
    updated weight back to the GPU:       w B          over host_bandwidth

(S = `optimizer_state_bytes`, g = `gradient_bytes`, w = `weight_bytes`: 30 B of CPU memory
traffic with fp32 states and gradients and 16-bit weights). Both implementations split the
parameters into groups and pipeline the three streams (ZeRO-Offload's CPU-Adam copies each
tile's fp16 weights back while it computes the next; Megatron-core overlaps the copies of one
group with the CPU step of another), while the GPU steps its own share 1 - f. The optimizer
step then takes about the longest of the four streams: a smooth maximum of the GPU step and
the three host streams. CPU Adam is memory-bound (14 FLOP per 30 B); the host holds the
states and an fp32 copy of the gradient, (S + 4) B per offloaded parameter.

**Weight offload** (`TrainingPlan.offload_weights`; Rajbhandari et al., "ZeRO-Infinity", SC'21,
Sec. 5-6; Megatron-core's `cpu_offloading_weights`). The 16-bit weights the GPU holds (its
ZeRO-3 shard, else all its local weights) live in host memory. Before every pass that uses a
layer (forward, backward and, for fully recomputed layers, the recomputation) its weights are
copied in, w_l / host_bandwidth, prefetched while the previous layer computes: each copy
overlaps one layer's forward or backward (+ recompute) compute that the layer's own
communication left free, as activation copies do. HBM keeps two layers' weights (the one in
use and the one arriving). After the step the updated weights go back to host memory (the
shard an offloaded optimizer updated there already is not copied).

Not modelled: contention between these copies, activation copies and the network on a shared
PCIe switch (each GPU gets its `host_bandwidth` in each direction); DeepSpeed's one-step
delayed parameter update (which hides the CPU step behind the next step's compute); NVMe.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..costs._roofline import exposed_after_overlap, smooth_max
from ..specs._hardware import Accelerator
from ..specs._training_plan import TrainingPlan
from ..specs._transformer import Transformer
from ._layer import LayerTimes
from ._memory import ParamCounts, param_counts, stored_bytes_per_layer, weight_bytes

#: Share of the CPU's peak DRAM bandwidth that CPU Adam streams at (assumed). STREAM-like
#: kernels reach 60-80 % of a two-socket server's peak; DeepSpeed's CPU-Adam stepped an
#: 11.6 B-parameter GPT-2 in 8.2 s (DeepSpeed pull request 735, 2021: 42 GB/s at 30 B per
#: parameter, one process on a DGX-2 node), well below its 256 GB/s peak. One half is a round
#: value between the two; the offload tests bound the result, no fit.
CPU_ADAM_SHARE = 0.5


def cpu_adam_bytes(plan: TrainingPlan) -> jax.Array:
    """Host memory traffic of CPU Adam per offloaded parameter, B: read and write the
    optimizer states (2 S), read the gradient (g), write the 16-bit weight (w)."""
    return 2.0 * plan.optimizer_state_bytes + plan.gradient_bytes + weight_bytes(plan)


def weight_copy_time(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                     counts: ParamCounts) -> jax.Array:
    """One layer's weights copied from host memory, s: held weight bytes / L / host_bandwidth
    (`counts`: the GPU's `param_counts`)."""
    layers = plan.end_stage_layers(model.layers)
    return counts.held_weight_bytes(plan) / layers / acc.host_bandwidth


def weight_fetch_exposed(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                         layer: LayerTimes, free,
                         counts: ParamCounts) -> tuple[jax.Array, jax.Array]:
    """`(exposed weight-copy time per step, s; copy time hidden per layer and micro-batch,
    s)` of weight offloading (0, 0 without it).

    Per layer and micro-batch one copy c (`weight_copy_time`) before the forward pass and
    1 + r before the backward pass (r: the fully recomputed share of the layers), each
    overlapping the compute that the layer's own communication left free (share `free`):
    exposed = m L (x(c, free fwd) + x((1 + r) c, free (bwd + recompute))), x =
    `exposed_after_overlap`; hidden = (2 + r) c - those, the compute the copies occupy."""
    c = weight_copy_time(model, plan, acc, counts)
    r = plan.recomputed_fraction(model.layers)
    per_layer = (exposed_after_overlap(c, free * layer.forward)
                 + exposed_after_overlap((1.0 + r) * c, free * (layer.backward + layer.recompute)))
    on = plan.offload_weights
    exposed = on * plan.num_micro_batches * plan.end_stage_layers(model.layers) * per_layer
    return exposed, on * ((2.0 + r) * c - per_layer)


def gradient_copy_exposed(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                          layer: LayerTimes, free,
                          counts: ParamCounts) -> tuple[jax.Array, jax.Array]:
    """`(exposed gradient-copy time per step, s; copy time hidden per layer and micro-batch,
    s)` of an offloaded optimizer share under ZeRO-2 / 3 (0, 0 otherwise).

    With sharded gradients (ZeRO >= 2) the GPU keeps no buffer for the offloaded share: each
    micro-batch's reduced gradient shard goes to the host as the backward pass produces it
    (ZeRO-Offload's gradient swapping), f P g / host_bandwidth per micro-batch, spread over
    the L layers' backward passes: exposed = m L x(c / L, free bwd), hidden = c / L - x per
    layer. (ZeRO-0 / 1 keep the gradient buffer and copy it once, in the optimizer step:
    `host_optimizer_streams`.)"""
    sharded = plan.zero >= 2
    layers = plan.end_stage_layers(model.layers)
    c = (plan.offload_optimizer * counts.optimizer_shard(plan) * plan.gradient_bytes
         / acc.host_bandwidth / layers)
    per_layer = exposed_after_overlap(c, free * layer.backward)
    exposed = jnp.where(sharded, plan.num_micro_batches * layers * per_layer, 0.0)
    return exposed, jnp.where(sharded, c - per_layer, 0.0)


def host_copy_terms(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                    layer: LayerTimes, free, activations,
                    counts: ParamCounts) -> dict[str, tuple[jax.Array, jax.Array]]:
    """`{kind: (exposed time per step, s; time hidden per layer and micro-batch, s)}` of the
    copies to and from host memory, kinds `activations` (given: `_terms.offload_exposed`, which
    takes the layer's free compute first), `weights` and `gradients`: each later kind gets the
    free share the earlier ones left, max(free - hidden so far / layer compute, 0) (the
    overlap rule of `_terms`)."""
    terms = {"activations": activations}
    hidden = activations[1]
    for kind, copies in (("weights", weight_fetch_exposed),
                         ("gradients", gradient_copy_exposed)):
        left = jnp.maximum(free - hidden / layer.compute, 0.0)
        terms[kind] = copies(model, plan, acc, layer, left, counts)
        hidden = hidden + terms[kind][1]
    return terms


def host_copies_exposed(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                        layer: LayerTimes, free, activations,
                        counts: ParamCounts) -> tuple[jax.Array, jax.Array]:
    """`(exposed host-copy time per step, s; copy time hidden per layer and micro-batch, s)`
    of all three kinds of `host_copy_terms`, summed in order."""
    terms = host_copy_terms(model, plan, acc, layer, free, activations, counts)
    exposed, hidden = terms["activations"]
    for kind in ("weights", "gradients"):
        exposed, hidden = exposed + terms[kind][0], hidden + terms[kind][1]
    return exposed, hidden


def weight_write_back_bytes(plan: TrainingPlan, counts: ParamCounts) -> jax.Array:
    """Updated weights copied back to host memory after each step with weight offload, B:
    the held weights, less the ZeRO-3 shard share f that an offloaded optimizer updated in
    host memory itself; 0 without weight offload."""
    in_place = jnp.where(plan.zero >= 3, plan.offload_optimizer, 0.0)
    return plan.offload_weights * (1.0 - in_place) * counts.held_weight_bytes(plan)


def host_optimizer_streams(plan: TrainingPlan, acc: Accelerator,
                           counts: ParamCounts) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(gradients to the host, CPU Adam, weights to the GPU) per step, s, of the optimizer
    share f in host memory, plus the write-back of offloaded weights (in the first stream):

        to host = (f P g [ZeRO < 2] + W_back) / host_bandwidth
        CPU     = f P (2 S + g + w) / (host_memory_bandwidth * CPU_ADAM_SHARE)
        to GPU  = f P w (1 - [offload_weights and ZeRO-3]) / host_bandwidth

    with P the GPU's optimizer shard (`ParamCounts.optimizer_shard`) and W_back the updated
    offloaded weights the GPU writes back: the held weights, less the ZeRO-3 shard the CPU
    updated in place (f of it)."""
    f = plan.offload_optimizer
    shard = counts.optimizer_shard(plan)
    write_back = weight_write_back_bytes(plan, counts)
    gradients = jnp.where(plan.zero >= 2, 0.0, f * shard * plan.gradient_bytes)
    to_host = (gradients + write_back) / acc.host_bandwidth
    cpu = f * shard * cpu_adam_bytes(plan) / (acc.host_memory_bandwidth * CPU_ADAM_SHARE)
    keep = 1.0 - jnp.where(plan.zero >= 3, plan.offload_weights, 0.0)
    to_gpu = f * shard * weight_bytes(plan) * keep / acc.host_bandwidth
    return to_host, cpu, to_gpu


def offloaded_optimizer_time(plan: TrainingPlan, acc: Accelerator, counts: ParamCounts,
                             gpu_step) -> jax.Array:
    """The optimizer step with offloading, s: the smooth maximum of the GPU's step of its
    share (`gpu_step`) and the three host streams (`host_optimizer_streams`), which run
    pipelined; exactly `gpu_step` when nothing is offloaded."""
    to_host, cpu, to_gpu = host_optimizer_streams(plan, acc, counts)
    busiest = smooth_max(smooth_max(gpu_step, cpu), smooth_max(to_host, to_gpu))
    offloading = (plan.offload_optimizer > 0) | (plan.offload_weights > 0)
    return jnp.where(offloading, busiest, gpu_step)


def offload_traffic(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                    layer: LayerTimes, counts: ParamCounts | None = None
                    ) -> dict[str, jax.Array]:
    """What each kind of offload moves and the host bandwidth it would need to stay hidden
    (per GPU; all 0 for a kind the plan does not use): a dict of arrays.

    - `{kind}_bytes_per_step`, B, for kind activations (to the host and back), weights (in
      before every pass, and the write-back), gradients (ZeRO-2 / 3: each micro-batch's
      offloaded share; ZeRO-0 / 1: in the optimizer step), optimizer (the updated weights
      coming back);
    - `{kind}_hide_bandwidth`, B/s, for activations, weights and gradients: one copy's bytes
      over the whole forward (activations, weights) or backward (gradients) pass of a layer,
      the bandwidth at which no copy outlasts the compute it overlaps (before the layer's own
      communication takes its share);
    - `cpu_adam_s`, `to_host_s`, `to_gpu_s`: the optimizer step's host streams, s
      (`host_optimizer_streams`), which no compute hides."""
    counts = param_counts(model, plan) if counts is None else counts
    m, layers = plan.num_micro_batches, plan.end_stage_layers(model.layers)
    share = plan.offloaded_fraction(model.layers)
    stored = stored_bytes_per_layer(model, plan)
    weights = plan.offload_weights * counts.held_weight_bytes(plan)
    r = plan.recomputed_fraction(model.layers)
    f_shard = plan.offload_optimizer * counts.optimizer_shard(plan)
    sharded = plan.zero >= 2
    grad_step = f_shard * plan.gradient_bytes * jnp.where(sharded, m, 1.0)
    to_host, cpu, to_gpu = host_optimizer_streams(plan, acc, counts)
    on = lambda x: jnp.where(x > 0, 1.0, 0.0)  # noqa: E731
    return {
        "activations_bytes_per_step": 2.0 * m * layers * share * stored,
        "weights_bytes_per_step": m * (2.0 + r) * weights + weight_write_back_bytes(plan, counts),
        "gradients_bytes_per_step": grad_step,
        "optimizer_bytes_per_step": to_gpu * acc.host_bandwidth,
        "activations_hide_bandwidth": on(share) * stored / layer.forward,
        "weights_hide_bandwidth": weights / layers / layer.forward,
        "gradients_hide_bandwidth": jnp.where(sharded, f_shard * plan.gradient_bytes / layers
                                              / layer.backward, 0.0),
        "cpu_adam_s": cpu, "to_host_s": to_host, "to_gpu_s": to_gpu,
    }
