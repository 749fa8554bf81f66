"""The operations of one transformer layer in training: one micro-batch on one GPU of the last
pipeline stage, each op a named function.

Every op returns an `OpTime` (its forward and backward pass, s): the weight GEMMs with their
exact local shapes (`weight_gemms`, a `LayerGemms` whose `time` is one), the attention core
(`attention_core_time`), the element-wise kernels (`elementwise_time`) and a MoE layer's token
permutation (`moe_permute_time`), fp8 casts of its routed tokens (`moe_quantize_time`) and the
eager work around biased or clamped experts (`moe_eager_time`).
`layer_costs` sums them, adds the recomputation (`recompute_time`) and the exposed tensor /
context / expert parallel communication of `_layer_comm`, and returns a `LayerTimes`.
`head_time` is the LM head, loss and embedding outside the layers.

The times are the `time` of each kernel's `OpCost` record (FLOPs, bytes, the time of each
resource: `costs.op_cost`, `costs.gemm_cost`); `weight_gemm_ops`, `attention_core_ops`,
`elementwise_op`, `moe_permute_op`, `moe_quantize_op`, `moe_eager_op` and `head_ops` return
those records,
which `_detail.training_detail` reports per operation.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._checks import is_concrete
from ..costs._attention import fused_attention_rate
from ..costs._gemm import gemm_cost
from ..costs._roofline import OpCost, op_cost
from ..specs._attention import projections
from ..specs._efficiency import Efficiency
from ..specs._hardware import Accelerator, System
from ..specs._training_plan import TrainingPlan
from ..specs._transformer import Transformer
from ._layer_comm import cp_comm, ep_comm, tp_comm
from ._local import activation_bytes, expert_tokens, local_tokens


class OpTime(eqx.Module):
    """Time of one operation of a layer for one micro-batch on one GPU, s."""

    forward: jax.Array
    backward: jax.Array


class LayerGemms(eqx.Module):
    """Forward times of a layer's weight GEMMs, one micro-batch, one GPU, s.

    A MoE model's dense-MLP layers (share r = `dense_share`) run a dense MLP instead of the
    router, the experts and the shared expert; `mlp_up` and `time` are means over the layers:
    (1 - r) MoE + r dense."""

    qkv: jax.Array  # the attention's input projections
    out_proj: jax.Array  # the attention's output projection
    moe_mlp: jax.Array  # a MoE layer's MLP GEMMs: router, experts, shared expert
    moe_up: jax.Array  # the column-parallel ones among them (up / gate projections)
    dense_mlp: jax.Array  # a dense-MLP layer's GEMMs (0 without such layers)
    dense_up: jax.Array  # the column-parallel ones among them
    dense_share: jax.Array  # r

    @property
    def mlp_up(self) -> jax.Array:
        """The column-parallel MLP GEMMs, mean over the layers, s."""
        return (1.0 - self.dense_share) * self.moe_up + self.dense_share * self.dense_up

    @property
    def time(self) -> OpTime:
        """All of them, forward and backward. Each backward GEMM (data and weight gradient) is
        a permutation of (m, n, k) with the same FLOPs and (symmetric) efficiency: backward =
        2 x forward."""
        r = self.dense_share
        forward = self.qkv + self.out_proj + (1.0 - r) * self.moe_mlp + r * self.dense_mlp
        return OpTime(forward, 2.0 * forward)


class LayerTimes(eqx.Module):
    """Per-layer, per-micro-batch times on one GPU, s."""

    forward: jax.Array  # GEMMs + attention + element-wise, one forward pass
    backward: jax.Array
    recompute: jax.Array
    # exposed communication (forward, backward, recompute), s
    tp_comm: jax.Array  # tensor-parallel reductions
    cp_comm: jax.Array  # context-parallel K / V exchanges
    ep_comm: jax.Array  # expert-parallel all-to-alls
    hidden: jax.Array  # communication hidden behind this layer's compute (async TP + EP), s

    @property
    def compute(self) -> jax.Array:
        """Forward + backward + recomputation, s."""
        return self.forward + self.backward + self.recompute

    @property
    def comm(self) -> jax.Array:
        """All exposed communication of the layer, s."""
        return self.tp_comm + self.cp_comm + self.ep_comm


def _attention_projections(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                           eff: Efficiency) -> tuple[OpCost, OpCost]:
    """(input projections, output projection) forward `OpCost`s: each projection's local
    (tokens x k) @ (k x n) GEMM (`specs.projections`), weighted by its share of the layers."""
    p, ab = plan.precision, activation_bytes(plan.precision)
    tokens = local_tokens(model, plan)
    proj = [(pr, pr.share * gemm_cost(acc, eff, tokens, pr.n, pr.k, p, act_bytes=ab))
            for pr in projections(model, plan.tp)]
    qkv = sum(cost for pr, cost in proj if not pr.is_output)
    out_proj = sum(cost for pr, cost in proj if pr.is_output)
    return qkv, out_proj


def _up_projection(model: Transformer, plan: TrainingPlan, acc: Accelerator, eff: Efficiency,
                   m, width, batch=1.0, split=None, kernels=1.0, k_loop=False) -> OpCost:
    """Forward `OpCost` of the column-parallel GEMM(s) of an MLP of inner width `width` split
    over `split` ranks (default tp): (m x h) @ (h x (mlp_matrices - 1) width / split), `batch`
    of them in `kernels` launches (`k_loop`: see `costs.gemm_cost`)."""
    split = plan.tp if split is None else split
    ab = activation_bytes(plan.precision)
    return gemm_cost(acc, eff, m, (model.mlp_matrices - 1.0) * width / split, model.hidden,
                     plan.precision, batch=batch, act_bytes=ab, kernels=kernels, k_loop=k_loop)


def _moe_mlp(model: Transformer, plan: TrainingPlan, acc: Accelerator,
             eff: Efficiency) -> tuple[jax.Array, jax.Array, dict[str, OpCost]]:
    """(column-parallel GEMMs, all GEMMs, each GEMM's `OpCost`: `router`, `mlp_up`,
    `mlp_down`, `shared_up`, `shared_down`) of a MoE layer's MLPs, forward, s: the router
    (tokens x h) @ (h x E), the local experts' up and down projections at the tokens each
    sees, tokens * etp / t * k * ep / E, and a shared expert (f_s wide, every token, not
    dispatched)."""
    p, t, ab = plan.precision, plan.tp, activation_bytes(plan.precision)
    h, f = model.hidden, model.ffn_hidden
    tokens = local_tokens(model, plan)
    etp, moe_tokens = expert_tokens(model, plan)
    local_experts = model.num_experts / plan.ep
    per_expert = moe_tokens * model.experts_per_token * plan.ep / model.num_experts
    # The routed experts' GEMMs run one cuBLAS kernel per local expert (Transformer Engine's
    # GroupedLinear, behind Megatron-core's grouped-GEMM expert MLP, launches `batch` GEMMs over
    # four streams), so each pays its own launch and tail; a fused grouped GEMM is one kernel.
    expert_kernels = jnp.where(plan.fused_expert_gemm > 0, 1.0, local_experts)
    if model.known_absent("shared_ffn_hidden"):  # the common case, kept out of sweeps' traces
        shared_up = shared_down = OpCost.zero()
        shared_mlp = 0.0
    else:
        has, f_c = model.has_shared, model.shared_width  # f_c: f_s, finite when f_s = 0
        shared_up = has * _up_projection(model, plan, acc, eff, tokens, f_c)
        shared_down = has * gemm_cost(acc, eff, tokens, h, f_c / t, p, act_bytes=ab)
        shared_mlp = shared_up.time + shared_down.time
    # The routed experts' GEMMs pay the fp8 k loop's fixed cost per tile (`costs.k_loop_loss`:
    # DeepGEMM's grouped FP8 GEMMs), which narrow experts (k = f / etp down to 768) feel most;
    # a dense model's MLP (its one expert) keeps the dense GEMMs' fitted size loss.
    routed = False if model.known_dense() else model.num_experts > 1  # out of dense traces
    routed_up = _up_projection(model, plan, acc, eff, per_expert, f, local_experts, etp,
                               expert_kernels, k_loop=routed)
    router = gemm_cost(acc, eff, tokens, model.num_experts, h, p, act_bytes=ab).where(
        model.num_experts > 1)
    routed_down = gemm_cost(acc, eff, per_expert, h, f / etp, p, batch=local_experts,
                            act_bytes=ab, kernels=expert_kernels, k_loop=routed)
    mlp = (routed_up.time
           + routed_down.time
           + router.time
           + shared_mlp)
    ops = {"router": router, "mlp_up": routed_up, "mlp_down": routed_down,
           "shared_up": shared_up, "shared_down": shared_down}
    return routed_up.time + shared_up.time, mlp, ops


def _dense_mlp(model: Transformer, plan: TrainingPlan, acc: Accelerator,
               eff: Efficiency) -> tuple[jax.Array, jax.Array, dict[str, OpCost]]:
    """(column-parallel GEMMs, all GEMMs, the `OpCost`s `dense_up`, `dense_down`) of a MoE
    model's dense-MLP layers (f_d wide), forward, s; zero when the model has none."""
    if model.known_absent("dense_layers"):  # the common case, kept out of sweeps' traces
        return 0.0, 0.0, {"dense_up": OpCost.zero(), "dense_down": OpCost.zero()}
    tokens, f_d = local_tokens(model, plan), model.dense_width
    up = _up_projection(model, plan, acc, eff, tokens, f_d)
    down = gemm_cost(acc, eff, tokens, model.hidden, f_d / plan.tp, plan.precision,
                     act_bytes=activation_bytes(plan.precision))
    return up.time, up.time + down.time, {"dense_up": up, "dense_down": down}


