"""Latency, throughput and memory of LLM inference: prefill, decode and the KV cache.

One request batch is served with static batching: the prefill pass processes all
`batch * input_len` prompt tokens and emits the first token; then `output_len - 1` decode steps
each generate one token per sequence. Every phase is a list of operations (`Cost`) - each GEMM
with its exact local shape, the attention core, element-wise kernels, the tensor-parallel
all-reduces, pipeline send/recv - and a phase's time is the sum of its operations' times:

    t_op = smax(FLOPs / rate, HBM bytes / (BW_hbm * e_hbm)) + network + kernels * t_kernel

with `smax` the smooth maximum of `diffperf.costs` (its softer GEMM knee for GEMMs), and
`t_kernel = launch_overhead + kernel_overhead` the fixed cost of one kernel. Definitions:

- TTFT = prefill time (including the LM head of the last prompt token), as in NVIDIA's
  first-token-latency tables measured with `output_len = 1`.
- TPOT = mean decode step over the `output_len - 1` steps after the first token.
- e2e latency = TTFT + (output_len - 1) * TPOT.
- output tokens/s per GPU = batch * output_len / e2e / (tp * pp).

Decode over all output tokens is closed form: step j (1 <= j < output_len) attends over a KV
cache of L_j = input_len + j tokens, and the attention FLOPs and bytes are both proportional
to L_j, so (the smooth maximum being homogeneous of degree one) the sum over steps is exactly
the attention cost at the summed context (output_len - 1) * (input_len + output_len / 2).
Sliding-window layers read min(L_j, window) tokens; that sum is closed form too
(`Transformer.mean_cached_tokens`).

Pipeline stages run one after the other for a single batch (no overlap between batches), so
latency counts every layer and throughput divides by all tp * pp GPUs. GEMMs are modelled
without wave quantisation above one output tile per SM. Below it a GEMM costs the cheaper of
split-K (every SM busy, a second kernel reduces the partial sums) and one kernel at the share
of the SMs its tiles occupy (`costs.split_k_gemm_cost`). The cost is continuous in the token
count, but between the switch to one kernel and one tile per SM it falls as fewer SMs sit
idle: the time per decode step of a small model at a short context can fall by 1-3 % over a
range of batches (Llama 3 8B on one H100, 128 + 8 tokens: -1.2 % from batch 71 to 76), where
before 2026-11-24 it fell by up to 6 % at a single batch. Real GEMM libraries show such falls
where their heuristics change kernels.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._checks import is_concrete
from ..costs import _collectives as coll
from ..costs._attention import (
    ATTENTION_Q_TILE,
    fused_attention_rate,
    prefill_attention_busy_time,
    prefill_wave_factor,
)
from ..costs._cost import Cost, compute_cost, network_cost
from ..costs._engine_all_reduce import engine_all_reduce
from ..costs._gemm import MMA_ROWS, W4A16_MOE_PEAK_SHARE, k_loop_forward, split_k_gemm_cost
from ..costs._roofline import bytes_per_element, ceil_div, peak_matmul_flops
from ..feasibility import divides, tp_divides_mlps, whole_counts
from ..presets import resolve_efficiency
from ..specs._attention import projections
from ..specs._efficiency import Efficiency, matmul_efficiency
from ..specs._hardware import System
from ..specs._inference_plan import InferencePlan
from ..specs._runtime import Runtime
from ..specs._transformer import Transformer
from ._host import graph_kernel_time, graph_padded_batch, graph_share, host_scale, host_wait
from ._moe_gemm_factors import measured_gemm_factor

#: Element-wise kernels per layer and step (TensorRT-LLM style fusion): input RMSNorm,
#: residual-add + post-attention RMSNorm, SwiGLU / GeLU activation, final residual add (one
#: fewer in a parallel attention + MLP block, which has a single residual add). The default of
#: `Runtime.elementwise_kernels`; a runtime with other fusion sets its own.
ELEMENTWISE_KERNELS = 4.0
#: Extra kernels per MoE layer: router softmax + top-k, token permute, un-permute + combine.
MOE_KERNELS = 3.0
#: Of those, the permutation's two (the permuted copy, or the routing-index sort of engines that
#: gather inside the GEMM, and the combine), charged with their traffic (`moe_permute`).
MOE_PERMUTE_KERNELS = 2.0
#: Kernels of the attention core, as TensorRT-LLM 0.9's GPT attention plugin launches them
#: (`gptAttentionCommon.cpp`, `enqueueContext` / `enqueueGeneration`). Decode: one kernel
#: (masked MHA or XQA, with RoPE and the KV-cache write fused in).
ATTENTION_KERNELS_DECODE = 1.0
#: Prefill with fused attention: sequence / padding offsets (`invokeBuildDecoderInfo`), RoPE +
#: KV-cache write (`invokeApplyBiasRopeUpdateKVCache`), the fused multi-head attention kernel.
ATTENTION_KERNELS_PREFILL_FUSED = 3.0
#: Prefill without it: offsets, mask, buffer memset, Q/K/V transpose with RoPE, KV-cache write,
#: QK^T, softmax, AV, output transpose.
ATTENTION_KERNELS_PREFILL_UNFUSED = 9.0
#: Kernels outside the layers per pass: embedding, final norm, sampling (LM head is a GEMM).
HEAD_KERNELS = 3.0

#: Operation names and the category each belongs to (keys of `inference_ops`, per phase).
OP_KINDS = {
    "embedding": "elementwise", "qkv_proj": "gemm", "attention": "attention",
    "out_proj": "gemm", "router": "gemm", "mlp_up": "gemm", "mlp_down": "gemm",
    "shared_mlp_up": "gemm", "shared_mlp_down": "gemm", "dense_mlp_up": "gemm",
    "dense_mlp_down": "gemm",
    "elementwise": "elementwise", "moe_permute": "elementwise", "tp_allreduce": "tp_comm",
    "pp_send_recv": "pp_comm",
    "lm_head": "gemm", "logits_gather": "tp_comm", "final": "elementwise",
}
KINDS = ("gemm", "attention", "elementwise", "tp_comm", "pp_comm")


class _Dims(eqx.Module):
    """Local (per-GPU) sizes shared by both phases (internal)."""

    tp: jax.Array
    atp: jax.Array  # tensor-parallel degree of attention and all but the routed experts
    dp: jax.Array  # attention data-parallel ranks (InferencePlan.attention_dp: tp, else 1)
    ep: jax.Array  # expert-parallel degree within the tp GPUs (InferencePlan.ep)
    h: jax.Array
    d: jax.Array
    heads: jax.Array  # query heads per GPU
    kv: jax.Array  # K / V heads the prefill kernel reads per GPU (MLA: one per query head)
    qk: jax.Array  # per-head query / key width (MLA: d_n + d_r)
    v: jax.Array  # per-head value width
    cache: jax.Array  # KV-cache elements per token and layer on one GPU
    dec_k: jax.Array  # key width a decode step reads per cached token and head group
    dec_v: jax.Array  # value width (MLA, absorbed: the latent for both)
    group: jax.Array  # query heads per cached head group (MLA: all heads share the latent)
    rope: jax.Array  # elements per token that get RoPE: (a + g) d, or MLA's (a + 1) d_r
    latents: jax.Array  # MLA's query + KV latent (+ RoPE key) widths per token (0 without)
    f: jax.Array  # MLP width per GPU and token (an expert's: its mean share of each GPU)
    f_expert: jax.Array  # width of one expert on the GPUs that hold it, ffn_hidden * ep / tp
    f_dense: jax.Array  # width per GPU of a MoE model's dense-MLP layers
    f_shared: jax.Array  # width per GPU of the shared expert of its MoE layers (0 = none)
    shared_gemm: jax.Array  # that width where it is > 0, else f (finite GEMM costs, weighted 0)
    dense: jax.Array  # share of the layers that are such dense-MLP layers
    vocab: jax.Array  # vocabulary shard per GPU
    math: jax.Array  # GEMM precision code
    head_math: jax.Array  # LM head precision code (at most 16 bit: kept unquantised)
    wb: jax.Array  # weight bytes per element
    ab: jax.Array  # GEMM activation bytes per element
    sb: jax.Array  # residual stream bytes per element (at least 16 bit)
    kb: jax.Array  # KV-cache bytes per element
    moe: jax.Array
    peak_fraction: jax.Array  # share of the tensor peak the weight GEMMs can issue


def expert_parallel_degree(model: Transformer, plan: InferencePlan) -> jax.Array:
    """The plan's ep where the model has experts, else 1: ep only regroups experts, so a dense
    model's costs (and their gradients) never depend on it."""
    return jnp.where(model.num_experts > 1, plan.ep, 1.0)


