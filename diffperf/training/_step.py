"""Time, memory and utilisation of one optimizer step of distributed transformer training.

One GPU of the slowest (last) pipeline stage is modelled per micro-batch: every GEMM of a layer
with its exact local shape, the attention core, the element-wise kernels, the tensor / context /
expert parallel collectives, then the pipeline schedule (1F1B or interleaved), the data-parallel
gradient reduction and the optimizer. See `train_step`.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..costs import _collectives as coll
from .._checks import check_finite_report
from ..specs._efficiency import Efficiency, matmul_efficiency
from ..feasibility import training_reason
from ..specs._hardware import System
from ..specs._transformer import Transformer
from ..specs._attention import projections
from ..specs._training_plan import TrainingPlan
from ..costs._roofline import (bytes_per_element, exposed_after_overlap, gemm_time, op_time,
                       peak_matmul_flops)
from ._memory import (TrainingMemory, expert_params_per_gpu, params_per_gpu,
                              sharded_params_per_gpu, stored_bytes_per_layer, training_memory,
                              weight_bytes)
from ..presets import default_efficiency
from ..feasibility import MEMORY_REASONS, describe_failure
from ..specs._training_plan import layer_count_error


class TrainingReport(eqx.Module):
    """Prediction for one optimizer step. Times in s, memory in B, rates per second.

    The step time is `compute + tp_comm + cp_comm + ep_comm + pp_comm + dp_comm + bubble +
    optimizer + offload`, where the communication and offload terms are only the parts not
    hidden behind compute.
    """

    step_time: jax.Array
    compute_time: jax.Array  # GEMMs, attention, element-wise kernels incl. recomputation
    recompute_time: jax.Array  # the part of compute_time spent recomputing activations
    tp_comm_time: jax.Array  # exposed tensor-parallel all-reduces / all-gathers in the layers
    cp_comm_time: jax.Array  # exposed context-parallel K / V exchanges
    ep_comm_time: jax.Array  # exposed expert-parallel all-to-alls
    pp_comm_time: jax.Array  # exposed pipeline send/recv
    dp_comm_time: jax.Array  # exposed data-parallel gradient / parameter communication
    bubble_time: jax.Array  # pipeline fill and drain
    optimizer_time: jax.Array
    offload_time: jax.Array  # exposed activation copies to / from host memory
    memory: TrainingMemory
    fits: jax.Array  # total memory <= HBM capacity
    model_flops: jax.Array  # per step, whole job, without recomputation (MFU numerator), FLOP
    hardware_flops: jax.Array  # per step, whole job, with recomputation (HFU numerator), FLOP
    mfu: jax.Array  # model FLOPs / (step time * GPUs * dense peak at the plan's precision)
    hfu: jax.Array
    tokens_per_s: jax.Array  # whole job
    tokens_per_s_per_gpu: jax.Array
    num_gpus: jax.Array
    feasible: jax.Array  # valid plan that fits in memory
    reason: jax.Array  # 0 if feasible, else the code of the first failed check (see feasibility)


def _layer_flops_per_token(model: Transformer) -> tuple[jax.Array, jax.Array]:
    """Forward FLOPs per token of one layer: (weight GEMMs, attention core at full s x s).

    Weight GEMMs: 2 FLOPs per active weight. Attention: QK^T and AV, 2 * 2 * s * a * d per token
    (a * d = h unless the model sets `head_width`; 2 s a (d_qk + d_v) with MLA's widths;
    Megatron / Korthikanti convention: the
    causal mask is not discounted). Sliding-window layers count their causal band in the same
    convention (`Transformer.attended_keys`).
    """
    h = model.hidden
    r = model.dense_fraction  # MoE models' dense-MLP layers
    moe_mlp = (model.mlp_matrices * h * (model.experts_per_token * model.ffn_hidden
                                         + model.shared_ffn_hidden)
               + jnp.where(model.num_experts > 1, h * model.num_experts, 0.0))
    active = (model.attention_weights()
              + (1.0 - r) * moe_mlp + r * model.mlp_matrices * h * model.dense_width)
    core = 2.0 * model.attended_keys(model.seq_len) * model.heads * (model.qk_dim + model.v_dim)
    return 2.0 * active, core


def model_flops_per_step(model: Transformer, plan: TrainingPlan,
                         causal_attention: bool = False) -> jax.Array:
    """Model FLOPs of one step, whole job (forward + backward = 3x forward, no recomputation).

    For GPT (ffn 4h, MHA) this is Korthikanti's 72 B s L h^2 (1 + s/(6h) + V/(12 h L)).
    `causal_attention=True` halves the attention-core term (the convention of some vendor
    tables, e.g. Megatron-Bridge); the default counts the full s x s product (Megatron, NeMo).
    """
    gemm, attn = _layer_flops_per_token(model)
    if causal_attention:
        attn = 0.5 * attn
    per_token = 3.0 * (model.layers * (gemm + attn) + 2.0 * model.hidden * model.vocab)
    return plan.global_batch * model.seq_len * per_token


def hardware_flops_per_step(model: Transformer, plan: TrainingPlan) -> jax.Array:
    """Model FLOPs plus the recomputed forward: the whole layer (full or `recompute_layers`,
    Narayanan's Eq. 3 for full:
    96 B s L h^2 (1 + s/(6h) + V/(16 L h))) or the attention core (selective, unfused attention
    only: a flash kernel's own recomputation is part of its backward pass, not counted here)."""
    gemm, attn = _layer_flops_per_token(model)
    selective = jnp.where(plan.flash_attention > 0, 0.0, attn)  # flash: inside its backward
    full = plan.recomputed_fraction(model.layers)  # incl. `recompute_layers` (block method)
    extra = full * (gemm + attn) + (1.0 - full) * jnp.where(plan.recompute == 1, selective, 0.0)
    tokens = plan.global_batch * model.seq_len
    return model_flops_per_step(model, plan) + tokens * model.layers * extra


class _Layer(eqx.Module):
    """Per-layer, per-micro-batch times on one GPU (internal)."""

    forward: jax.Array  # GEMMs + attention + element-wise, one forward pass
    backward: jax.Array
    recompute: jax.Array
    # exposed communication (forward, backward, recompute), s
    tp_comm: jax.Array  # tensor-parallel reductions
    cp_comm: jax.Array  # context-parallel K / V exchanges
    ep_comm: jax.Array  # expert-parallel all-to-alls
    hidden: jax.Array  # communication hidden behind this layer's compute (async TP + EP), s

    @property
    def comm(self) -> jax.Array:
        """All exposed communication of the layer, s."""
        return self.tp_comm + self.cp_comm + self.ep_comm


def _tp_reduction(net, eff: Efficiency, msg, group, sp):
    """One tensor-parallel reduction of `msg` bytes over `group` ranks: (its forward cost:
    all-reduce, or reduce-scatter + all-gather with SP; SP's extra all-gather of the output
    gradient in the backward; the backward's input-gradient reduction), s."""
    ar = coll.all_reduce(net, eff, msg, group)
    rs = coll.reduce_scatter(net, eff, msg, group)
    ag = coll.all_gather(net, eff, msg, group)
    return jnp.where(sp, rs + ag, ar), jnp.where(sp, ag, 0.0), jnp.where(sp, rs, ar)


def _activation_bytes(precision) -> jax.Array:
    """Bytes per activation element: 16 bit even in fp8 / fp4 recipes, 4 in fp32 training."""
    return jnp.maximum(bytes_per_element(precision), 2.0)


def _layer_costs(model: Transformer, plan: TrainingPlan, system: System,
                 eff: Efficiency) -> _Layer:
    acc, net = system.accelerator, system.network
    p = plan.precision
    t, cp, ep = plan.tp, plan.cp, plan.ep
    ab = _activation_bytes(p)
    s = model.seq_len / cp  # local query tokens per sequence
    seq = model.seq_len  # keys each query attends to (the full sequence)
    tokens = plan.micro_batch * s
    h, f = model.hidden, model.ffn_hidden
    heads = model.heads / t
    # K / V heads the attention kernel reads (replicated when tp > kv_heads; per query head
    # with MLA) and the per-head query-key and value widths
    kv = jnp.maximum(model.attention_kv_heads / t, 1.0)
    qk, v = model.qk_dim, model.v_dim
    k_top = model.experts_per_token
    moe = model.num_experts > 1
    local_experts = model.num_experts / ep
    # Expert layers (`TrainingPlan.expert_layout`): an expert-tensor-parallel group of etp ranks
    # dispatches its tokens (each rank holds tokens / t under sequence parallelism; all of them
    # when etp = t) to the ep ranks of its experts; each local expert runs an f / etp slice.
    etp = plan.expert_layout(model)[0]
    moe_tokens = tokens * etp / t
    expert_tokens = moe_tokens * k_top * ep / model.num_experts  # tokens each local expert sees

    # Weight GEMMs, forward. Each backward GEMM (data and weight gradient) is a permutation of
    # (m, n, k) with the same FLOPs and (symmetric) efficiency: backward = 2 x forward.
    # A MoE model's dense-MLP layers (share r) run a dense MLP of width f_d instead of the
    # router, the experts and the shared expert (f_s wide, every token, not dispatched); the
    # per-layer times below are means over the layers.
    r, f_d, f_s = model.dense_fraction, model.dense_width, model.shared_ffn_hidden
    proj = [(pr, pr.share * gemm_time(acc, eff, tokens, pr.n, pr.k, p, act_bytes=ab))
            for pr in projections(model, t)]
    qkv = sum(time for pr, time in proj if not pr.is_output)  # input projections
    out_proj = sum(time for pr, time in proj if pr.is_output)
    # The routed experts' GEMMs run one cuBLAS kernel per local expert (Transformer Engine's
    # GroupedLinear, behind Megatron-core's grouped-GEMM expert MLP, launches `batch` GEMMs over
    # four streams), so each pays its own launch and tail; a fused grouped GEMM is one kernel.
    expert_kernels = jnp.where(plan.fused_expert_gemm > 0, 1.0, local_experts)
    up = lambda m, width, batch=1.0, split=t, kernels=1.0: gemm_time(  # noqa: E731
        acc, eff, m, (model.mlp_matrices - 1.0) * width / split, h, p, batch=batch, act_bytes=ab,
        kernels=kernels)
    if model.known_absent("shared_ffn_hidden"):  # the common case, kept out of sweeps' traces
        shared_up = shared_mlp = 0.0
    else:
        has, f_c = model.has_shared, model.shared_width  # f_c: f_s, finite when f_s = 0
        shared_up = has * up(tokens, f_c)
        shared_mlp = shared_up + has * gemm_time(acc, eff, tokens, h, f_c / t, p, act_bytes=ab)
    routed_up = up(expert_tokens, f, local_experts, etp, expert_kernels)
    moe_up = routed_up + shared_up  # the column-parallel GEMMs of a MoE layer's MLPs
    moe_mlp = (routed_up
               + gemm_time(acc, eff, expert_tokens, h, f / etp, p, batch=local_experts,
                           act_bytes=ab, kernels=expert_kernels)
               + jnp.where(moe, gemm_time(acc, eff, tokens, model.num_experts, h, p,
                                          act_bytes=ab), 0.0)
               + shared_mlp)
    if model.known_absent("dense_layers"):  # the common case, kept out of sweeps' traces
        dense_up = dense_mlp = 0.0
    else:
        dense_up = up(tokens, f_d)
        dense_mlp = dense_up + gemm_time(acc, eff, tokens, h, f_d / t, p, act_bytes=ab)
    mlp_up = (1.0 - r) * moe_up + r * dense_up
    gemms = qkv + out_proj + (1.0 - r) * moe_mlp + r * dense_mlp

    # Attention core: QK^T and AV over b * heads batches of (s x seq x d). A flash kernel
    # skips the blocks the causal mask (and a sliding window) leaves out; the unfused path
    # computes the whole s x seq product and masks it.
    flash = plan.flash_attention > 0
    batch_heads = plan.micro_batch * heads
    keys = model.attended_keys(seq)  # = seq without a sliding window
    core = 0.5 * (qk + v)  # = d for standard attention
    attn_flops = 4.0 * batch_heads * s * jnp.where(flash, 0.5 * keys, seq) * core
    # Fused attention runs in 16 bit even in fp8 recipes, at its own efficiency.
    attn_rate = (peak_matmul_flops(acc, jnp.minimum(p, 1.0)) * eff.attention
                 * matmul_efficiency(eff, s, keys, core, 1.0) / eff.matmul_peak)
    qkvo_bytes = tokens * (heads + kv) * (qk + v) * ab
    flash_fwd = op_time(acc, eff, attn_flops, qkvo_bytes, kernels=1.0, flops_per_s=attn_rate)
    scores = batch_heads * s * seq  # elements of the score matrix
    unfused_fwd = (
        gemm_time(acc, eff, s, seq, qk, 1.0, batch=batch_heads, act_bytes=ab)
        + gemm_time(acc, eff, s, v, seq, 1.0, batch=batch_heads, act_bytes=ab)
        # scale + mask + softmax, then dropout (writes its output and 1-byte mask)
        + op_time(acc, eff, 8.0 * scores, scores * (2 * ab + model.dropout * (2 * ab + 1)),
                  kernels=1.0 + model.dropout))
    attn_fwd = jnp.where(flash, flash_fwd, unfused_fwd)
    attn_bwd = jnp.where(flash, 2.5, 2.0) * attn_fwd  # flash backward recomputes the scores

    # Element-wise kernels: 2 layer norms, 2 bias-dropout-residual, the MLP activation. With
    # sequence parallelism the first four touch tokens / t per GPU.
    sp_div = jnp.where(plan.sequence_parallel > 0, t, 1.0)
    norm_elems = tokens * h / sp_div
    act_elems = tokens * ((1.0 - r) * (k_top * f + f_s) + r * f_d) / t
    # Two bias-dropout-residual adds (read 2, write 1, a 1-byte mask each with dropout); a
    # parallel block has one that reads the residual and both branches.
    residual_bytes = 6 * ab + 2 * model.dropout - 2 * ab * model.parallel_attention
    elem_bytes = norm_elems * (2 * 2 * ab + residual_bytes) + act_elems * ab * (
        2.0 + model.gated_mlp)
    elem_flops = norm_elems * (2 * 8 + 2 * 3) + act_elems * 8
    elem_fwd = op_time(acc, eff, elem_flops, elem_bytes, kernels=5.0)
    # Token permutation of a MoE layer (Megatron-core's all-to-all dispatcher): copy each of the
    # k routes of a token into expert order before the dispatch, regroup the received tokens by
    # local expert after it, and undo both around the combine, which then sums the k weighted
    # copies: 6 reads or writes of the k-fold tokens plus one of the result, the same again in
    # the backward pass.
    if model.known_dense():
        permute = 0.0
    else:
        routed = moe_tokens * k_top * h * ab
        permute = jnp.where(moe, (1.0 - r) * op_time(acc, eff, 0.0, 7.0 * routed, kernels=4.0),
                            0.0)

    forward = gemms + attn_fwd + elem_fwd + permute
    backward = 2.0 * gemms + attn_bwd + 2.0 * elem_fwd + permute
    # Fully recomputed layers (all with recompute = full, else `recompute_layers` per chunk) rerun
    # the forward pass; the others rerun the attention core under selective recompute without a
    # fused kernel (a flash kernel's recomputation is part of its backward).
    full = plan.recomputed_fraction(model.layers)
    recompute = full * forward + (1.0 - full) * jnp.where((plan.recompute == 1) & ~flash,
                                                          attn_fwd, 0.0)

    # Tensor parallel: 2 all-reduces (or reduce-scatter + all-gather with SP) in the forward,
    # 2 in the backward, 2 more when the whole forward is recomputed; half as many in a parallel
    # attention + MLP block (one reduction of the summed branches per pass).
    # Per pass: the attention's reduction over t and, in a sequential block, the MLP's: over t
    # too, except in the MoE layers with etp < t, where it runs over the expert-tensor-parallel
    # group on that group's tokens (plus a shared expert's over t).
    per_pass = model.tp_reductions_per_pass
    sp = plan.sequence_parallel > 0
    attn = _tp_reduction(net, eff, tokens * h * ab, t, sp)
    if model.known_dense():
        mlp = attn
    else:
        expert = _tp_reduction(net, eff, moe_tokens * h * ab, etp, sp)
        shared = model.has_shared if not model.known_absent("shared_ffn_hidden") else 0.0
        mlp = tuple(jnp.where(etp < t, r * a + (1.0 - r) * (shared * a + e), a)
                    for a, e in zip(attn, expert))
    one, sp_ag, bwd = (a + (per_pass - 1.0) * m for a, m in zip(attn, mlp))
    left = 1.0 - plan.overlap_tp * eff.tp_overlap  # what GEMM-collective overlap leaves exposed
    # Backward: the reduction of a column-parallel layer's input gradient (all-reduce, or
    # reduce-scatter with SP) can run while that layer's weight-gradient GEMM runs (Megatron's
    # asynchronous all-reduce); SP's all-gather of the output gradient stays in line.
    bwd_in_line = bwd * left
    bwd_async = jnp.where(plan.overlap_tp_backward > 0,
                          exposed_after_overlap(bwd_in_line, qkv + mlp_up), bwd_in_line)
    tp_hidden = bwd_in_line - bwd_async
    tp_comm = ((1.0 + full) * one + sp_ag) * left + bwd_async
    # Context parallel: all-gather K and V of the whole sequence (forward, recompute), reduce-
    # scatter their gradients (backward); largely hidden behind the attention core.
    kv_bytes = plan.micro_batch * seq * kv * (qk + v) * ab
    n_cp = 2.0 + full
    cp_comm = n_cp * coll.all_gather(net, eff, kv_bytes, cp, t) * (1.0 - eff.cp_overlap)
    # Expert parallel: dispatch + combine all-to-all per pass, between ranks etp apart. With
    # `overlap_ep` they run while another micro-batch computes (its forward and backward), in
    # the compute time the asynchronous TP reductions left (a window hides each transfer
    # once: with two overlaps sharing it, faster compute must never expose more than it saves).
    a2a = coll.all_to_all(net, eff, moe_tokens * k_top * h * ab, ep, etp)
    per_block = 4.0 + 2.0 * full
    ep_all = jnp.where(moe, (1.0 - r) * per_block * a2a, 0.0)
    ep_comm = jnp.where(plan.overlap_ep > 0, exposed_after_overlap(
        ep_all, forward + backward + recompute - tp_hidden), ep_all)
    return _Layer(forward, backward, recompute, tp_comm, cp_comm, ep_comm,
                  tp_hidden + ep_all - ep_comm)


def _head_time(model: Transformer, plan: TrainingPlan, system: System,
               eff: Efficiency) -> jax.Array:
    """LM head + cross-entropy (last stage) and embedding lookup (first stage) for one
    micro-batch, forward + backward, s."""
    acc = system.accelerator
    p = plan.precision
    ab = _activation_bytes(p)
    tokens = plan.micro_batch * model.seq_len / plan.cp
    v_local = model.vocab / plan.tp
    head = 3.0 * gemm_time(acc, eff, tokens, v_local, model.hidden, jnp.minimum(p, 1.0),
                           act_bytes=ab)
    logits = tokens * v_local
    loss = op_time(acc, eff, 10.0 * logits, logits * 4.0 * 3.0, kernels=3.0)  # fp32 softmax-CE
    embed = op_time(acc, eff, 0.0, 3.0 * tokens * model.hidden * ab, kernels=2.0)
    return head + loss + embed


def train_step(model: Transformer, system: System, plan: TrainingPlan,
               efficiency: Efficiency | None = None) -> TrainingReport:
    """Predict one optimizer step of `model` trained on `system` with `plan`.

    Pure JAX: works unchanged under `jit`, `vmap` (over any leaves of the four arguments) and
    `grad`. Invalid plans are not rejected here; they come back with `feasible = False` and a
    `reason` code (see `diffperf.feasibility.explain`). Use `diffperf.predict_training` for a
    checked single prediction.

    **Arguments:**

    - `model`: the transformer.
    - `system`: GPUs and network.
    - `plan`: the parallel plan.
    - `efficiency`: calibrated factors (default: the shipped `default_efficiency()`).

    **Returns:** a `TrainingReport`.
    """
    if efficiency is None:
        efficiency = default_efficiency()
    eff = efficiency
    acc, net = system.accelerator, system.network
    layer = _layer_costs(model, plan, system, eff)
    m = plan.num_micro_batches
    head = _head_time(model, plan, system, eff)

    # The slowest stage sets the steady-state pace (m micro-batches): the last one, which also
    # runs the LM head, unless `account_embedding_loss` gave it one layer fewer than the middle
    # stages and the head is cheaper than a layer.
    per_layer = layer.forward + layer.backward + layer.recompute
    # Share of a layer's compute no communication hides behind yet: a window hides each transfer
    # once, so the later window-based overlaps (offloading, then DP / ZeRO-3) get what the
    # earlier ones left, and faster compute never exposes more communication than it saves. The
    # share is the layer's average (the async TP reductions, hidden in the backward pass, shrink
    # the forward offload window too); the overlaps modelled as fixed fractions (TP GEMM-
    # collective, CP, PP) take nothing from it.
    free = jnp.maximum(1.0 - layer.hidden / per_layer, 0.0)
    layers_per_stage = plan.end_stage_layers(model.layers)
    extra = plan.middle_stage_layers(model.layers) - layers_per_stage  # 1 or 0 more mid-pipeline
    # The last stage's LM head against a middle stage's extra layer, whichever costs more (the
    # extra layer's communication is then counted as compute).
    per_mb_compute = (layers_per_stage * per_layer
                      + jnp.maximum(extra * (per_layer + layer.comm), head))
    tp_comm, cp_comm, ep_comm = (m * layers_per_stage * c
                                 for c in (layer.tp_comm, layer.cp_comm, layer.ep_comm))
    compute = m * per_mb_compute
    recompute = m * layers_per_stage * layer.recompute
    # Filling and draining the pipeline passes the other pp - 1 stages, which carry only their
    # layers.
    bubble = (plan.pp - 1.0) / plan.vp * model.layers / plan.pp * (per_layer + layer.comm)

    # Pipeline: one activation send per chunk boundary per micro-batch, each way (Megatron's
    # scatter-gather splits it over the TP group); on the critical path (v m + p - 1) times.
    ab = _activation_bytes(plan.precision)
    # Consecutive stages are tp*cp*dp ranks apart: the pipeline stays on NVLink only if all pp
    # stages fit in one domain; otherwise some boundary (the critical one) crosses the fabric.
    p2p = coll.send_recv(net, eff, plan.micro_batch * model.seq_len / plan.cp * model.hidden
                         * ab / plan.tp, plan.tp * plan.cp * plan.dp * plan.pp)
    n_p2p = jnp.where(plan.pp > 1, 2.0 * (plan.vp * m + plan.pp - 1.0), 0.0)
    pp_comm = n_p2p * p2p * (1.0 - eff.pp_overlap)

    # Activation offloading: each offloaded layer copies its activations to host memory during
    # the forward pass and back during the backward pass, each copy overlapping the compute of
    # one layer (Megatron-core's CPU offloading runs them on side streams) that the layer's
    # TP / EP overlaps left free. The offloaded bytes must fit in `host_memory` (reason 12).
    # Not modelled: GPUs that share one PCIe uplink (each gets `host_bandwidth`).
    copy = stored_bytes_per_layer(model, plan) / acc.host_bandwidth
    offloaded_share = plan.offloaded_fraction(model.layers)
    offload_per_layer = (exposed_after_overlap(copy, free * layer.forward)
                         + exposed_after_overlap(copy, free * layer.backward))
    offload = m * layers_per_stage * offloaded_share * offload_per_layer
    free_after_offload = jnp.maximum(
        free - offloaded_share * (2.0 * copy - offload_per_layer) / per_layer, 0.0)

    # Data parallel over dp * cp ranks (stride tp): gradients (`plan.gradient_bytes`) and
    # parameters (`weight_bytes`) as stored.
    n_params = params_per_gpu(model, plan)
    group = plan.dp * plan.cp
    dp_ranks = group  # the largest group that reduces gradients
    if not model.known_dense():
        # Expert weights are reduced (and ZeRO-sharded) over their own data-parallel ranks,
        # etp * ep apart.
        etp, edp = plan.expert_layout(model)
        n_exp = expert_params_per_gpu(model, plan)
        moe = (model.num_experts > 1) & (n_exp > 0)  # else one collective of them all
        dp_ranks = jnp.maximum(group, edp)

    def dp_collective(collective, bytes_per_param, *args):
        """`collective` over the ranks that hold a copy of each weight, s."""
        whole = collective(net, eff, n_params * bytes_per_param, group, plan.tp, *args)
        if model.known_dense():
            return whole
        split = (collective(net, eff, (n_params - n_exp) * bytes_per_param, group, plan.tp, *args)
                 + collective(net, eff, n_exp * bytes_per_param, edp, etp * plan.ep, *args))
        return jnp.where(moe, split, whole)

    ar = dp_collective(coll.all_reduce, plan.gradient_bytes)
    rs = dp_collective(coll.reduce_scatter, plan.gradient_bytes)
    ag = dp_collective(coll.all_gather, weight_bytes(plan))
    # ZeRO-3 / FSDP gathers and reduces one transformer layer at a time per micro-batch, or
    # (DeepSpeed) one weight matrix at a time: each is an NCCL ring paying its own latency.
    units = layers_per_stage * jnp.where(plan.zero3_per_matrix > 0, 2.0 + model.mlp_matrices,
                                         1.0)
    # DeepSpeed's per-matrix collectives run in 16 bit (its communication dtype is the model's)
    # as flat rings through each rank's own NIC (`striped = 0`, see `coll.all_gather`).
    per_matrix = plan.zero3_per_matrix > 0
    striped = 1.0 - plan.zero3_per_matrix
    gather = dp_collective(coll.all_gather, weight_bytes(plan) / units, striped)
    scatter = dp_collective(coll.reduce_scatter,
                            jnp.where(per_matrix, weight_bytes(plan), plan.gradient_bytes) / units,
                            striped)
    zero3_per_mb = units * ((2.0 + plan.recomputed_fraction(model.layers)) * gather + scatter)
    # ZeRO-2 keeps only its shard of the gradients, so under gradient accumulation every
    # micro-batch's gradients are reduce-scattered after its backward pass (DeepSpeed stage 2,
    # FSDP SHARD_GRAD_OP); ZeRO-1 (Megatron's distributed optimizer) keeps the full buffer and
    # reduce-scatters once per step.
    zero2 = plan.zero == 2
    dp_total = jnp.where(plan.zero >= 3, m * zero3_per_mb,
                         jnp.where(plan.zero >= 1, jnp.where(zero2, m, 1.0) * rs + ag, ar))
    # Gradients are reduced during the backward pass of the last micro-batch (and, with a sharded
    # optimizer, parameters are gathered during the first forward); ZeRO-3 prefetches all along.
    # With vp interleaved chunks, chunk c is done (vp - 1 - c) * pp chunk passes before the end of
    # the cool-down, so the window is ((vp - 1) * pp + 1) / vp micro-batch passes of the stage
    # (NeMo's communication-overlap guide: the DP communication is chunked per virtual stage and
    # only about one chunk stays exposed).
    # Both windows shrink to the share of the layers' compute that the layer-level overlaps
    # (async TP, EP, activation offloading) left free.
    window = jnp.minimum(((plan.vp - 1.0) * plan.pp + 1.0) / plan.vp, m)
    last_mb = window * layers_per_stage * (
        layer.backward + jnp.where(plan.zero >= 1, layer.forward, 0.0))
    # ZeRO-2's per-micro-batch reductions each overlap their own micro-batch's backward pass
    # (the parameter all-gather, once, the first forward).
    last_mb = jnp.where(zero2, layers_per_stage * (m * layer.backward + layer.forward), last_mb)
    hide = free_after_offload * jnp.where(plan.zero >= 3, eff.zero3_overlap * compute,
                                          plan.overlap_dp * eff.dp_overlap * last_mb)
    dp_comm = jnp.where(dp_ranks > 1, exposed_after_overlap(dp_total, hide), 0.0)

    # Adam on the local shard: read the gradient (g B) and the optimizer state (fp32 master, m,
    # v: `optimizer_state_bytes`, 12 B), write the state and the model weight (w B), after
    # reading the gradient once more for the clipping norm (g B); then the whole local gradient
    # buffer is zeroed for the next step (g B per parameter). With fp32 gradients and moments
    # and 16-bit weights: 34 B per shard parameter.
    shard = jnp.where(plan.zero >= 1, sharded_params_per_gpu(model, plan), n_params)
    g = plan.gradient_bytes
    state = 2.0 * plan.optimizer_state_bytes  # read + write
    optimizer = op_time(acc, eff, 14.0 * shard,
                        (state + 2.0 * g + weight_bytes(plan)) * shard + g * n_params, kernels=6.0)

    step = (compute + tp_comm + cp_comm + ep_comm + bubble + pp_comm + dp_comm + optimizer
            + offload)
    memory = training_memory(model, plan, eff)
    fits = memory.total <= acc.hbm_capacity
    n_gpus = plan.num_gpus
    peak = peak_matmul_flops(acc, plan.precision)
    mflops = model_flops_per_step(model, plan)
    hflops = hardware_flops_per_step(model, plan)
    tokens = plan.global_batch * model.seq_len
    reason = training_reason(model, plan, acc, memory.total, memory.host)
    return TrainingReport(
        step_time=step, compute_time=compute, recompute_time=recompute, tp_comm_time=tp_comm,
        cp_comm_time=cp_comm, ep_comm_time=ep_comm,
        pp_comm_time=pp_comm, dp_comm_time=dp_comm, bubble_time=bubble,
        optimizer_time=optimizer, offload_time=offload, memory=memory, fits=fits, model_flops=mflops,
        hardware_flops=hflops, mfu=mflops / (step * n_gpus * peak),
        hfu=hflops / (step * n_gpus * peak), tokens_per_s=tokens / step,
        tokens_per_s_per_gpu=tokens / step / n_gpus, num_gpus=n_gpus,
        feasible=reason == 0, reason=reason)


def predict_training(model: Transformer, system: System, plan: TrainingPlan,
                     efficiency: Efficiency | None = None) -> TrainingReport:
    """`train_step` for one configuration, checked: raises ValueError naming the fields and
    values when the plan is structurally invalid (a plan that merely does not fit in HBM or,
    with offloading, in host memory is returned with `feasible` False)."""
    batched = [n for n, leaf in (("model", model), ("system", system), ("plan", plan))
               if any(jnp.ndim(x) for x in jax.tree.leaves(leaf))]
    if batched:
        raise ValueError(f"predict_training takes one configuration, but the {batched[0]} has "
                         f"array leaves (a batch): use jax.vmap(train_step) for batches")
    problem = layer_count_error(
        float(model.layers), float(plan.pp), float(plan.vp), float(plan.recompute) == 2.0,
        float(plan.recompute_layers), float(plan.offload_layers),
        name=lambda f: f"TrainingPlan.{f}")
    if problem:
        raise ValueError(problem)
    report = _jitted_train_step(model, system, plan, efficiency)
    reason = int(jax.device_get(report.reason))
    if reason not in (0, *MEMORY_REASONS):
        raise ValueError(f"infeasible plan: {describe_failure(reason, model, plan)}")
    check_finite_report(report, "the training prediction",
                        f"seq_len={float(model.seq_len):g}, global_batch="
                        f"{float(plan.global_batch):g}, micro_batch={float(plan.micro_batch):g}")
    return report


@jax.jit
def _jitted_train_step(model, system, plan, efficiency):
    return train_step(model, system, plan, efficiency)