def _weight_gemms(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                  eff: Efficiency) -> tuple[LayerGemms, dict[str, OpCost]]:
    """`weight_gemms` and `weight_gemm_ops` from one evaluation of the GEMMs."""
    qkv, out_proj = _attention_projections(model, plan, acc, eff)
    moe_up, moe_mlp, moe_ops = _moe_mlp(model, plan, acc, eff)
    dense_up, dense_mlp, dense_ops = _dense_mlp(model, plan, acc, eff)
    r = model.dense_fraction
    gemms = LayerGemms(qkv=qkv.time, out_proj=out_proj.time, moe_mlp=moe_mlp, moe_up=moe_up,
                       dense_mlp=dense_mlp, dense_up=dense_up, dense_share=r)
    ops = ({"qkv": qkv, "out_proj": out_proj}
           | {name: (1.0 - r) * cost for name, cost in moe_ops.items()}
           | {name: r * cost for name, cost in dense_ops.items()})
    return gemms, ops


def weight_gemms(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                 eff: Efficiency) -> LayerGemms:
    """The weight GEMMs of one layer, forward, each with its local shape, s: the attention
    projections, a MoE layer's MLP GEMMs and those of a MoE model's dense-MLP layers (width
    f_d, share r of the layers)."""
    return _weight_gemms(model, plan, acc, eff)[0]


