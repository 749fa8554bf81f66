"""The terms of one optimizer step, each a named function of the per-layer times (`LayerTimes`)
and the plan. Times are those of one GPU of the slowest pipeline stage, s; m =
`num_micro_batches`, L = the end stage's layers (`end_stage_layers`).

The overlap rule, stated once. Communication that may run during a compute window of duration
w is exposed by `exposed_after_overlap(total, w)`, a smooth clip(total - w, 0, total). A window
hides each transfer once: the overlaps that share a layer's compute take it in turn, each
getting what the earlier ones left, so faster compute never exposes more communication than it
saves. The order is: the asynchronous TP reductions and the EP all-to-alls inside the layer
(`LayerTimes.hidden`), then activation and weight offloading (`free_compute_share`; weights:
`_offload`), then the DP / ZeRO-3 collectives (the compute the first two left:
`dp_overlap_window`). The overlaps modelled as
fixed fractions (TP GEMM-collective, CP, PP) take nothing from the window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..costs import _collectives as coll
from ..costs._roofline import exposed_after_overlap, op_time
from ..specs._efficiency import Efficiency
from ..specs._hardware import Accelerator, Network
from ..specs._training_plan import TrainingPlan
from ..specs._transformer import Transformer
from ._layer import LayerTimes
from ._local import activation_bytes
from ._memory import (
    ParamCounts,
    expert_params_per_gpu,
    param_counts,
    params_per_gpu,
    stored_bytes_per_layer,
    weight_bytes,
)
from ._offload import offloaded_optimizer_time


def stage_compute(model: Transformer, plan: TrainingPlan, layer: LayerTimes,
                  head) -> jax.Array:
    """Compute of the slowest stage per micro-batch, s: L * layer compute + max(extra *
    (layer compute + its communication), head).

    The slowest stage sets the steady-state pace (m micro-batches): the last one, which also
    runs the LM head (`head`, s), unless `account_embedding_loss` gave it one layer fewer than
    the middle stages (extra = 1) and the head is cheaper than a layer (the extra layer's
    communication is then counted as compute)."""
    layers = plan.end_stage_layers(model.layers)
    extra = plan.middle_stage_layers(model.layers) - layers  # 1 or 0 more mid-pipeline
    return layers * layer.compute + jnp.maximum(extra * (layer.compute + layer.comm), head)


def pipeline_bubble(model: Transformer, plan: TrainingPlan, layer: LayerTimes,
                    host_wait=0.0) -> jax.Array:
    """Pipeline fill and drain, s: (pp - 1) / vp * layers / pp * (layer compute + its exposed
    communication + the GPU's wait for the host, `host_wait`). Filling and draining passes the
    other pp - 1 stages, which carry only their layers (not the LM head); interleaving vp
    chunks per stage divides it by vp."""
    return (plan.pp - 1.0) / plan.vp * model.layers / plan.pp * (
        layer.compute + layer.comm + host_wait)


def pipeline_p2p(model: Transformer, plan: TrainingPlan, net: Network,
                 eff: Efficiency) -> jax.Array:
    """Exposed pipeline send / recv, s: 2 (vp m + pp - 1) transfers of one micro-batch's
    activations (micro_batch * seq_len / cp * h B, split over the TP group by Megatron's
    scatter-gather) with 1 - e_pp_overlap exposed; 0 without pipelining.

    One activation send per chunk boundary per micro-batch, each way, on the critical path
    (v m + p - 1) times. Consecutive stages are tp*cp*dp ranks apart: the pipeline stays on
    NVLink only if all pp stages fit in one domain; otherwise some boundary (the critical one)
    crosses the fabric."""
    ab = activation_bytes(plan.precision)
    p2p = coll.send_recv(net, eff, plan.micro_batch * model.seq_len / plan.cp * model.hidden
                         * ab / plan.tp, plan.tp * plan.cp * plan.dp * plan.pp)
    n_p2p = jnp.where(plan.pp > 1, 2.0 * (plan.vp * plan.num_micro_batches + plan.pp - 1.0),
                      0.0)
    return n_p2p * p2p * (1.0 - eff.pp_overlap)


def free_compute_share(layer: LayerTimes) -> jax.Array:
    """Share of a layer's compute no communication hides behind yet: max(1 - hidden / compute,
    0). It is the layer's average (the async TP reductions, hidden in the backward pass, shrink
    the forward offload window too)."""
    return jnp.maximum(1.0 - layer.hidden / layer.compute, 0.0)


def offload_exposed(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                    layer: LayerTimes, free) -> tuple[jax.Array, jax.Array]:
    """`(exposed offload time per step, s; offload copy time hidden per layer and micro-batch,
    s)`.

    Each offloaded layer copies its activations (`stored_bytes_per_layer`) to host memory
    during the forward pass and back during the backward pass, c = bytes / host_bandwidth
    each, each copy overlapping the compute of one layer (Megatron-core's CPU offloading runs
    them on side streams) that the layer's TP / EP overlaps left free (share `free`):
    exposed = m L o (x(c, free fwd) + x(c, free bwd)), o the offloaded share of the layers and
    x = `exposed_after_overlap`; hidden = o (2 c - x(c, free fwd) - x(c, free bwd)), the layer
    compute the copies occupy (averaged over the layers), which the DP window then cannot use.
    The offloaded bytes must fit in `host_memory` (reason 12). Not modelled: GPUs that share
    one PCIe uplink (each gets `host_bandwidth`)."""
    copy = stored_bytes_per_layer(model, plan) / acc.host_bandwidth
    share = plan.offloaded_fraction(model.layers)
    per_layer = (exposed_after_overlap(copy, free * layer.forward)
                 + exposed_after_overlap(copy, free * layer.backward))
    exposed = plan.num_micro_batches * plan.end_stage_layers(model.layers) * share * per_layer
    return exposed, share * (2.0 * copy - per_layer)


def data_parallel_ranks(model: Transformer, plan: TrainingPlan) -> jax.Array:
    """The largest group that reduces gradients: dp * cp ranks, or the expert weights' own
    data-parallel group (edp) if larger, count."""
    group = plan.dp * plan.cp
    if model.known_dense():
        return group
    return jnp.maximum(group, plan.expert_layout(model)[1])


def local_params(model: Transformer, plan: TrainingPlan) -> tuple[jax.Array, jax.Array]:
    """(parameters, expert parameters) one GPU holds before ZeRO sharding (`params_per_gpu`,
    `expert_params_per_gpu`), count: computed once per step for the DP collectives and the
    optimizer."""
    if model.known_dense():
        return params_per_gpu(model, plan), 0.0
    return params_per_gpu(model, plan), expert_params_per_gpu(model, plan)


def _dp_collective(collective, model: Transformer, plan: TrainingPlan, net: Network,
                   eff: Efficiency, params, bytes_per_param, *args) -> jax.Array:
    """`collective` of `bytes_per_param` B per local parameter (`params`: `local_params`) over
    the ranks that hold a copy of each weight, s: dp * cp ranks (stride tp) for the dense
    weights; expert weights are reduced (and ZeRO-sharded) over their own data-parallel ranks,
    etp * ep apart."""
    n_params, n_exp = params
    group = plan.dp * plan.cp
    whole = collective(net, eff, n_params * bytes_per_param, group, plan.tp, *args)
    if model.known_dense():
        return whole
    etp, edp = plan.expert_layout(model)
    split = (collective(net, eff, (n_params - n_exp) * bytes_per_param, group, plan.tp, *args)
             + collective(net, eff, n_exp * bytes_per_param, edp, etp * plan.ep, *args))
    moe = (model.num_experts > 1) & (n_exp > 0)  # else one collective of them all
    return jnp.where(moe, split, whole)


def dp_collectives(model: Transformer, plan: TrainingPlan, net: Network, eff: Efficiency,
                   params) -> jax.Array:
    """Data-parallel communication of one step without ZeRO-3, before overlap, s.

    Gradients (`plan.gradient_bytes` per parameter) and parameters (`weight_bytes`) as stored.
    ZeRO-0: one gradient all-reduce. ZeRO-1 (Megatron's distributed optimizer) keeps the full
    gradient buffer and reduce-scatters once per step, then all-gathers the updated
    parameters. ZeRO-2 keeps only its shard of the gradients, so under gradient accumulation
    every micro-batch's gradients are reduce-scattered after its backward pass (DeepSpeed
    stage 2, FSDP SHARD_GRAD_OP): m reduce-scatters + one all-gather. `params`:
    `local_params(model, plan)`."""
    ar = _dp_collective(coll.all_reduce, model, plan, net, eff, params, plan.gradient_bytes)
    rs = _dp_collective(coll.reduce_scatter, model, plan, net, eff, params, plan.gradient_bytes)
    ag = _dp_collective(coll.all_gather, model, plan, net, eff, params, weight_bytes(plan))
    reduce_scatters = jnp.where(plan.zero == 2, plan.num_micro_batches, 1.0)
    return jnp.where(plan.zero >= 1, reduce_scatters * rs + ag, ar)


def zero3_collectives(model: Transformer, plan: TrainingPlan, net: Network, eff: Efficiency,
                      params) -> jax.Array:
    """ZeRO-3 / FSDP communication of one step, before overlap, s: per micro-batch and unit,
    (2 + recomputed share) parameter all-gathers (forward, backward, recompute) and one
    gradient reduce-scatter.

    ZeRO-3 / FSDP gathers and reduces one transformer layer at a time per micro-batch, or
    (DeepSpeed, `zero3_per_matrix`) one weight matrix at a time: each unit is an NCCL ring
    paying its own latency. DeepSpeed's per-matrix collectives run in 16 bit (its
    communication dtype is the model's) as flat rings through each rank's own NIC
    (`striped = 0`, see `coll.all_gather`). `params`: `local_params(model, plan)`."""
    units = plan.end_stage_layers(model.layers) * jnp.where(
        plan.zero3_per_matrix > 0, 2.0 + model.mlp_matrices, 1.0)
    per_matrix = plan.zero3_per_matrix > 0
    striped = 1.0 - plan.zero3_per_matrix
    gather = _dp_collective(coll.all_gather, model, plan, net, eff, params,
                            weight_bytes(plan) / units, striped)
    scatter = _dp_collective(
        coll.reduce_scatter, model, plan, net, eff, params,
        jnp.where(per_matrix, weight_bytes(plan), plan.gradient_bytes) / units, striped)
    per_micro_batch = units * ((2.0 + plan.recomputed_fraction(model.layers)) * gather
                               + scatter)
    return plan.num_micro_batches * per_micro_batch


def dp_overlap_window(model: Transformer, plan: TrainingPlan, eff: Efficiency,
                      layer: LayerTimes, compute, offload_hidden) -> jax.Array:
    """Compute time that can hide the data-parallel communication, s.

    ZeRO-3 prefetches all along, during the whole step's `compute` less what the layer-level
    overlaps already occupy (each layer's hidden TP / EP communication, at most its compute,
    and `offload_hidden`, the offload copies hidden per layer and micro-batch:
    `offload_exposed`), times e_zero3_overlap:

        w = e_zero3 * max(compute - m L (min(hidden, layer compute) + offload_hidden), 0)

    Subtracting these as times, not as a share of `compute`, matters: `compute` includes the
    LM head, which hides no layer communication, and a share of it taken by the layers' overlaps
    made the window shrink faster than compute when compute got faster (issue 41 item 3: 4x
    FLOP/s up to 0.5 % slower, a 4x lower launch overhead up to 1.1 %, with ZeRO-3 + offload).

    Otherwise (with `overlap_dp`) gradients are reduced during the backward pass of the last
    micro-batch (and, with a sharded optimizer, parameters are gathered during the first
    forward): with vp interleaved chunks, chunk c is done (vp - 1 - c) * pp chunk passes before
    the end of the cool-down, so the window is w = min(((vp - 1) pp + 1) / vp, m) micro-batch
    passes of the stage, e_dp_overlap * w * L * (backward [+ forward]) (NeMo's
    communication-overlap guide: the DP communication is chunked per virtual stage and only
    about one chunk stays exposed). ZeRO-2's per-micro-batch reductions each overlap their own
    micro-batch's backward pass (the parameter all-gather, once, the first forward):
    L (m backward + forward). These windows hold layers only; each shrinks to the share of
    the layers' compute that the layer-level overlaps left free,
    max(1 - (hidden + offload_hidden) / layer compute, 0)."""
    m = plan.num_micro_batches
    layers = plan.end_stage_layers(model.layers)
    used = jnp.minimum(layer.hidden, layer.compute) + offload_hidden  # per layer, s
    passes = jnp.minimum(((plan.vp - 1.0) * plan.pp + 1.0) / plan.vp, m)
    last_mb = passes * layers * (
        layer.backward + jnp.where(plan.zero >= 1, layer.forward, 0.0))
    last_mb = jnp.where(plan.zero == 2, layers * (m * layer.backward + layer.forward), last_mb)
    free = jnp.maximum(1.0 - used / layer.compute, 0.0)
    zero3 = eff.zero3_overlap * jnp.maximum(compute - m * layers * used, 0.0)
    return jnp.where(plan.zero >= 3, zero3, free * plan.overlap_dp * eff.dp_overlap * last_mb)


def dp_exposed(model: Transformer, plan: TrainingPlan, total, window) -> jax.Array:
    """Data-parallel communication left exposed, s: `exposed_after_overlap(total, window)`,
    0 when no group of more than one rank reduces gradients."""
    return jnp.where(data_parallel_ranks(model, plan) > 1, exposed_after_overlap(total, window),
                     0.0)


def optimizer_time(model: Transformer, plan: TrainingPlan, acc: Accelerator, eff: Efficiency,
                   params, counts: ParamCounts | None = None) -> jax.Array:
    """Adam on the local shard, s: 14 FLOP per shard parameter, (2 state + 2 g + w) B per shard
    parameter + g B per local parameter, 6 kernels.

    Read the gradient (g B) and the optimizer state (fp32 master, m, v:
    `optimizer_state_bytes`, 12 B), write the state and the model weight (w B), after reading
    the gradient once more for the clipping norm (g B); then the whole local gradient buffer is
    zeroed for the next step (g B per parameter). With fp32 gradients and moments and 16-bit
    weights: 34 B per shard parameter. `params`: `local_params(model, plan)`; `counts`: the
    plan's `param_counts` if already computed.

    With optimizer offload (a share f of the states in host memory) the GPU steps the rest,
    (1 - f) of the shard, while the host streams of `_offload` run: the step takes the
    smooth maximum of the two (`offloaded_optimizer_time`)."""
    n_params = params[0]
    counts = param_counts(model, plan, n_params) if counts is None else counts
    shard = counts.optimizer_shard(plan)
    on_gpu = (1.0 - plan.offload_optimizer) * shard
    g = plan.gradient_bytes
    state = 2.0 * plan.optimizer_state_bytes  # read + write
    gpu = op_time(acc, eff, 14.0 * on_gpu,
                  (state + 2.0 * g + weight_bytes(plan)) * on_gpu + g * n_params, kernels=6.0)
    return offloaded_optimizer_time(plan, acc, counts, gpu)