def _dims(model: Transformer, plan: InferencePlan) -> _Dims:
    """Per-GPU sizes. With attention data parallelism everything but the routed experts is
    sized for one GPU (`atp` = 1); an expert's width stays ffn_hidden * ep / tp."""
    ab = bytes_per_element(plan.activation_precision)
    mla = model.mla
    atp = plan.attention_tp
    heads = model.heads / atp
    kv = jnp.maximum(model.kv_heads / atp, 1.0)  # replicated when tp > kv_heads
    latent = model.kv_lora_rank + model.rope_head_dim
    mix = lambda standard, latent_attention: (1.0 - mla) * standard + mla * latent_attention
    ep = expert_parallel_degree(model, plan)
    return _Dims(
        tp=plan.tp, atp=atp, dp=plan.attention_ranks, ep=ep, h=model.hidden, d=model.head_dim,
        heads=heads, kv=jnp.maximum(model.attention_kv_heads / atp, 1.0), qk=model.qk_dim,
        v=model.v_dim, cache=model.kv_cache_width(atp), dec_k=mix(model.head_dim, latent),
        dec_v=mix(model.head_dim, model.kv_lora_rank), group=mix(heads / kv, heads),
        rope=mix((heads + kv) * model.head_dim, (heads + 1.0) * model.rope_head_dim),
        latents=mla * (model.q_lora_rank + latent), f=model.ffn_hidden / atp,
        # the routed experts are split over all tp GPUs; a dense model's MLP is replicated
        # with attention DP (no experts to split), as the other dense layers are
        f_expert=jnp.where(model.num_experts > 1, model.ffn_hidden * ep / plan.tp,
                           model.ffn_hidden / atp),
        f_dense=model.dense_width / atp, dense=model.dense_fraction,
        f_shared=model.shared_ffn_hidden / atp, shared_gemm=model.shared_width / atp,
        vocab=model.vocab / atp, math=plan.math_precision,
        head_math=jnp.minimum(plan.math_precision, 1.0),
        wb=plan.weight_bytes, ab=ab, sb=jnp.maximum(ab, 2.0),
        kb=bytes_per_element(plan.kv_precision), moe=model.num_experts > 1,
        peak_fraction=plan.gemm_peak_fraction)


def experts_touched(model: Transformer, tokens) -> jax.Array:
    """Expected distinct experts a layer routes `tokens` tokens to: E (1 - (1 - k/E)^tokens)
    for uniform top-k routing (1 for a dense model), count."""
    e, k = model.num_experts, model.experts_per_token
    miss = jnp.clip(1.0 - k / e, 1e-6, 1.0)  # clipped: finite gradients when k = E or E = 1
    return jnp.where(model.num_experts > 1, e * (1.0 - miss ** tokens), 1.0)


def expected_max_of_normals(n) -> jax.Array:
    """Expected maximum of n independent standard normals: with L = log2 n,
    0.52007 L / (1 + 0.14100 L) + 0.10894 L, a fit to its values at n = 1, 2, 4, ..., 256
    (0, 0.5642, 1.0294, 1.4236, 1.7660, 2.0697, 2.3437, 2.5946, 2.8269 by numerical integration
    of x n phi(x) Phi(x)^(n-1)) within 0.001; exactly 0 at n = 1."""
    lg = jnp.log2(jnp.maximum(n, 1.0))
    return 0.52007 * lg / (1.0 + 0.14100 * lg) + 0.10894 * lg