def weight_gemm_ops(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                    eff: Efficiency) -> dict[str, OpCost]:
    """The `OpCost` of each weight GEMM of `weight_gemms`, forward, one micro-batch, one GPU,
    weighted by its share of the layers (mean over the layers): `qkv` (the attention's input
    projections), `out_proj`; in the MoE layers (weight 1 - r; a dense model's MLP is its one
    expert) `router`, `mlp_up` (the column-parallel up / gate projections), `mlp_down`,
    `shared_up`, `shared_down`; in a MoE model's dense-MLP layers (weight r) `dense_up`,
    `dense_down`. Their times sum to `LayerGemms.time.forward` (up to rounding)."""
    return _weight_gemms(model, plan, acc, eff)[1]


def attention_core_time(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                        eff: Efficiency) -> OpTime:
    """QK^T and AV over b * heads / tp batches of (s/cp x seq x d), s.

    A flash kernel skips the blocks the causal mask (and a sliding window) leaves out:
    4 b a s keys d / 2 FLOPs at `fused_attention_rate`, reading Q, K, V and writing the output
    once; its backward (2.5 x forward) recomputes the scores. The unfused path computes the
    whole s x seq product as two batched GEMMs plus a scale + mask + softmax (+ dropout)
    kernel over the score matrix; backward 2 x forward."""
    return _attention_time(*_attention_core(model, plan, acc, eff))


def _attention_time(flash, ops: dict[str, OpCost]) -> OpTime:
    """`attention_core_time` from `_attention_core`'s records."""
    unfused_fwd = (ops["attention_scores"].time + ops["attention_values"].time
                   + ops["attention_softmax"].time)
    forward = jnp.where(flash, ops["attention_flash"].time, unfused_fwd)
    return OpTime(forward, jnp.where(flash, 2.5, 2.0) * forward)


def attention_core_ops(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                       eff: Efficiency) -> dict[str, OpCost]:
    """The forward `OpCost`s of `attention_core_time`'s kernels: `attention_flash` (the fused
    kernel) or the unfused `attention_scores` (QK^T), `attention_softmax` (scale + mask +
    softmax + dropout) and `attention_values` (AV); the path not taken is zero."""
    return _taken_path(*_attention_core(model, plan, acc, eff))


def _taken_path(flash, ops: dict[str, OpCost]) -> dict[str, OpCost]:
    """`_attention_core`'s records with the path not taken zeroed."""
    return {name: cost.where(flash if name == "attention_flash" else ~flash)
            for name, cost in ops.items()}


