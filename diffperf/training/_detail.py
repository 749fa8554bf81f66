"""The full breakdown of a training step: every operation of a layer and every communication
term, from the functions the step itself adds up (`_layer`, `_layer_comm`, `_terms`).

Nothing here is a second model: each operation's record is the `OpCost` the step's op
functions return (`weight_gemm_ops`, `attention_core_ops`, `elementwise_op`, `moe_permute_op`,
`moe_quantize_op`, `moe_eager_op`, `head_ops`: their `time`s are the ones `layer_costs` and
`head_time` sum), each collective's time that of the step's collective functions, and each
exposed time the `TrainingReport`'s own term. What is added is bookkeeping:

- per pass: the backward records are the forward ones scaled by the op's backward / forward
  time ratio (`OpTime`: 2 for GEMMs and element-wise kernels, 2.5 for a flash kernel, 1 for the
  MoE permutation, about (h + 2 f) / (h + f) for a gated MoE layer's fp8 casts); the
  recomputation records are `recompute_time` applied to every field, plus the modules
  selective recomputation reruns (`module_recompute_ops`) on the layers not fully recomputed.
- per communication term of the step: its link time L (the collectives' time if nothing hid
  them: the step's function with the term's overlap switched off), the part hidden H (by the
  mechanism that hides it: GEMM-collective and asynchronous overlap for TP, the fixed fractions
  e_cp / e_pp for CP and PP, the windows of `_terms` for EP, DP and offloading) and the
  exposed part E, the report's term, with H + E = L.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..costs import _collectives as coll
from ..costs._roofline import OpCost
from ..presets import resolve_efficiency
from ..specs._efficiency import Efficiency
from ..specs._hardware import System
from ..specs._runtime import Runtime
from ..specs._training_plan import TrainingPlan
from ..specs._transformer import Transformer
from ._layer import (
    _attention_core,
    _attention_time,
    _taken_path,
    _weight_gemms,
    elementwise_op,
    elementwise_time,
    head_ops,
    layer_costs,
    module_recompute_ops,
    moe_eager_op,
    moe_eager_time,
    moe_permute_op,
    moe_permute_time,
    moe_quantize_op,
    moe_quantize_time,
    recompute_time,
)
from ._layer_comm import (
    _block_reductions,
    cp_comm,
    cp_message,
    ep_comm,
    ep_message,
    tp_comm,
    tp_traffic,
)
from ._local import activation_bytes, expert_tokens
from ._memory import param_counts, stored_bytes_per_layer, weight_bytes
from ._offload import host_copy_terms
from ._step import TrainingReport, train_step
from ._terms import (
    _dp_collective,
    data_parallel_ranks,
    free_compute_share,
    local_params,
    offload_exposed,
    pipeline_p2p,
)

#: The rows of a layer pass, in the order a pass runs them (a dict's own order does not survive
#: `jax.tree` flattening, which sorts the keys). Collectives: `tp_reduction` (all-reduce, or
#: reduce-scatter + all-gather with SP; in the backward the input-gradient all-reduce or
#: reduce-scatter), `sp_all_gather` (SP's backward all-gather of the output gradient),
#: `cp_all_gather` (K / V; their gradients' reduce-scatter in the backward) and
#: `ep_all_to_all` (dispatch + combine).
LAYER_OPS = ("elementwise", "qkv", "cp_all_gather", "attention_flash", "attention_scores",
             "attention_softmax", "attention_values", "out_proj", "tp_reduction",
             "sp_all_gather", "router", "moe_permute", "ep_all_to_all", "moe_quantize", "mlp_up",
             "moe_eager", "mlp_down", "shared_up", "shared_down", "dense_up", "dense_down")
#: The collectives among `LAYER_OPS`.
LAYER_COLLECTIVES = ("cp_all_gather", "tp_reduction", "sp_all_gather", "ep_all_to_all")
#: The rows of the LM head, loss and embedding (per micro-batch, forward + backward).
HEAD_OPS = ("embedding", "lm_head", "loss")
#: The communication terms of the step (`CommTerm`), with the `TrainingReport` field each is
#: exposed in (the two DP terms share `dp_comm_time`).
#: The three `offload_*` terms share `offload_time`: activation copies
#: (`TrainingPlan.offload_layers`), weight copies (`offload_weights`) and, under ZeRO-2 / 3,
#: the offloaded optimizer share's gradients (`offload_optimizer`; see `_offload`).
COMM_TERMS = {"tp": "tp_comm_time", "cp": "cp_comm_time", "ep": "ep_comm_time",
              "pp": "pp_comm_time", "dp_gradients": "dp_comm_time",
              "dp_params": "dp_comm_time", "offload_activations": "offload_time",
              "offload_weights": "offload_time", "offload_gradients": "offload_time"}


class CommTerm(eqx.Module):
    """One communication term of a step on one GPU of the last pipeline stage.

    `link = hidden + exposed`: `link` the collectives' time if nothing hid them, `hidden` the
    part overlapped with compute, `exposed` the part on the critical path (the
    `TrainingReport` term), s per step. `calls` collective calls (or copies) per step, count;
    `bytes` their messages summed (the full message each collective takes, as in
    `diffperf.costs`: an all-reduce's whole buffer, the tensor an all-gather produces), B per
    step; `message_bytes` = bytes / calls, B (a mean where the messages differ)."""

    message_bytes: jax.Array
    calls: jax.Array
    bytes: jax.Array
    link: jax.Array
    hidden: jax.Array
    exposed: jax.Array


class TrainingDetail(eqx.Module):
    """The full breakdown of one training step (`training_detail`).

    `forward`, `backward`, `recompute`: one layer's operations in each pass (`LAYER_OPS`: the
    weight GEMMs, the attention core, the element-wise kernels, the MoE permutation and the
    TP / SP / CP / EP collectives), each an `OpCost` for one micro-batch on one GPU, mean over
    the layers (a MoE model's expert and dense-MLP operations are weighted by their share of
    the layers); a collective's `time` is its link time (before overlap), `network_bytes` its
    messages; an operation that does not occur is all zeros. `head`: the LM head, loss and
    embedding (`HEAD_OPS`) per micro-batch, forward + backward. `comm`: the step's
    communication terms (`COMM_TERMS`), each a `CommTerm`.

    Totals: `layer_flops` (FLOP), `layer_hbm_bytes` and `layer_network_bytes` (B) of one layer
    and micro-batch, all three passes; `layer_compute_time` (s) the compute operations' times
    (= `LayerTimes.compute` up to rounding); `step_flops`, `step_hbm_bytes` (the last stage's
    `layers` layers and head for `micro_batches` micro-batches; the optimizer not included)
    and `step_network_bytes` (every `comm` term) per step on that GPU.
    """

    forward: dict[str, OpCost]
    backward: dict[str, OpCost]
    recompute: dict[str, OpCost]
    head: dict[str, OpCost]
    comm: dict[str, CommTerm]
    layers: jax.Array  # L, layers of the last stage
    micro_batches: jax.Array  # m
    layer_flops: jax.Array
    layer_hbm_bytes: jax.Array
    layer_network_bytes: jax.Array
    layer_compute_time: jax.Array
    step_flops: jax.Array
    step_hbm_bytes: jax.Array
    step_network_bytes: jax.Array


def _ratio(op) -> jax.Array:
    """Backward / forward time of an `OpTime` (0 for an op that does not occur)."""
    fwd = jnp.asarray(op.forward)
    return jnp.where(fwd > 0, op.backward / jnp.where(fwd > 0, fwd, 1.0), 0.0)


def _recomputed(model: Transformer, plan: TrainingPlan, cost: OpCost,
                attention: bool) -> OpCost:
    """`recompute_time` applied to every field of a forward record (it is linear in both)."""
    return jax.tree.map(lambda x: recompute_time(model, plan, x, x if attention else 0.0), cost)


def _share(part, whole) -> jax.Array:
    """part / whole, 0 where whole is 0."""
    return jnp.where(whole > 0, part / jnp.where(whole > 0, whole, 1.0), 0.0)


def _term(nbytes, calls, link, hidden, exposed) -> CommTerm:
    return CommTerm(message_bytes=_share(nbytes, calls), calls=calls + 0.0, bytes=nbytes + 0.0,
                    link=link + 0.0, hidden=hidden + 0.0, exposed=exposed + 0.0)


def _dp_terms(model: Transformer, plan: TrainingPlan, system: System, eff: Efficiency,
              exposed) -> tuple[CommTerm, CommTerm]:
    """(gradient reduction, parameter all-gather) of the data-parallel communication.

    Each part calls the collective the step's `dp_collectives` (or `zero3_collectives` with
    ZeRO-3) calls (`_dp_collective`), so their link times sum to the step's DP communication
    (0 when no group of more than one rank reduces gradients); the exposed time `exposed` (one
    overlap window hides both) is split in proportion to the link times."""
    net, m = system.network, plan.num_micro_batches
    params = local_params(model, plan)
    n_params = params[0]
    g, w = plan.gradient_bytes, weight_bytes(plan)
    active = data_parallel_ranks(model, plan) > 1
    zero3 = plan.zero >= 3
    # collectives per reduction: one, or two when the expert weights reduce over their own group
    colls: jax.Array | float = 1.0
    if not model.known_dense():
        colls = jnp.where((model.num_experts > 1) & (params[1] > 0), 2.0, 1.0)
    # ZeRO-0..2 (`dp_collectives`)
    ar = _dp_collective(coll.all_reduce, model, plan, net, eff, params, g)
    rs = _dp_collective(coll.reduce_scatter, model, plan, net, eff, params, g)
    ag = _dp_collective(coll.all_gather, model, plan, net, eff, params, w)
    reductions = jnp.where(plan.zero == 2, m, 1.0)
    grad_link = jnp.where(plan.zero >= 1, reductions * rs, ar)
    gather_link = jnp.where(plan.zero >= 1, ag, 0.0)
    grad_calls, gather_calls = reductions * colls, jnp.where(plan.zero >= 1, colls, 0.0)
    grad_bytes, gather_bytes = reductions * n_params * g, gather_calls / colls * n_params * w
    # ZeRO-3 (`zero3_collectives`): per micro-batch and unit, (2 + f) gathers, one scatter
    per_matrix = plan.zero3_per_matrix > 0
    units = plan.end_stage_layers(model.layers) * jnp.where(per_matrix,
                                                            2.0 + model.mlp_matrices, 1.0)
    striped = 1.0 - plan.zero3_per_matrix
    scatter_width = jnp.where(per_matrix, w, g)
    z_gather = _dp_collective(coll.all_gather, model, plan, net, eff, params, w / units, striped)
    z_scatter = _dp_collective(coll.reduce_scatter, model, plan, net, eff, params,
                               scatter_width / units, striped)
    gathers = m * units * (2.0 + plan.recomputed_fraction(model.layers))
    grad_link = jnp.where(zero3, m * units * z_scatter, grad_link)
    gather_link = jnp.where(zero3, gathers * z_gather, gather_link)
    grad_calls = jnp.where(zero3, m * units * colls, grad_calls)
    gather_calls = jnp.where(zero3, gathers * colls, gather_calls)
    grad_bytes = jnp.where(zero3, m * n_params * scatter_width, grad_bytes)
    gather_bytes = jnp.where(zero3, gathers / units * n_params * w, gather_bytes)
    grad_link, gather_link = (jnp.where(active, x, 0.0) for x in (grad_link, gather_link))
    grad_calls, gather_calls = (jnp.where(active, x, 0.0) for x in (grad_calls, gather_calls))
    grad_bytes, gather_bytes = (jnp.where(active, x, 0.0) for x in (grad_bytes, gather_bytes))
    parts = grad_link + gather_link
    grad_exposed = exposed * _share(grad_link, parts)
    gather_exposed = exposed * _share(gather_link, parts)
    return (_term(grad_bytes, grad_calls, grad_link, grad_link - grad_exposed, grad_exposed),
            _term(gather_bytes, gather_calls, gather_link, gather_link - gather_exposed,
                  gather_exposed))


def training_detail(model: Transformer, system: System, plan: TrainingPlan,
                    efficiency: Efficiency | None = None,
                    runtime: Runtime | None = None) -> TrainingDetail:
    """The full breakdown of `train_step(model, system, plan, efficiency, runtime)`: per
    operation of one layer (forward, backward, recompute) its FLOPs, HBM bytes, time and
    binding resource (`OpCost.bound`), per communication term of the step its message size,
    calls, link time and hidden and exposed parts, and per layer and per step totals
    (`TrainingDetail`).

    Every number comes from the functions `train_step` adds up (module docstring), so the
    detail cannot drift from the step: each term's `exposed` is the report's term (the two DP
    terms sum to `dp_comm_time`), `hidden + exposed = link`, and a pass's operation times sum
    to `LayerTimes.forward` / `backward` / `recompute` (up to rounding).

    Pure JAX like `train_step`: works under `jit` and `vmap` (over any leaves of the
    arguments).

    **Arguments:** as `train_step`.

    **Returns:** a `TrainingDetail`.
    """
    eff = resolve_efficiency(efficiency)
    runtime = Runtime() if runtime is None else runtime
    return detail_of_report(model, system, plan, eff,
                            train_step(model, system, plan, eff, runtime))


def detail_of_report(model: Transformer, system: System, plan: TrainingPlan, eff: Efficiency,
                     report: TrainingReport) -> TrainingDetail:
    """`training_detail` from `report`, the `train_step` of the same model, system, plan and
    efficiency `eff` (not None) already computed (the command line has it: under `jit` this
    leaves the step out of the detail's program). The runtime enters only through `report`."""
    acc, net = system.accelerator, system.network
    layer = layer_costs(model, plan, system, eff)
    m, n_layers = plan.num_micro_batches, plan.end_stage_layers(model.layers)
    full = plan.recomputed_fraction(model.layers)
    sp = plan.sequence_parallel > 0

    # ---- the compute operations of a layer, forward, and their backward / recompute
    gemms, gemm_ops = _weight_gemms(model, plan, acc, eff)  # `weight_gemms`, `weight_gemm_ops`
    flash, attention = _attention_core(model, plan, acc, eff)  # `attention_core_ops` / `_time`
    kinds = [(gemm_ops, _ratio(gemms.time), False),
             (_taken_path(flash, attention), _ratio(_attention_time(flash, attention)), True),
             ({"elementwise": elementwise_op(model, plan, acc, eff)},
              _ratio(elementwise_time(model, plan, acc, eff)), False),
             ({"moe_permute": moe_permute_op(model, plan, acc, eff)},
              _ratio(moe_permute_time(model, plan, acc, eff)), False),
             ({"moe_quantize": moe_quantize_op(model, plan, acc, eff)},
              _ratio(moe_quantize_time(model, plan, acc, eff)), False),
             ({"moe_eager": moe_eager_op(model, plan, acc, eff)},
              _ratio(moe_eager_time(model, plan, acc, eff)), False)]
    forward, backward, recompute = {}, {}, {}
    for ops, ratio, is_attention in kinds:
        for name, cost in ops.items():
            forward[name] = cost
            backward[name] = ratio * cost
            recompute[name] = _recomputed(model, plan, cost, is_attention)
    # modules rerun by selective recomputation (`module_recompute_time`), on top
    for name, cost in module_recompute_ops(model, plan, acc, eff).items():
        recompute[name] = recompute[name] + (1.0 - full) * cost

    # ---- the collectives of a layer (link times, before any overlap)
    one, sp_ag, bwd = _block_reductions(model, plan, net, eff)
    tp_bytes, tp_reductions = tp_traffic(model, plan)  # one pass
    per_reduction = jnp.where(sp, 2.0, 1.0)  # calls: RS + AG with SP in the forward
    forward["tp_reduction"] = OpCost.transfer(one, per_reduction * tp_bytes)
    backward["tp_reduction"] = OpCost.transfer(bwd, tp_bytes)
    backward["sp_all_gather"] = OpCost.transfer(sp_ag, jnp.where(sp, tp_bytes, 0.0))
    forward["sp_all_gather"] = OpCost.zero()
    has_cp = jnp.where(plan.cp > 1, 1.0, 0.0)
    kv = cp_message(model, plan)
    cp_call = coll.all_gather(net, eff, kv, plan.cp, plan.tp)
    forward["cp_all_gather"] = backward["cp_all_gather"] = OpCost.transfer(cp_call, has_cp * kv)
    etp = expert_tokens(model, plan)[0]
    moe = jnp.where((model.num_experts > 1) & (plan.ep > 1), 1.0 - model.dense_fraction, 0.0)
    a2a = coll.all_to_all(net, eff, ep_message(model, plan), plan.ep, etp)
    ep_pass = moe * OpCost.transfer(2.0 * a2a, 2.0 * ep_message(model, plan))
    forward["ep_all_to_all"] = backward["ep_all_to_all"] = ep_pass
    for name in LAYER_COLLECTIVES:
        recompute[name] = full * forward[name]

    # ---- the step's communication terms
    per_step = m * n_layers
    window = gemms.qkv + gemms.mlp_up  # the async TP reductions' window (`layer_costs`)
    no_async = eqx.tree_at(lambda p: p.overlap_tp_backward, plan, 0.0 * plan.overlap_tp_backward)
    no_overlap = eqx.tree_at(lambda e: e.tp_overlap, eff, 0.0 * eff.tp_overlap)
    tp_link = tp_comm(model, no_async, net, no_overlap, window)[0]
    tp_gemm_hidden = tp_link - tp_comm(model, no_async, net, eff, window)[0]
    tp_async_hidden = tp_comm(model, plan, net, eff, window)[1]
    tp_calls = (2.0 + full) * per_reduction * tp_reductions
    comm = {"tp": _term(per_step * (2.0 + full) * per_reduction * tp_bytes, per_step * tp_calls,
                        per_step * tp_link, per_step * (tp_gemm_hidden + tp_async_hidden),
                        report.tp_comm_time)}
    cp_link = per_step * cp_comm(model, plan, net, eqx.tree_at(
        lambda e: e.cp_overlap, eff, 0.0 * eff.cp_overlap))
    cp_calls = per_step * (2.0 + full) * has_cp
    comm["cp"] = _term(cp_calls * kv, cp_calls, cp_link, cp_link * eff.cp_overlap,
                       report.cp_comm_time)
    ep_exposed, ep_all = ep_comm(model, plan, net, eff, layer.compute - (
        tp_async_hidden), system.accelerator.num_sms)  # `layer_costs`' window
    ep_calls = per_step * moe * (4.0 + 2.0 * full)
    comm["ep"] = _term(ep_calls * ep_message(model, plan), ep_calls, per_step * ep_all,
                       per_step * (ep_all - ep_exposed), report.ep_comm_time)
    pp_link = pipeline_p2p(model, plan, net, eqx.tree_at(
        lambda e: e.pp_overlap, eff, 0.0 * eff.pp_overlap))
    pp_calls = jnp.where(plan.pp > 1, 2.0 * (plan.vp * m + plan.pp - 1.0), 0.0)
    pp_message = (plan.micro_batch * model.seq_len / plan.cp * model.hidden
                  * activation_bytes(plan.precision) / plan.tp)
    comm["pp"] = _term(pp_calls * pp_message, pp_calls, pp_link, pp_link * eff.pp_overlap,
                       report.pp_comm_time)
    comm["dp_gradients"], comm["dp_params"] = _dp_terms(model, plan, system, eff,
                                                        report.dp_comm_time)
    # copies to and from host memory (`_offload.host_copy_terms`, in the step's window order:
    # activations, weights, gradients), each a copy of `size` B per layer and micro-batch
    free = free_compute_share(layer)
    counts = param_counts(model, plan)
    host = host_copy_terms(model, plan, acc, layer, free,
                           offload_exposed(model, plan, acc, layer, free), counts)
    r = plan.recomputed_fraction(model.layers)
    per_layer = {  # (copies per layer and micro-batch, bytes per copy)
        "activations": (2.0 * plan.offloaded_fraction(model.layers),
                        stored_bytes_per_layer(model, plan)),
        "weights": (plan.offload_weights * (2.0 + r),
                    counts.held_weight_bytes(plan) / n_layers),
        "gradients": (jnp.where(plan.zero >= 2, jnp.where(plan.offload_optimizer > 0, 1.0, 0.0),
                                0.0),
                      plan.offload_optimizer * counts.optimizer_shard(plan)
                      * plan.gradient_bytes / n_layers)}
    for kind, (n_copies, size) in per_layer.items():
        copies = per_step * n_copies
        exposed, hidden = host[kind]
        comm["offload_" + kind] = _term(copies * size, copies,
                                        copies * (size / acc.host_bandwidth),
                                        per_step * hidden, exposed)

    # ---- totals
    passes = (forward, backward, recompute)
    compute_names = [n for n in forward if n not in LAYER_COLLECTIVES]
    layer_flops = sum(p[n].flops for p in passes for n in forward)
    layer_hbm = sum(p[n].hbm_bytes for p in passes for n in forward)
    layer_net = sum(p[n].network_bytes for p in passes for n in forward)
    head = head_ops(model, plan, system, eff)
    order = {name: i for i, name in enumerate(LAYER_OPS)}
    ordered = {k: v for k, v in sorted(forward.items(), key=lambda kv: order[kv[0]])}
    return TrainingDetail(
        forward=ordered, backward={k: backward[k] for k in ordered},
        recompute={k: recompute[k] for k in ordered}, head=head, comm=comm,
        layers=n_layers + 0.0, micro_batches=m + 0.0,
        layer_flops=jnp.asarray(layer_flops), layer_hbm_bytes=jnp.asarray(layer_hbm),
        layer_network_bytes=jnp.asarray(layer_net),
        layer_compute_time=jnp.asarray(sum(p[n].time for p in passes for n in compute_names)),
        step_flops=m * (n_layers * layer_flops + sum(c.flops for c in head.values())),
        step_hbm_bytes=m * (n_layers * layer_hbm + sum(c.hbm_bytes for c in head.values())),
        step_network_bytes=jnp.asarray(sum(t.bytes for t in comm.values())))