def busiest_gpu_experts(model: Transformer, tokens, ep) -> jax.Array:
    """Expected distinct experts of one layer that the busiest of `ep` expert-parallel GPUs
    runs for `tokens` tokens, count (= `experts_touched` for ep = 1).

    Each of a GPU's E / ep experts is picked by at least one token with probability
    p = 1 - (1 - k/E)^tokens, so a GPU runs Binomial(E / ep, p) experts (independence
    assumed); the busiest of ep such GPUs is taken as mean + z_ep sd, with z_ep the expected
    maximum of ep standard normals (`expected_max_of_normals`: 0 for ep = 1, 0.56 for 2, 1.42
    for 8), at least one expert (some GPU runs each picked expert) and
    at most E / ep. Exact for ep = 1; within 6 % of a simulation of uniform top-k routing for
    Mixtral and DeepSeek-V3 at 1-64 tokens and ep 2-8 (`tests/test_inference_expert_parallel`).
    Low where a GPU expects about one expert or fewer (the binomial is skewed there): DeepSeek-V3
    at one or two tokens and ep 16-64 runs 1.0-2.7 experts on its busiest GPU against 1.3-3.0 in
    a simulation (about 1 % of a decode step, which launches dominate). Token counts per expert
    are the mean: the imbalance of tokens between the GPUs is not modelled.
    """
    e = model.num_experts
    touched = experts_touched(model, tokens)
    local = e / ep
    p = touched / e
    sd = jnp.sqrt(jnp.maximum(local * p * (1.0 - p), 1e-12))
    z = expected_max_of_normals(ep)
    busiest = jnp.maximum(touched / ep + z * sd, jnp.minimum(touched, 1.0))
    return jnp.minimum(busiest, jnp.maximum(local, 1.0))


def _expert_rows(model: Transformer, x: _Dims, tokens):
    """(tokens entering the experts, mean tokens per picked expert, experts of the busiest
    expert-parallel GPU) of one MoE layer for `tokens` tokens per attention rank: with
    attention data parallelism (`x.dp` ranks) the experts see every rank's tokens; uniform
    top-k routing (`experts_touched`, `busiest_gpu_experts`)."""
    routed = tokens * jnp.where(x.moe, x.dp, 1.0)
    per_expert = routed * model.experts_per_token / experts_touched(model, routed)
    return routed, per_expert, busiest_gpu_experts(model, routed, x.ep)


def _layer_gemms(model: Transformer, system: System, eff: Efficiency, x: _Dims,
                 tokens, expert_time_factor=1.0, gemm_table=0.0) -> dict[str, Cost]:
    """Weight GEMMs of one layer for `tokens` tokens (M = tokens), mean over the layers: a
    MoE model's dense-MLP layers (share `x.dense`) run `dense_mlp_*` instead of the router,
    the experts and the shared expert (`shared_mlp_*`, every token, not dispatched). The
    experts are those of the busiest expert-parallel GPU (`busiest_gpu_experts`), each at the
    mean tokens per picked expert. With attention data parallelism (`x.dp` ranks) the experts
    see the tokens of all ranks, `tokens` x dp. The routed experts' compute and memory times
    are multiplied by `expert_time_factor` (`Runtime.moe_gemm_time_factor`) and, for 4-bit
    math on GPUs with FP4 tensor cores, by the measured factor of TensorRT-LLM's CUTLASS
    NVFP4 backend raised to `gemm_table` (`Runtime.moe_gemm_table`: 1 applies it, 0 not;
    `measured_gemm_factor`, 1 for a shape its tables lack)."""
    routed, per_expert, local = _expert_rows(model, x, tokens)
    acc = system.accelerator
    g = lambda m, n, k, groups=1.0: split_k_gemm_cost(acc, eff, m, n, k, x.math, x.wb, x.ab,
                                                      groups, x.peak_fraction)
    # the routed experts' grouped GEMMs pay the fp8 / fp4 k loop's fixed cost per tile
    # (`costs.k_loop_loss`; forward only: the factor of the GEMM's own depth k); with 4-bit
    # weights and 16-bit math (weight-only, W4A16) they issue `W4A16_MOE_PEAK_SHARE` of the
    # 16-bit rate on GPUs with FP8 tensor cores (the measured kernels' dequantisation)
    w4a16 = x.moe & (x.wb < 1.0) & (x.math <= 1.0) & (acc.flops_fp8 > 0)
    ge = g if model.known_dense() else lambda m, n, k, groups: split_k_gemm_cost(
        acc, eff, m, n, k, x.math, x.wb, x.ab, groups,
        x.peak_fraction / jnp.where(x.moe, k_loop_forward(k, x.math), 1.0)
        * jnp.where(w4a16, W4A16_MOE_PEAK_SHARE, 1.0),
        fp4_cap=jnp.logical_not(x.moe))
    moe = 1.0 - x.dense
    # a dense model's MLP is not an expert; the lookup is left out of the trace where the
    # model is known to be dense or the runtime known not to ask for it
    factor = jnp.where(x.moe, expert_time_factor, 1.0)
    table_off = is_concrete(gemm_table) and bool(np.all(np.asarray(gemm_table) == 0))
    if not (model.known_dense() or table_off):
        measured = measured_gemm_factor(x.h, x.f_expert, model.num_experts,
                                        model.experts_per_token, routed)
        table = jnp.where(x.moe & (x.math >= 3.0) & (acc.flops_fp4 > 0), gemm_table, 0.0)
        factor = factor * measured ** table
    def slowed(c):
        return eqx.tree_at(lambda c: (c.compute, c.memory), c,
                           (c.compute * factor, c.memory * factor))
    def only(field, share, m, n, k):  # a zero cost where the model has no such layers
        return (network_cost(jnp.zeros(()), 0.0) if model.known_absent(field)
                else share * g(m, n, k))
    proj = [(pr.is_output, pr.share * g(tokens, pr.n, pr.k))
            for pr in projections(model, x.atp)]
    add = lambda costs: functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), costs)
    return {
        # MLA's four input projections as one op (same rows, so the same boundedness)
        "qkv_proj": add([c for is_out, c in proj if not is_out]),
        "out_proj": add([c for is_out, c in proj if is_out]),
        "router": jnp.where(x.moe, moe, 0.0) * split_k_gemm_cost(
            acc, eff, tokens, model.num_experts, x.h, x.head_math, x.sb, x.sb),
        "mlp_up": moe * slowed(ge(per_expert, (model.mlp_matrices - 1.0) * x.f_expert, x.h,
                                  local)),
        "mlp_down": moe * slowed(ge(per_expert, x.h, x.f_expert, local)),
        "shared_mlp_up": only("shared_ffn_hidden", moe * model.has_shared, tokens,
                              (model.mlp_matrices - 1.0) * x.shared_gemm, x.h),
        "shared_mlp_down": only("shared_ffn_hidden", moe * model.has_shared, tokens, x.h,
                                x.shared_gemm),
        "dense_mlp_up": only("dense_layers", x.dense, tokens,
                             (model.mlp_matrices - 1.0) * x.f_dense, x.h),
        "dense_mlp_down": only("dense_layers", x.dense, tokens, x.h, x.f_dense),
    }