def _attention_core(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                    eff: Efficiency) -> tuple[jax.Array, dict[str, OpCost]]:
    """(flash?, the forward `OpCost`s of both paths of `attention_core_time`)."""
    p, ab = plan.precision, activation_bytes(plan.precision)
    s = model.seq_len / plan.cp  # local query tokens per sequence
    seq = model.seq_len  # keys each query attends to (the full sequence)
    heads = model.heads / plan.tp
    # K / V heads the attention kernel reads (replicated when tp > kv_heads; per query head
    # with MLA) and the per-head query-key and value widths
    kv = jnp.maximum(model.attention_kv_heads / plan.tp, 1.0)
    qk, v = model.qk_dim, model.v_dim
    flash = plan.flash_attention > 0
    batch_heads = plan.micro_batch * heads
    keys = model.attended_keys(seq)  # = seq without a sliding window
    core = 0.5 * (qk + v)  # = d for standard attention
    attn_flops = 4.0 * batch_heads * s * jnp.where(flash, 0.5 * keys, seq) * core
    # Fused attention runs in 16 bit even in fp8 recipes, at its own efficiency.
    attn_rate = fused_attention_rate(acc, eff, p, s, keys, core)
    qkvo_bytes = local_tokens(model, plan) * (heads + kv) * (qk + v) * ab
    flash_fwd = op_cost(acc, eff, attn_flops, qkvo_bytes, kernels=1.0, flops_per_s=attn_rate)
    scores = batch_heads * s * seq  # elements of the score matrix
    # The unfused products run at the plan's precision, at most 16 bit (fp8 / fp4 recipes keep
    # attention in 16 bit; an fp32 run multiplies in fp32: at the bf16 rate, V100 fp32 runs
    # reached an MFU of 190 %, issue 41 item 6).
    p16 = jnp.minimum(p, 1.0)
    return flash, {
        "attention_flash": flash_fwd,
        "attention_scores": gemm_cost(acc, eff, s, seq, qk, p16, batch=batch_heads,
                                      act_bytes=ab),
        "attention_values": gemm_cost(acc, eff, s, v, seq, p16, batch=batch_heads,
                                      act_bytes=ab),
        # scale + mask + softmax, then dropout (writes its output and 1-byte mask)
        "attention_softmax": op_cost(
            acc, eff, 8.0 * scores, scores * (2 * ab + model.dropout * (2 * ab + 1)),
            kernels=1.0 + model.dropout)}


def elementwise_time(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                     eff: Efficiency) -> OpTime:
    """Element-wise kernels (`elementwise_op`), forward and backward = 2 x forward, s."""
    forward = elementwise_op(model, plan, acc, eff).time
    return OpTime(forward, 2.0 * forward)


def elementwise_op(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                   eff: Efficiency) -> OpCost:
    """Element-wise kernels: 2 layer norms, 2 bias-dropout-residual adds, the MLP activation,
    5 kernels, forward `OpCost`. With sequence parallelism the first four touch tokens / t per
    GPU."""
    ab = activation_bytes(plan.precision)
    h, r, t = model.hidden, model.dense_fraction, plan.tp
    tokens = local_tokens(model, plan)
    sp_div = jnp.where(plan.sequence_parallel > 0, t, 1.0)
    norm_elems = tokens * h / sp_div
    act_elems = tokens * ((1.0 - r) * (model.experts_per_token * model.ffn_hidden
                                       + model.shared_ffn_hidden) + r * model.dense_width) / t
    # Two bias-dropout-residual adds (read 2, write 1, a 1-byte mask each with dropout); a
    # parallel block has one that reads the residual and both branches.
    residual_bytes = 6 * ab + 2 * model.dropout - 2 * ab * model.parallel_attention
    elem_bytes = norm_elems * (2 * 2 * ab + residual_bytes) + act_elems * ab * (
        2.0 + model.gated_mlp)
    elem_flops = norm_elems * (2 * 8 + 2 * 3) + act_elems * 8
    return op_cost(acc, eff, elem_flops, elem_bytes, kernels=5.0)


def moe_permute_time(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                     eff: Efficiency) -> OpTime:
    """Token permutation of a MoE layer (Megatron-core's all-to-all dispatcher), s.

    Copy each of the k routes of a token into expert order before the dispatch, regroup the
    received tokens by local expert after it, and undo both around the combine, which then
    sums the k weighted copies: 6 reads or writes of the k-fold tokens plus one of the result
    (7 moe_tokens k h bytes in 4 kernels), the same again in the backward pass."""
    if model.known_dense():
        return OpTime(0.0, 0.0)
    permute = moe_permute_op(model, plan, acc, eff).time
    return OpTime(permute, permute)


def moe_permute_op(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                   eff: Efficiency) -> OpCost:
    """The forward `OpCost` of `moe_permute_time` (mean over the layers: 1 - r of them)."""
    if model.known_dense():
        return OpCost.zero()
    routed = expert_tokens(model, plan)[1] * model.experts_per_token * model.hidden * (
        activation_bytes(plan.precision))
    return ((1.0 - model.dense_fraction) * op_cost(
        acc, eff, 0.0, 7.0 * routed, kernels=4.0)).where(model.num_experts > 1)


