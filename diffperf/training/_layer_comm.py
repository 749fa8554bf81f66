"""The communication inside one transformer layer in training: tensor-parallel reductions,
context-parallel K / V exchanges and expert-parallel all-to-alls, for one micro-batch on one
GPU, s.

Each returns the time left exposed on the critical path; the overlaps that hide a share of a
layer's compute use `exposed_after_overlap` under the rule stated in `_terms` (a window hides
each transfer once).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..costs import _collectives as coll
from ..costs._roofline import exposed_after_overlap
from ..specs._efficiency import Efficiency
from ..specs._hardware import Network
from ..specs._training_plan import TrainingPlan
from ..specs._transformer import Transformer
from ._local import activation_bytes, expert_tokens, local_tokens


def tp_reduction(net: Network, eff: Efficiency, msg, group,
                 sp) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One tensor-parallel reduction of `msg` B over `group` ranks: (its forward cost:
    all-reduce, or reduce-scatter + all-gather with SP; SP's extra all-gather of the output
    gradient in the backward; the backward's input-gradient reduction), s."""
    ar = coll.all_reduce(net, eff, msg, group)
    rs = coll.reduce_scatter(net, eff, msg, group)
    ag = coll.all_gather(net, eff, msg, group)
    return jnp.where(sp, rs + ag, ar), jnp.where(sp, ag, 0.0), jnp.where(sp, rs, ar)


def _per_block(model: Transformer, plan: TrainingPlan, attn: tuple, expert) -> tuple:
    """A quantity of one pass's TP reductions summed over the block, elementwise over the
    tuple `attn` (the attention's reduction over t): attn + (per_pass - 1) mlp, the MLP's
    reduction mlp = attn, except in the MoE layers with etp < t: r a + (1 - r) (shared a + e),
    e = `expert(etp, moe_tokens)` (the expert-tensor-parallel group's reduction)."""
    t, r = plan.tp, model.dense_fraction
    if model.known_dense():
        mlp = attn
    else:
        etp, moe_tokens = expert_tokens(model, plan)
        expert = expert(etp, moe_tokens)
        shared = model.has_shared if not model.known_absent("shared_ffn_hidden") else 0.0
        mlp = tuple(jnp.where(etp < t, r * a + (1.0 - r) * (shared * a + e), a)
                    for a, e in zip(attn, expert, strict=True))
    per_pass = model.tp_reductions_per_pass
    return tuple(a + (per_pass - 1.0) * m for a, m in zip(attn, mlp, strict=True))


def _block_reductions(model: Transformer, plan: TrainingPlan, net: Network,
                      eff: Efficiency) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The TP reductions of one pass through a block, as (forward, SP's backward all-gather,
    backward input-gradient reduction), s.

    Per pass: the attention's reduction over t and, in a sequential block, the MLP's: over t
    too, except in the MoE layers with etp < t, where it runs over the expert-tensor-parallel
    group on that group's tokens (plus a shared expert's over t). A parallel attention + MLP
    block reduces the summed branches once (`tp_reductions_per_pass`)."""
    ab = activation_bytes(plan.precision)
    sp = plan.sequence_parallel > 0
    attn = tp_reduction(net, eff, local_tokens(model, plan) * model.hidden * ab, plan.tp, sp)
    return _per_block(model, plan, attn, lambda etp, moe_tokens: tp_reduction(
        net, eff, moe_tokens * model.hidden * ab, etp, sp))


def tp_traffic(model: Transformer, plan: TrainingPlan) -> tuple[jax.Array, jax.Array]:
    """`(bytes, reductions)` of one pass's TP reductions in one layer (`_block_reductions`):
    their messages (tokens x h activations each, the full message a collective takes), B, and
    their count (only groups of more than one rank count), mean over the layers."""
    ab = activation_bytes(plan.precision)
    on = jnp.where(plan.tp > 1, 1.0, 0.0)
    attn = (on * local_tokens(model, plan) * model.hidden * ab, on)
    return _per_block(model, plan, attn, lambda etp, moe_tokens: (
        jnp.where(etp > 1, moe_tokens * model.hidden * ab, 0.0), jnp.where(etp > 1, 1.0, 0.0)))


def tp_comm(model: Transformer, plan: TrainingPlan, net: Network, eff: Efficiency,
            window) -> tuple[jax.Array, jax.Array]:
    """`(exposed, hidden)` tensor-parallel communication of one layer, s.

    2 all-reduces (or reduce-scatter + all-gather with SP) in the forward, 2 in the backward,
    2 more when the whole forward is recomputed; half as many in a parallel attention + MLP
    block. GEMM-collective overlap (`overlap_tp`) leaves 1 - e_tp_overlap of each exposed.
    Backward: the reduction of a column-parallel layer's input gradient (all-reduce, or
    reduce-scatter with SP) can run while that layer's weight-gradient GEMM runs (Megatron's
    asynchronous all-reduce, `overlap_tp_backward`): `window` is the forward time of those
    column-parallel GEMMs, s. SP's all-gather of the output gradient stays in line."""
    one, sp_ag, bwd = _block_reductions(model, plan, net, eff)
    full = plan.recomputed_fraction(model.layers)
    left = 1.0 - plan.overlap_tp * eff.tp_overlap  # what GEMM-collective overlap leaves exposed
    bwd_in_line = bwd * left
    bwd_async = jnp.where(plan.overlap_tp_backward > 0,
                          exposed_after_overlap(bwd_in_line, window), bwd_in_line)
    return ((1.0 + full) * one + sp_ag) * left + bwd_async, bwd_in_line - bwd_async