def _elementwise(model: Transformer, system: System, eff: Efficiency, x: _Dims,
                 tokens, kernels_per_layer) -> Cost:
    """Norms, residual adds, activation, RoPE and KV-cache write of one layer, in
    `kernels_per_layer` kernels (`Runtime.elementwise_kernels`)."""
    th = tokens * x.h
    act = tokens * ((1.0 - x.dense) * (model.experts_per_token * x.f + x.f_shared)
                    + x.dense * x.f_dense)
    rope = tokens * x.rope
    # 2 norms; 2 residual adds (read 2, write 1) or, in a parallel block, one that reads the
    # residual and both branch outputs.
    residual = th * x.sb * (6.0 - 2.0 * model.parallel_attention)
    nbytes = (2.0 * th * 2.0 * x.sb + residual
              + act * x.ab * (model.mlp_matrices)  # activation: read 1-2 inputs, write 1
              + rope * 2.0 * x.ab + tokens * x.cache * x.kb)  # RoPE, KV write
    flops = 2.0 * th * 5.0 + 2.0 * th + act * 8.0 + rope * 6.0
    kernels = (kernels_per_layer - model.parallel_attention
               + jnp.where(x.moe, (1.0 - x.dense) * (MOE_KERNELS - MOE_PERMUTE_KERNELS), 0.0))
    acc = system.accelerator
    return compute_cost(acc, eff, flops, nbytes, acc.vector_flops * eff.vector, kernels)


def moe_permute_cost(model: Transformer, system: System, eff: Efficiency, x: _Dims, tokens,
                     permute_copy) -> Cost:
    """The token permutation around one MoE layer's routed experts on one GPU, mean over the
    layers (the MoE layers' share 1 - r); zero for a dense model. Two memory-bound kernels
    (`MOE_PERMUTE_KERNELS`):

        bytes = c (T h s + R h a) + R h s + T h s

    - the permuted copy (c = `Runtime.moe_permute_copy`): read the T tokens entering the
      layer, write each of their routed rows to its expert's contiguous block, R rows of h
      elements at the GEMM's activation bytes a (TensorRT-LLM's CUTLASS / DeepGEMM backends
      quantise in this pass: `expandInputRowsKernel`); engines whose first expert GEMM gathers
      its rows by index (vLLM's and SGLang's Triton `fused_moe`, `sorted_token_ids`) skip it
      (c = 0; their index sort stays one kernel);
    - the combine: read the R expert-output rows (16 bit, s) and write the T weighted sums
      (TensorRT-LLM's `finalizeMoeRoutingKernel`, vLLM's `moe_sum`).

    T are the tokens entering the experts (x attention-DP ranks), R = the busiest
    expert-parallel GPU's experts x the mean tokens per picked expert (as its grouped GEMMs):
    with expert parallelism each GPU is ASSUMED to copy and combine only its own experts' rows
    (no published timing with ep > 1 separates it; NVIDIA's measured EP splits of the whole
    module do not shrink with ep as the model's GEMMs do, calibration/EXPERIMENTS.md). The
    expert GEMMs' own reads and writes of those rows are in their costs (the down GEMM writes
    its output at the activation bytes a, which the combine reads at 16 bit: the GEMM model's
    convention for every output, kept). Traffic against the experts' math grows as
    1 / (expert width): narrow fine-grained experts pay most. Training counts Megatron's
    permutation separately (`moe_permute_time` in diffperf/training/_layer.py)."""
    routed, per_expert, local = _expert_rows(model, x, tokens)
    rows = per_expert * local  # the busiest GPU's routed rows, as its grouped GEMMs'
    nbytes = (permute_copy * (routed * x.h * x.sb + rows * x.h * x.ab)
              + rows * x.h * x.sb + routed * x.h * x.sb)
    share = jnp.where(x.moe, 1.0 - x.dense, 0.0)
    acc = system.accelerator
    return share * compute_cost(acc, eff, 0.0, nbytes, acc.vector_flops * eff.vector,
                                MOE_PERMUTE_KERNELS)


def _prefill_attention(model: Transformer, plan: InferencePlan, system: System,
                       eff: Efficiency, x: _Dims, runtime: Runtime) -> Cost:
    """Causal self-attention over the prompt, one layer: fused (flash) or QK^T, softmax, AV.
    The fused kernel skips the blocks outside the causal mask and a sliding window, and runs
    at the forward kernel's measured law (`costs.prefill_attention_time`: its rate on long prompts,
    a fixed time per query tile of b x heads x ceil(s / 128), the loss of a partial wave);
    the unfused path computes the whole s x s product. With a KV cache of 8 bits or fewer, a
    runtime that runs its context attention in FP8 (`Runtime.fp8_prefill_attention`) gets the
    FP8 kernel's gain (`fused_attention_rate`)."""
    b, s = plan.batch, plan.input_len
    bh = b * x.heads
    core = 0.5 * (x.qk + x.v)  # = d for standard attention
    qkvo = b * s * (x.heads + x.kv) * (x.qk + x.v) * x.ab
    acc = system.accelerator
    busy, tiles, flash_flops = _prefill_attention_busy(model, plan, system, eff, x, runtime)
    flash = eqx.tree_at(lambda c: c.compute,
                        compute_cost(acc, eff, flash_flops, qkvo, 1.0,
                                     ATTENTION_KERNELS_PREFILL_FUSED),
                        busy * prefill_wave_factor(acc, tiles))
    scores = bh * s * s
    rate = peak_matmul_flops(acc, jnp.minimum(x.math, 1.0)) * matmul_efficiency(
        eff, s, s, core, 1.0)
    unfused = compute_cost(acc, eff, 4.0 * bh * s * s * core + 5.0 * scores,
                           qkvo + scores * 4.0 * x.sb, rate, ATTENTION_KERNELS_PREFILL_UNFUSED)
    return jax.tree.map(lambda a, c: jnp.where(plan.flash_attention > 0, a, c), flash, unfused)