#: Bytes per element of an fp8 / fp4 cast of a 16-bit GEMM input: read 2, write the row-wise
#: and the column-wise quantised copies (1 B each; their block scales are 1/32 B more and left
#: out). Transformer Engine quantises each GEMM operand twice because the weight-gradient GEMM
#: reduces over the token dimension: MXFP8's 1 x 32 scaling blocks run along the reduction
#: dimension, so the transposed use needs its own copy (the fp8 current-scaling and blockwise
#: recipes write a transposed copy the same way).
FP8_CAST_BYTES = 4.0


def moe_quantize_time(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                      eff: Efficiency) -> OpTime:
    """fp8 / fp4 casts of the routed experts' GEMM inputs in a MoE layer, s (0 in 16 bit).

    R = moe_tokens * k routed tokens reach this GPU's experts (balanced load). Each expert
    GEMM's 16-bit input is quantised before it runs (`FP8_CAST_BYTES` = 4 B per element):
    forward the up projection's input (R x h) and the down projection's (R x f / etp, the
    activation's output); backward the output gradients of the down projection (R x h) and of
    the up projection (R x (mlp_matrices - 1) f / etp):

        forward  = 4 R (h + f / etp) B,    backward = 4 R (h + (mlp_matrices - 1) f / etp) B

    one kernel per input (Transformer Engine's grouped linear casts all local experts' slices
    in one multi-tensor cast-transpose launch). A dense GEMM's casts stay in the
    fitted `matmul_lowp`; the routed tokens' are k times a dense layer's per token and
    meet GEMMs only f wide, so for narrow experts they are a real share of the layer."""
    return _routed_op_time(_moe_quantize_ops, model, plan, acc, eff)


def moe_quantize_op(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                    eff: Efficiency) -> OpCost:
    """The forward `OpCost` of `moe_quantize_time` (mean over the layers: 1 - r of them)."""
    return _routed_forward_op(_moe_quantize_ops, model, plan, acc, eff)


def _routed_op_time(ops, model: Transformer, plan: TrainingPlan, acc: Accelerator,
                    eff: Efficiency) -> OpTime:
    """The `OpTime` of a routed-expert op whose `ops(model, plan, acc, eff)` returns its
    (forward, backward) `OpCost`s; zero, and out of the trace, for a known dense model."""
    if model.known_dense():
        return OpTime(jnp.zeros(()), jnp.zeros(()))
    fwd, bwd = ops(model, plan, acc, eff)
    return OpTime(fwd.time, bwd.time)


def _routed_forward_op(ops, model: Transformer, plan: TrainingPlan, acc: Accelerator,
                       eff: Efficiency) -> OpCost:
    """The forward `OpCost` of such an op (`_routed_op_time`); zero for a known dense model."""
    if model.known_dense():
        return OpCost.zero()
    return ops(model, plan, acc, eff)[0]


def _moe_quantize_ops(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                      eff: Efficiency) -> tuple[OpCost, OpCost]:
    """(forward, backward) `OpCost`s of `moe_quantize_time`."""
    etp, moe_tokens = expert_tokens(model, plan)
    routed = moe_tokens * model.experts_per_token
    h, f = model.hidden, model.ffn_hidden / etp
    kernels = 2.0
    share = 1.0 - model.dense_fraction
    on = (model.num_experts > 1) & (jnp.asarray(plan.precision) >= 2)
    fwd = op_cost(acc, eff, 0.0, FP8_CAST_BYTES * routed * (h + f), kernels=kernels)
    bwd = op_cost(acc, eff, 0.0, FP8_CAST_BYTES * routed * (h + (model.mlp_matrices - 1.0) * f),
                  kernels=kernels)
    return (share * fwd).where(on), (share * bwd).where(on)