def cp_comm(model: Transformer, plan: TrainingPlan, net: Network, eff: Efficiency) -> jax.Array:
    """Exposed context-parallel communication of one layer, s: all-gather K and V of the whole
    sequence (micro_batch * seq * kv_heads/tp * (d_qk + d_v) elements) in the forward and the
    recompute, reduce-scatter their gradients in the backward; largely hidden behind the
    attention core (1 - e_cp_overlap left)."""
    n_cp = 2.0 + plan.recomputed_fraction(model.layers)
    return (n_cp * coll.all_gather(net, eff, cp_message(model, plan), plan.cp, plan.tp)
            * (1.0 - eff.cp_overlap))


def cp_message(model: Transformer, plan: TrainingPlan) -> jax.Array:
    """The K / V of the whole sequence one context-parallel all-gather produces, B:
    micro_batch * seq * max(kv_heads / tp, 1) * (d_qk + d_v) activations."""
    kv = jnp.maximum(model.attention_kv_heads / plan.tp, 1.0)
    return (plan.micro_batch * model.seq_len * kv * (model.qk_dim + model.v_dim)
            * activation_bytes(plan.precision))


#: Streaming multiprocessors an expert-parallel dispatch / combine kernel occupies while it
#: runs beside another micro-batch's compute: DeepSeek-V3's all-to-all kernels need 20 of the
#: H800's 132 SMs to saturate InfiniBand and NVLink (DeepSeek-V3 Technical Report,
#: arXiv:2412.19437, Sec. 3.2.2: "only 20 SMs are sufficient to fully utilize the bandwidths of
#: IB and NVLink"), a lower bound for NCCL's all-to-all, count.
EP_COMM_SMS = 20.0


def ep_comm(model: Transformer, plan: TrainingPlan, net: Network, eff: Efficiency,
            window, num_sms=None) -> tuple[jax.Array, jax.Array]:
    """`(exposed, total)` expert-parallel communication of one layer, s.

    A dispatch and a combine all-to-all of moe_tokens * k * h activations per pass (4 per
    forward + backward, 2 more with full recompute), between ranks etp apart, in the MoE layers
    (share 1 - r). With `overlap_ep` they run while another micro-batch computes (its forward
    and backward), in `window`: the compute time the asynchronous TP reductions left, s.

    The hidden part H is not free when `num_sms` (the GPU's SM count) is given: the
    communication kernels hold `EP_COMM_SMS` = c of the n SMs while they run, so the compute
    they overlap runs on n - c of them and takes n / (n - c) of its time. The step pays
    H c / (n - c) for it, counted as exposed EP time:

        exposed = x + (total - x) c / (n - c),   x = `exposed_after_overlap`(total, window)

    (at most `total` for c <= n / 2: overlapping never costs more than not overlapping)."""
    etp = expert_tokens(model, plan)[0]
    a2a = coll.all_to_all(net, eff, ep_message(model, plan), plan.ep, etp)
    per_block = 4.0 + 2.0 * plan.recomputed_fraction(model.layers)
    ep_all = jnp.where(model.num_experts > 1, (1.0 - model.dense_fraction) * per_block * a2a, 0.0)
    left = exposed_after_overlap(ep_all, window)
    if num_sms is not None and not model.known_dense():  # dense sweeps: nothing to hide
        left = left + (ep_all - left) * EP_COMM_SMS / (num_sms - EP_COMM_SMS)
    exposed = jnp.where(plan.overlap_ep > 0, left, ep_all)
    return exposed, ep_all


def ep_message(model: Transformer, plan: TrainingPlan) -> jax.Array:
    """What one GPU sends in one expert-parallel dispatch (or combine) all-to-all, B:
    moe_tokens * k * h activations (`expert_tokens`)."""
    return (expert_tokens(model, plan)[1] * model.experts_per_token * model.hidden
            * activation_bytes(plan.precision))