def _prefill_attention_busy(model: Transformer, plan: InferencePlan, system: System,
                            eff: Efficiency, x: _Dims, runtime: Runtime):
    """(busy time, query tiles, FLOPs) of one layer's fused prefill attention kernel
    (`prefill_attention_busy_time`: without the partial-wave loss, which
    `prefill_wave_factor(tiles)` adds) for `plan.batch` prompts of `plan.input_len` tokens:
    2 b a s keys d FLOPs in b a ceil(s / 128) tiles."""
    b, s = plan.batch, plan.input_len
    keys = model.attended_keys(s)  # = s without a sliding window
    core = 0.5 * (x.qk + x.v)  # = d for standard attention
    flops = 2.0 * b * x.heads * s * keys * core  # 4 b a s^2 d, halved by the causal mask
    fp8 = jnp.where(plan.kv_precision >= 2.0, runtime.fp8_prefill_attention, 0.0)
    tiles = b * x.heads * ceil_div(s, ATTENTION_Q_TILE)
    return (prefill_attention_busy_time(system.accelerator, eff, x.math, flops, tiles, s, keys,
                                        core, fp8), tiles, flops)


def _decode_attention(model: Transformer, plan: InferencePlan, system: System,
                      eff: Efficiency, x: _Dims, context) -> Cost:
    """One decode step's attention, one layer, attending over `context` cached tokens: reads
    K and V of every cached token once; FLOPs 4 b a_local L d. Both are proportional to
    `context`. With MLA (weights absorbed) it reads the cached latent and RoPE key once and
    does 2 b a_local L (c + d_r + c) FLOPs, all heads as one group.

    A grouped kernel (TensorRT-LLM's XQA, FlashInfer's and FlashMLA's decode kernels) runs on
    tensor cores with the group's g query heads as the M of its MMA tile, padded to the
    instruction's `MMA_ROWS` rows (mma.sync m16n8k16, PTX ISA): of the attention kernel's rate
    (`Efficiency.attention` x the 16-bit peak, with the size loss of its keys and head width)
    it keeps g / (16 ceil(g / 16)), e.g. 1/2 for Llama's 8 query heads per KV head. The
    generic GEMM law's 1 + c / m (c = `matmul_size_scale`, fitted on GEMMs of hundreds to
    thousands of rows) is not applied to this M: at m = 8 it would make the kernel 8x slower
    and compute-bound on an FP8 cache (16 FLOP per byte), where XQA / FlashInfer read the
    cache at most of HBM bandwidth. A per-query-head kernel (masked MHA) does scalar FP32 dot
    products on the CUDA cores, g times as many per K/V byte, and its re-reads of a group's
    K/V hit L2."""
    b = plan.batch
    flops = 2.0 * b * x.heads * context * (x.dec_k + x.dec_v)
    nbytes = b * context * x.cache * x.kb
    mean_context = model.mean_cached_tokens(plan.input_len, plan.input_len + plan.output_len)
    acc = system.accelerator
    # the attention kernel's rate with no size loss on M (q_len = inf), times the tile's use
    tensor = (fused_attention_rate(acc, eff, x.math, jnp.inf, mean_context,
                                   0.5 * (x.dec_k + x.dec_v))
              * x.group / (ceil_div(x.group, MMA_ROWS) * MMA_ROWS))
    cuda_cores = acc.vector_flops * eff.per_head_attention
    rate = jnp.where(plan.grouped_decode_attention > 0, tensor, cuda_cores)
    return compute_cost(acc, eff, flops, nbytes, rate, ATTENTION_KERNELS_DECODE)


def _pass_ops(model: Transformer, plan: InferencePlan, system: System, eff: Efficiency,
              x: _Dims, tokens, attention: Cost, runtime: Runtime) -> dict[str, Cost]:
    """All operations of one forward pass over `tokens` new tokens (all layers, all stages);
    the LM head runs on the last token of each sequence only. Launch costs are those of an
    eager launch (`inference_ops` scales them for a CUDA graph)."""
    acc, net = system.accelerator, system.network
    layers = model.layers
    ops = {"embedding": compute_cost(acc, eff, 0.0, 2.0 * tokens * x.h * x.sb, 1.0, 1.0)}
    per_layer = dict(_layer_gemms(model, system, eff, x, tokens,
                                  runtime.moe_gemm_time_factor, runtime.moe_gemm_table))
    per_layer["attention"] = attention
    per_layer["elementwise"] = _elementwise(model, system, eff, x, tokens,
                                            runtime.elementwise_kernels)
    per_layer["moe_permute"] = moe_permute_cost(model, system, eff, x, tokens,
                                                runtime.moe_permute_copy)
    msg = tokens * x.h * x.sb
    # the engine's own one-shot / two-shot kernels for small messages (`Runtime.custom_allreduce`)
    tensor_parallel = model.tp_reductions_per_pass * network_cost(
        engine_all_reduce(net, eff, msg, plan.tp, runtime.custom_allreduce), msg)
    # attention DP: each MoE layer all-gathers every rank's tokens to the experts and
    # reduce-scatters their outputs back, an all-reduce's traffic of the gathered tokens
    gathered = msg * x.dp
    moe_layers = jnp.where(x.moe, 1.0 - x.dense, 0.0)
    data_parallel = moe_layers * network_cost(coll.all_reduce(net, eff, gathered, plan.tp),
                                              gathered)
    per_layer["tp_allreduce"] = jax.tree.map(
        lambda d, t: jnp.where(plan.attention_dp > 0, d, t), data_parallel, tensor_parallel)
    ops.update({k: layers * v for k, v in per_layer.items()})
    ops["pp_send_recv"] = (plan.pp - 1.0) * network_cost(
        coll.send_recv(net, eff, msg, plan.tp), msg)
    b = plan.batch
    ops["lm_head"] = split_k_gemm_cost(acc, eff, b, x.vocab, x.h, x.head_math,
                                       bytes_per_element(x.head_math), x.sb)
    logits = b * model.vocab * 4.0  # fp32 logits gathered over the TP group
    ops["logits_gather"] = network_cost(coll.all_gather(net, eff, logits, x.atp), logits)
    ops["final"] = compute_cost(acc, eff, 5.0 * b * x.h + 5.0 * b * x.vocab,
                                b * x.h * 2.0 * x.sb + b * x.vocab * 4.0 * 2.0,
                                acc.vector_flops * eff.vector, HEAD_KERNELS - 1.0)
    return ops