def moe_eager_time(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                   eff: Efficiency) -> OpTime:
    """Eager element-wise work Megatron-Core runs around the routed experts of a model with
    expert biases (`Transformer.expert_bias`) or a clamped gated activation (`glu_clamp`),
    gpt-oss's, s (0 for other models).

    From `TEGroupedMLP` (megatron/core/transformer/moe/experts.py at Megatron-LM 0d8e0714,
    the Megatron-Bridge 25.11 pin) and `weighted_bias_quick_geglu_impl`
    (megatron/core/fusions/fused_bias_geglu.py), in 16-bit activations of a bytes each, on the
    R = moe_tokens * k routed tokens of this GPU, f' = f / etp:

    - the clamp of a gated activation, outside the fused activation: the gate and the
      linear half of the up projection's R x 2 f' output each clamped (read and write a half
      each), then concatenated again (read and write the whole): 4 a B per element of
      R x 2 f', 3 kernels. Backward, PyTorch's `clamp_backward` is
      `where((x >= lo).logical_and_(x <= hi), grad, 0)` on the linear half (a zero scalar,
      two comparisons reading a and writing a 1-byte mask each, the in-place `and` reading two
      masks and writing one, the `where` reading a + 1 and writing a: 4 a + 6 B, 5 kernels)
      and `where(x <= hi, grad, 0)` on the gate half (3 a + 2 B, 3 kernels); the halves'
      gradients are concatenated (2 a, 1 kernel): (5.5 a + 4) B per element of R x 2 f',
      9 kernels;
    - the down projection's bias (`_apply_bias`: a Python loop over the local experts, then
      one `torch.cat`): per expert `b * p` (write a) and `t + b p` (read 2 a, write a), the
      concatenation (2 a): 6 a B per element of R x h, 2 kernels per local expert + 1;
      backward, per expert the two products of the gradient with the router weight and with
      the bias materialised and reduced (3 a each), and the split's gradient concatenated
      (2 a): 8 a B per element, 4 kernels per local expert + 1:

        forward  = R (4 a c 2 f' + 6 a b h) B,
        backward = R ((5.5 a + 4) c 2 f' + 8 a b h) B

    with c = `glu_clamp` (on gated MLPs only), b = `expert_bias`. The up projection's bias is
    added in Transformer Engine's grouped GEMM (`linear_fc1` is built with
    `skip_bias_add=False`), so it has no eager traffic. Not counted: the host operators of the
    per-expert loop and a few tiny launches of the backward (the router weights' split and
    gradient accumulation, one bias-gradient add per expert). Selective recomputation of
    `moe_act` reruns the clamp (`module_recompute_ops`). Inference engines fuse both into their
    MoE kernels, so `infer` and `serve` have no such term."""
    return _routed_op_time(_moe_eager_ops, model, plan, acc, eff)


def moe_eager_op(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                 eff: Efficiency) -> OpCost:
    """The forward `OpCost` of `moe_eager_time` (mean over the layers: 1 - r of them)."""
    return _routed_forward_op(_moe_eager_ops, model, plan, acc, eff)


def _moe_eager_ops(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                   eff: Efficiency) -> tuple[OpCost, OpCost]:
    """(forward, backward) `OpCost`s of `moe_eager_time`."""
    etp, moe_tokens = expert_tokens(model, plan)
    routed = moe_tokens * model.experts_per_token
    a = activation_bytes(plan.precision)
    clamp, bias = model.glu_clamp * model.gated_mlp, model.expert_bias  # GLUs clamp only
    up_width = (model.mlp_matrices - 1.0) * model.ffn_hidden / etp
    local_experts = model.num_experts / plan.ep
    fwd = op_cost(acc, eff, 0.0,
                  routed * (4.0 * a * clamp * up_width + 6.0 * a * bias * model.hidden),
                  kernels=3.0 * clamp + bias * (2.0 * local_experts + 1.0))
    bwd = op_cost(acc, eff, 0.0,
                  routed * ((5.5 * a + 4.0) * clamp * up_width + 8.0 * a * bias * model.hidden),
                  kernels=9.0 * clamp + bias * (4.0 * local_experts + 1.0))
    share = 1.0 - model.dense_fraction
    on = (model.num_experts > 1) & ((clamp > 0) | (bias > 0))
    return (share * fwd).where(on), (share * bwd).where(on)