def inference_ops(model: Transformer, system: System, plan: InferencePlan,
                  efficiency: Efficiency | None = None,
                  per_step_fallback: bool = False,
                  runtime: Runtime | None = None) -> dict[str, dict[str, Cost]]:
    """Per-operation costs of both phases: `{"prefill": {op: Cost}, "decode": {op: Cost}}`.

    Prefill costs are for the whole prompt pass; decode costs are summed over all
    `output_len - 1` decode steps (closed form, see the module docstring). Op names and
    categories: `OP_KINDS`. Pure JAX (jit / vmap / grad). With `output_len = 1` the decode
    costs are zero, unless `per_step_fallback` (then they are those of one step). A phase the
    `runtime` captures in a CUDA graph launches its kernels at the graph's cost
    (`diffperf.inference.graph_kernel_time`); the host's wait is not an operation (`infer` adds it).
    """
    eff = resolve_efficiency(efficiency)
    runtime = Runtime() if runtime is None else runtime
    plan = rank_plan(plan)
    x = _dims(model, plan)
    b = plan.batch
    prefill = _pass_ops(model, plan, system, eff, x, b * plan.input_len,
                        _prefill_attention(model, plan, system, eff, x, runtime), runtime)
    # With output_len = 1 there is no decode step: the ops of one step (at context input_len
    # + 1/2) are still built, so that `infer` can report a finite TPOT, then masked to zero.
    steps = jnp.maximum(plan.output_len - 1.0, 1.0)
    # Sum over the steps of the keys each step reads (the context, or the window)
    total_context = steps * model.mean_cached_tokens(plan.input_len,
                                                     plan.input_len + plan.output_len)
    attention = _decode_attention(model, plan, system, eff, x, total_context)
    attention = eqx.tree_at(lambda c: (c.launch, c.kernels), attention,
                            (attention.launch * steps, attention.kernels * steps))
    graphs = phase_graphs(plan, runtime)
    # a padded CUDA-graph replay runs the step's pass over the padded batch (the empty slots
    # read no cache: the attention above keeps the real batch)
    b_step = b + graphs["decode"] * (graph_padded_batch(b, runtime) - b)
    step = _pass_ops(model, eqx.tree_at(lambda p: p.batch, plan, b_step), system, eff, x,
                     b_step, attention, runtime)
    decode = {k: (v if k == "attention" else steps * v) for k, v in step.items()}
    replayed = graph_kernel_time(eff, runtime)
    prefill = _graph_launches(prefill, graphs["prefill"], replayed)
    decode = _graph_launches(decode, graphs["decode"], replayed)
    if not per_step_fallback:
        decode = jax.tree.map(lambda c: jnp.where(plan.output_len > 1, c, 0.0), decode)
    return {"prefill": prefill, "decode": decode}


def rank_plan(plan: InferencePlan) -> InferencePlan:
    """The plan one attention data-parallel rank runs: `batch` / `attention_ranks` sequences
    (the plan itself without attention data parallelism). The operation costs, memory and
    CUDA graphs of a plan are those of its rank; its throughput counts every rank."""
    return eqx.tree_at(lambda p: p.batch, plan, plan.batch / plan.attention_ranks)


def phase_graphs(plan: InferencePlan, runtime: Runtime) -> dict[str, jax.Array]:
    """CUDA-graph share of each phase (`diffperf.inference.graph_share`): the prefill pass of
    batch x prompt tokens, the decode steps of `batch` tokens."""
    return {"prefill": graph_share(runtime.prefill_graph, plan.batch * plan.input_len, runtime),
            "decode": graph_share(runtime.decode_graph, plan.batch, runtime)}


def _graph_launches(ops: dict[str, Cost], graph, replayed) -> dict[str, Cost]:
    """The operations of a phase with CUDA-graph share `graph`: each kernel's fixed cost
    (1 - graph) x its eager launch + graph x `replayed` (s per kernel)."""
    return {k: eqx.tree_at(lambda c: c.launch, v, (1.0 - graph) * v.launch
                           + graph * v.kernels * replayed) for k, v in ops.items()}


class PhaseBreakdown(eqx.Module):
    """Time of one phase on the critical path, by category, s. `total` is their sum; `launch`
    is the fixed per-kernel cost of all kernels (excluded from the other compute terms);
    `host` the time the GPU waits for the host to issue the work (`diffperf.inference.
    host_wait`; 0 with the default runtime)."""

    gemm: jax.Array
    attention: jax.Array
    elementwise: jax.Array
    launch: jax.Array
    tp_comm: jax.Array
    pp_comm: jax.Array
    host: jax.Array
    total: jax.Array
    kernels: jax.Array  # kernel launches, count


def _breakdown(ops: dict[str, Cost], wait) -> PhaseBreakdown:
    """The phase's breakdown given its operations and `wait(gpu_time)`, the host wait."""
    def kind_sum(kind):
        return sum(c.roofline + c.network for n, c in ops.items() if OP_KINDS[n] == kind)
    launch = sum(c.launch for c in ops.values())
    parts = {k: kind_sum(k) for k in KINDS}
    gpu = sum(parts.values()) + launch
    host = wait(gpu)
    return PhaseBreakdown(**parts, launch=launch, host=host, total=gpu + host,
                          kernels=sum(c.kernels for c in ops.values()))


class InferenceMemory(eqx.Module):
    """Per-GPU memory of the most loaded pipeline stage, B."""

    weights: jax.Array  # at the weight precision; all experts stored
    kv_cache: jax.Array  # batch * (input_len + output_len) tokens
    activations: jax.Array  # peak transient tensors (prefill of one layer + logits)
    workspace: jax.Array  # CUDA context, NCCL and GEMM workspaces (Efficiency.memory_reserve)
    total: jax.Array


def weight_bytes_per_gpu(model: Transformer, plan: InferencePlan) -> jax.Array:
    """Weights one GPU holds: its layers' share (KV projections replicated when tp > kv_heads,
    MLA's down-projections, router and norms replicated) plus the embedding and LM head shards,
    B."""
    x = _dims(model, plan)
    attn = sum(pr.share * pr.n * pr.k for pr in projections(model, x.atp))
    experts = model.num_experts / x.ep * x.f_expert  # E / ep experts of width f_expert
    mlp = model.mlp_matrices * x.h * ((1.0 - x.dense) * (experts + x.f_shared)
                                      + x.dense * x.f_dense)
    replicated = (jnp.where(x.moe, (1.0 - x.dense) * x.h * model.num_experts, 0.0) + 4.0 * x.h
                  + model.mla * (model.q_lora_rank + model.kv_lora_rank))  # MLA latent norms
    layer = (attn + mlp) * x.wb + replicated * 2.0
    # Embedding on the first stage, LM head (16 bit) on the last; both on one stage when pp = 1
    # unless they are one tied matrix.
    head = x.vocab * x.h * bytes_per_element(x.head_math)
    embed = x.vocab * x.h * x.sb
    one = (plan.pp > 1) | (model.tied_embeddings > 0)
    return model.layers / plan.pp * layer + jnp.where(one, jnp.maximum(head, embed), head + embed)


def kv_cache_bytes_per_gpu(model: Transformer, plan: InferencePlan, batch=None) -> jax.Array:
    """KV cache of one GPU: 2 (K, V) * layers/pp * kv_heads_local * head_dim * kv bytes *
    (input_len + output_len) * batch, with kv_heads_local = max(kv_heads / tp, 1); with MLA
    (kv_lora_rank + rope_head_dim) per token and layer on every GPU instead of 2 kv_heads_local
    head_dim; sliding-window layers hold at most the window, B."""
    x = _dims(model, plan)
    b = rank_plan(plan).batch if batch is None else batch
    context = model.cached_tokens(plan.input_len + plan.output_len)
    return model.layers / plan.pp * x.cache * x.kb * context * b


def _prefill_activation_bytes(model: Transformer, plan: InferencePlan) -> tuple:
    """`(per prompt token, per sequence in the pass, per sequence held)` transient activation
    bytes, B: one prefill pass holds the first two for each of its tokens / sequences, and the
    fp32 logits of a decode step (the third) are held for every sequence.

    The residual stream and the normalised input stay live through a layer; on top of them the
    attention part holds Q, K, V and the attention output, the MLP part its first GEMM's
    output(s) and the activation output. The two parts are never live at once (the engine
    reuses their buffers), so the peak takes the larger one. Unfused attention also holds a
    sequence's s x s scores per head."""
    x = _dims(model, plan)
    s = plan.input_len
    attention = (x.heads * x.qk + x.kv * (x.qk + x.v) + x.heads * x.v + x.latents) * x.ab
    mlp = model.mlp_matrices * x.ab * jnp.maximum(  # the wider of the two kinds of MLP layer
        model.experts_per_token * x.f + x.f_shared, jnp.where(x.dense > 0, x.f_dense, 0.0))
    per_token = 2.0 * x.h * x.sb + jnp.maximum(attention, mlp)
    scores = jnp.where(plan.flash_attention > 0, 0.0, x.heads * s * s * x.sb)
    return per_token, scores, x.vocab * 4.0


def _activation_bytes(model: Transformer, plan: InferencePlan) -> jax.Array:
    """Peak transient activations of the plan's batch, B: one prefill pass over all prompt
    tokens, or at most `plan.prefill_tokens` of them with chunked prefill."""
    per_token, scores, logits = _prefill_activation_bytes(model, plan)
    tokens = plan.batch * plan.input_len
    tokens = jnp.where(plan.prefill_tokens > 0, jnp.minimum(tokens, plan.prefill_tokens), tokens)
    return tokens * per_token + tokens / plan.input_len * scores + plan.batch * logits


def inference_memory(model: Transformer, plan: InferencePlan,
                     efficiency: Efficiency | None = None) -> InferenceMemory:
    """Per-GPU memory of the plan (see `InferenceMemory`)."""
    eff = resolve_efficiency(efficiency)
    w = weight_bytes_per_gpu(model, plan)
    kv = kv_cache_bytes_per_gpu(model, plan)
    act = _activation_bytes(model, rank_plan(plan))
    return InferenceMemory(weights=w, kv_cache=kv, activations=act,
                           workspace=eff.memory_reserve + 0.0 * w,
                           total=w + kv + act + eff.memory_reserve)