def module_recompute_ops(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                         eff: Efficiency) -> dict[str, OpCost]:
    """The forward `OpCost`s of the modules selective recomputation reruns before the backward
    pass (`TrainingPlan.recompute_norms`, `recompute_moe_act`, `recompute_mla_up`,
    `recompute_mlp`; Megatron-core's `recompute_modules` at Megatron-LM 0d8e0714), one layer
    and micro-batch, mean over the layers, keyed by the `_detail.LAYER_OPS` operation whose
    forward they repeat. `CheckpointWithoutOutput` (layernorm, moe_act, mla_up_proj) copies
    each recomputed output back into the storage it freed: one more read and write of it.

    - `elementwise`: the layer norms that exist as modules of their own (with Transformer
      Engine a norm in front of a linear layer is fused into it and is no module: the input
      norm is one only before MLA's down-projections, the pre-MLP norm only in front of a MoE
      layer's router): read tokens x h, write it, copy it back, 4 a B per element, 1 kernel
      + 1 copy each; the routed experts' activation (reads the up projection's 2 f', writes
      f' per routed token and copies it back, 1 kernel + 1 copy); a dense MLP's activation and
      its fused norm (`mlp`: `tensor_parallel.checkpoint` reruns the whole module from its
      input; its tensor-parallel reduction is not counted again);
    - `moe_eager`: the clamp before the experts' activation (`moe_eager_time`'s forward
      clamp: 4 a B per element of R x 2 f', 3 kernels), which the activation's recomputation
      reruns;
    - `qkv`: MLA's query projection (from the query latent, or from h without one) and KV
      up-projection GEMMs, plus their element-wise work: the two latent norms (read and write
      q_lora + c_kv per token), RoPE on the query's and the key's rotary parts, the copy-back
      of Q, K and V (2 a B per element of each);
    - `mlp_up`, `mlp_down` (a dense model) or `dense_up`, `dense_down` (a MoE model's
      dense-MLP layers): the MLP GEMMs.

    Each is zero unless its flag is on; `module_recompute_time` applies them to the layers
    that are not fully recomputed."""
    ab, t, p = activation_bytes(plan.precision), plan.tp, plan.precision
    h, r = model.hidden, model.dense_fraction
    tokens = local_tokens(model, plan)
    sp_div = jnp.where(plan.sequence_parallel > 0, t, 1.0)
    norm_elems = tokens * h / sp_div
    act_bytes = ab * (2.0 + model.gated_mlp)
    moe = jnp.where(model.num_experts > 1, 1.0, 0.0)
    # Norms that are modules: MLA's input norm (every layer), a MoE layer's pre-MLP norm.
    separate_norms = model.mla + moe * (1.0 - r)
    norms = (plan.recompute_norms * separate_norms) * op_cost(
        acc, eff, 8.0 * norm_elems, 4.0 * ab * norm_elems, kernels=2.0)
    routed_act = tokens * (1.0 - r) * model.experts_per_token * model.ffn_hidden / t
    moe_act = ((plan.recompute_moe_act * moe) * op_cost(
        acc, eff, 8.0 * routed_act, (act_bytes + 2.0 * ab) * routed_act, kernels=2.0)).where(
        routed_act > 0)
    etp, moe_tokens = expert_tokens(model, plan)
    up_width = (model.mlp_matrices - 1.0) * model.ffn_hidden / etp
    clamped = plan.recompute_moe_act * moe * model.glu_clamp * model.gated_mlp * (1.0 - r)
    clamp = clamped * op_cost(acc, eff, 0.0,
                              4.0 * ab * moe_tokens * model.experts_per_token * up_width,
                              kernels=3.0)
    # The MLP of a dense model (`_moe_mlp`'s single expert) or of a MoE model's dense layers,
    # with its fused pre-MLP norm (read and write tokens x h).
    dense_model = (1.0 - moe) * (1.0 - r)
    mlp = plan.recompute_mlp
    dense_act = tokens * (dense_model * model.ffn_hidden + r * model.dense_width) / t
    dense_share = dense_model + r
    mlp_act = (mlp * op_cost(acc, eff, 8.0 * dense_act + 8.0 * dense_share * norm_elems,
                             act_bytes * dense_act + 2.0 * ab * dense_share * norm_elems,
                             kernels=2.0)).where(dense_act > 0)
    ops = {"elementwise": norms + moe_act + mlp_act, "moe_eager": clamp,
           "mlp_up": OpCost.zero(), "mlp_down": OpCost.zero(), "dense_up": OpCost.zero(),
           "dense_down": OpCost.zero(), "qkv": OpCost.zero()}
    known_moe = is_concrete(model.num_experts) and bool(np.all(np.asarray(model.num_experts) > 1))
    if not (known_moe and model.known_absent("dense_layers")):
        # (a MoE model without dense layers has no dense MLP: kept out of its trace)
        _, _, moe_ops = _moe_mlp(model, plan, acc, eff)
        _, _, dense_ops = _dense_mlp(model, plan, acc, eff)
        ops |= {"mlp_up": (mlp * dense_model) * moe_ops["mlp_up"],
                "mlp_down": (mlp * dense_model) * moe_ops["mlp_down"],
                "dense_up": (mlp * r) * dense_ops["dense_up"],
                "dense_down": (mlp * r) * dense_ops["dense_down"]}
    if not model.known_absent("kv_lora_rank"):
        heads = model.heads / t
        q_in = jnp.where(model.q_lora_rank > 0, model.q_lora_rank, h)  # no latent: from h
        c_kv = jnp.where(model.kv_lora_rank > 0, model.kv_lora_rank, h)
        q_up = gemm_cost(acc, eff, tokens, heads * model.qk_dim, q_in, p, act_bytes=ab)
        kv_up = gemm_cost(acc, eff, tokens, heads * (model.head_dim + model.v_dim), c_kv, p,
                          act_bytes=ab)
        latent_norms = tokens * (model.q_lora_rank + model.kv_lora_rank)
        rope = tokens * (heads + 1.0) * model.rope_head_dim
        qkv_out = tokens * heads * (2.0 * model.qk_dim + model.v_dim)
        extra = op_cost(acc, eff, 8.0 * latent_norms + 6.0 * rope,
                        2.0 * ab * (latent_norms + rope + qkv_out), kernels=5.0)
        ops["qkv"] = (plan.recompute_mla_up * model.mla) * (q_up + kv_up + extra)
    return ops