def max_batch(model: Transformer, system: System, plan: InferencePlan,
              efficiency: Efficiency | None = None) -> jax.Array:
    """Largest batch whose weights, KV cache, activations and workspace fit in HBM (0 if even
    the weights do not fit). Exact floor: its gradient is zero.

    Memory grows with the batch b as b (KV + logits) + min(b s, C) (prompt-token activations),
    C = `plan.prefill_tokens` (no cap when 0): the largest b either with every prompt in one
    pass (b s <= C) or with the pass full (b s >= C)."""
    eff = resolve_efficiency(efficiency)
    free = (system.accelerator.hbm_capacity - weight_bytes_per_gpu(model, plan)
            - eff.memory_reserve)
    per_token, scores, logits = _prefill_activation_bytes(model, plan)
    kv = kv_cache_bytes_per_gpu(model, plan, 1.0)
    s, cap = plan.input_len, plan.prefill_tokens
    whole = jnp.floor(free / (kv + logits + s * per_token + scores))
    chunked = jnp.floor((free - cap * (per_token + scores / s)) / (kv + logits))
    b = jnp.where((cap > 0) & (chunked * s >= cap), jnp.maximum(chunked, whole), whole)
    return jnp.maximum(b, 0.0) * plan.attention_ranks  # every rank holds its own sequences


def inference_reason(model: Transformer, plan: InferencePlan, system: System,
                     memory_total) -> jax.Array:
    """Reason code of an inference plan (0 feasible; codes of `diffperf.feasibility.REASONS`:
    1 tp does not divide heads, 2 tp vs kv_heads, 3 tp (tp / ep for the experts) does not divide
    ffn_hidden (with attention data parallelism only the experts are split), 5 pp exceeds
    layers, 8 ep does not divide the experts or tp, 9 no tensor cores
    for the GEMM precision, 10 does not fit in HBM; 11, reported first: a count that is not a
    whole number >= 1)."""
    ep_ok = divides(plan.ep, plan.tp)
    atp = plan.attention_tp
    checks = [
        (1, divides(atp, model.heads)),
        (2, divides(atp, model.kv_heads) | divides(model.kv_heads, atp)),
        (3, tp_divides_mlps(atp, model, jnp.where(model.num_experts > 1, jnp.where(
            ep_ok, plan.tp / expert_parallel_degree(model, plan), plan.tp), atp))),
        (5, plan.pp <= model.layers),
        (8, divides(plan.ep, model.num_experts) & ep_ok),
        (9, system.accelerator.peak_flops(plan.math_precision) > 0),
        (10, memory_total <= system.accelerator.hbm_capacity),
    ]
    reason = jnp.zeros(jnp.shape(memory_total), jnp.int32)
    for code, ok in reversed(checks):
        reason = jnp.where(ok, reason, code)
    counts = whole_counts(plan, ("tp", "pp", "ep", "batch", "input_len", "output_len"))
    return jnp.where(counts, reason, 11)


class InferenceReport(eqx.Module):
    """Prediction for one static batch of requests. Times in s, memory in B."""

    ttft: jax.Array  # time to first token = prefill incl. the LM head of the last prompt token
    tpot: jax.Array  # mean time per output token after the first (one decode step)
    e2e_latency: jax.Array  # ttft + (output_len - 1) * tpot
    output_tok_s_per_gpu: jax.Array  # batch * output_len / e2e / (tp * pp), tokens/s
    throughput: jax.Array  # output tokens/s of the whole job
    prefill: PhaseBreakdown
    decode: PhaseBreakdown  # summed over all decode steps
    memory: InferenceMemory
    fits: jax.Array  # memory.total <= HBM capacity
    max_batch: jax.Array  # largest batch that fits, count
    num_gpus: jax.Array
    feasible: jax.Array
    reason: jax.Array  # 0 if feasible, else a code of diffperf.feasibility.REASONS


def infer(model: Transformer, system: System, plan: InferencePlan,
          efficiency: Efficiency | None = None, runtime: Runtime | None = None
          ) -> InferenceReport:
    """Predict serving `plan` for `model` on `system`.

    Pure JAX: works unchanged under `jit`, `vmap` and `grad`. Invalid plans come back with
    `feasible = False` and a `reason` code (see `diffperf.feasibility.explain`); the numbers of
    a structurally invalid plan are not a prediction and may be anything, NaN included: mask
    them.

    **Arguments:**

    - `model`: the transformer.
    - `system`: GPUs and network.
    - `plan`: the inference plan.
    - `efficiency`: calibrated factors (default: the shipped `default_efficiency()`).
    - `runtime`: the serving engine's host costs and CUDA graphs (default `Runtime()`: the
      calibration set's TensorRT-LLM without graphs; presets: `diffperf.presets.runtime`).

    **Returns:** an `InferenceReport`.
    """
    eff = resolve_efficiency(efficiency)
    runtime = Runtime() if runtime is None else runtime
    ops = inference_ops(model, system, plan, eff, per_step_fallback=True, runtime=runtime)
    steps = plan.output_len - 1.0
    rank = rank_plan(plan)
    graphs = phase_graphs(rank, runtime)
    host = host_scale(eff, system.accelerator)
    prefill = _breakdown(ops["prefill"], lambda gpu: host_wait(
        model, rank, runtime, gpu, 1.0, graphs["prefill"], host, rank.batch))
    decode = _breakdown(ops["decode"], lambda gpu: host_wait(
        model, rank, runtime, gpu, jnp.maximum(steps, 1.0), graphs["decode"], host,
        rank.batch))
    tpot = decode.total / jnp.maximum(steps, 1.0)  # one hypothetical step when output_len = 1
    decode = jax.tree.map(lambda t: jnp.where(steps > 0, t, 0.0), decode)
    ttft = prefill.total
    # From tpot rather than from decode.total (the same value): XLA then shares one decode
    # chain between the two outputs instead of duplicating it into each (2x faster sweeps).
    e2e = ttft + jnp.where(steps > 0, tpot * steps, 0.0)
    memory = inference_memory(model, plan, eff)
    fits = memory.total <= system.accelerator.hbm_capacity
    reason = inference_reason(model, plan, system, memory.total)
    out_tokens = plan.batch * plan.output_len
    return InferenceReport(
        ttft=ttft, tpot=tpot, e2e_latency=e2e,
        output_tok_s_per_gpu=out_tokens / e2e / plan.num_gpus, throughput=out_tokens / e2e,
        prefill=prefill, decode=decode, memory=memory, fits=fits,
        max_batch=max_batch(model, system, plan, eff), num_gpus=plan.num_gpus,
        feasible=reason == 0, reason=reason)