def module_recompute_time(model: Transformer, plan: TrainingPlan, acc: Accelerator,
                          eff: Efficiency) -> jax.Array:
    """Selective recomputation of modules per layer and micro-batch, s: (1 - full) times the
    summed forward times of `module_recompute_ops` (the fully recomputed share of the layers
    reruns everything anyway, `recompute_time`)."""
    full = plan.recomputed_fraction(model.layers)
    return (1.0 - full) * sum(op.time for op in
                              module_recompute_ops(model, plan, acc, eff).values())


def recompute_time(model: Transformer, plan: TrainingPlan, forward,
                   attention_forward) -> jax.Array:
    """Recomputation per layer, s: full * forward + (1 - full) * (the attention core under
    selective recompute without a fused kernel).

    Fully recomputed layers (all with recompute = full, else `recompute_layers` per chunk)
    rerun the forward pass; the others rerun the attention core under selective recompute
    without a fused kernel (a flash kernel's recomputation is part of its backward)."""
    full = plan.recomputed_fraction(model.layers)
    flash = plan.flash_attention > 0
    return full * forward + (1.0 - full) * jnp.where((plan.recompute == 1) & ~flash,
                                                     attention_forward, 0.0)


def layer_costs(model: Transformer, plan: TrainingPlan, system: System,
                eff: Efficiency) -> LayerTimes:
    """One layer's compute (the ops above) and exposed communication (`_layer_comm`), s.

    forward = GEMMs + attention core + element-wise + permutation + fp8 casts + eager expert
    work; backward likewise from each op's backward; the async TP reductions hide behind the
    column-parallel weight-gradient GEMMs, and the EP all-to-alls behind the compute those left
    (`_layer_comm.ep_comm`)."""
    acc, net = system.accelerator, system.network
    weights = weight_gemms(model, plan, acc, eff)
    gemms = weights.time
    attention = attention_core_time(model, plan, acc, eff)
    elementwise = elementwise_time(model, plan, acc, eff)
    permute = moe_permute_time(model, plan, acc, eff)
    quantize = moe_quantize_time(model, plan, acc, eff)
    eager = moe_eager_time(model, plan, acc, eff)
    forward = (gemms.forward + attention.forward + elementwise.forward + permute.forward
               + quantize.forward + eager.forward)
    backward = (gemms.backward + attention.backward + elementwise.backward + permute.backward
                + quantize.backward + eager.backward)
    recompute = (recompute_time(model, plan, forward, attention.forward)
                 + module_recompute_time(model, plan, acc, eff))
    tp_exposed, tp_hidden = tp_comm(model, plan, net, eff, weights.qkv + weights.mlp_up)
    ep_exposed, ep_all = ep_comm(model, plan, net, eff,
                                 forward + backward + recompute - tp_hidden, acc.num_sms)
    return LayerTimes(forward, backward, recompute, tp_exposed, cp_comm(model, plan, net, eff),
                      ep_exposed, tp_hidden + ep_all - ep_exposed)


def head_time(model: Transformer, plan: TrainingPlan, system: System,
              eff: Efficiency) -> jax.Array:
    """LM head + cross-entropy (last stage) and embedding lookup (first stage) for one
    micro-batch, forward + backward, s: the head GEMM (tokens x h) @ (h x V / tp) three times
    (forward, two gradients) in at most 16 bit, an fp32 softmax-cross-entropy over the local
    logits (10 FLOP and 12 B per logit, 3 kernels) and the embedding's 3 passes over
    tokens x h."""
    ops = head_ops(model, plan, system, eff)
    return ops["lm_head"].time + ops["loss"].time + ops["embedding"].time


def head_ops(model: Transformer, plan: TrainingPlan, system: System,
             eff: Efficiency) -> dict[str, OpCost]:
    """The `OpCost`s of `head_time` for one micro-batch, forward + backward: `lm_head` (the
    three GEMMs), `loss` (softmax-cross-entropy) and `embedding`."""
    acc = system.accelerator
    p = plan.precision
    ab = activation_bytes(p)
    tokens = local_tokens(model, plan)
    v_local = model.vocab / plan.tp
    head = 3.0 * gemm_cost(acc, eff, tokens, v_local, model.hidden, jnp.minimum(p, 1.0),
                           act_bytes=ab)
    logits = tokens * v_local
    loss = op_cost(acc, eff, 10.0 * logits, logits * 4.0 * 3.0, kernels=3.0)  # fp32 softmax-CE
    embed = op_cost(acc, eff, 0.0, 3.0 * tokens * model.hidden * ab, kernels=2.0)
    return {"lm_head": head, "loss": loss, "embedding": embed}
