"""The GEMM model: how long `batch` (m x k) @ (k x n) matrix products take on one GPU.

Both phases count the same work:

    FLOPs = 2 batch m n k
    HBM bytes = batch (m k a + k n w + m n a)   (activations in and out at a B, weights at w B)

and run it at `peak * matmul_efficiency(m, n, k)`, the smooth size loss of `specs._efficiency`.
They differ in how the output tiles fill the GPU's SMs, because their GEMMs differ in shape:

- `gemm_time` (training): large GEMMs of many tiles run in waves of one tile per SM; the
  padding of the last tile row / column and the idle share of the last wave are lost
  (`tile_efficiency`). Fewer tiles than SMs are assumed to split the k loop at no extra cost.
  L2 operand traffic is counted as a third roof.
- `split_k_gemm_cost` (inference): skinny decode GEMMs have fewer output tiles than the GPU has
  SMs. One kernel then runs on the busy share of the SMs; split-K fills every SM but needs a
  second kernel to reduce the partial sums. The cheaper of the two is taken, as a GEMM
  library's heuristic would. Above one tile per SM no wave quantisation is applied.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..specs._efficiency import Efficiency, matmul_efficiency
from ..specs._hardware import Accelerator
from ._cost import Cost, compute_cost
from ._roofline import (
    GEMM_SHARPNESS,
    OpCost,
    bytes_per_element,
    ceil_div,
    op_cost,
    peak_matmul_flops,
)

#: GEMM output tile edge used for wave/tile quantisation and L2 operand traffic, elements.
TILE = 128
#: Effective operand reuse of a GEMM's L2 traffic (CTA-cluster tile edge), elements.
L2_REUSE = 256
#: Row granularity of a tensor-core GEMM tile for skinny GEMMs (MMA instruction m), elements.
MMA_ROWS = 16
#: Fixed cost of one fp8 output tile's k loop (prologue: filling the operand pipeline; epilogue:
#: the accumulator's scaling and write-back), in k elements of the loop's own speed: an fp8 GEMM
#: reaches `k / (k + K_LOOP_FP8)` of its long-k rate. Fitted (one value, RMS 6 %) to the ten
#: m >= 4,096 FP8 GEMMs DeepGEMM publishes for H800 (deepseek-ai/DeepGEMM README, "Normal GEMMs
#: for dense models" and "Grouped GEMMs for MoE models (contiguous layout)"): 590 TFLOPS at
#: k = 512, 990 at k = 1,536, 1,025-1,099 at k = 2,048, 1,288-1,304 at k = 7,168 and 1,358 at
#: k = 16,384 (m = 4,096-8,192, n >= 4,096), elements.
K_LOOP_FP8 = 644.0
#: Most a dense 4-bit (NVFP4) linear layer of an inference engine runs above the same GPU's FP8
#: tensor peak, ratio: the tensor cores run 2x (B200, GB200) or 3x (B300, GB300) the FP8 rate,
#: but the engine's block-scaled GEMMs reach far less of it (whether operand and scale-factor
#: delivery or the kernels' tactics bind, the tables do not say: a measured ratio, not a
#: mechanism). In NVIDIA's measured TensorRT-LLM
#: 1.3 linear layers (AIConfigurator @095f58a5, `gemm_perf.parquet`, m >= 2,048, n and k >=
#: 4,096: 2,259 shapes per GPU) an NVFP4 GEMM takes 1 / 1.48 (B200), 1 / 1.57 (GB200), 1 / 1.67
#: (B300) and 1 / 1.61 (GB300) of the FP8 one's time at the same shape: 0.39, 0.37, 0.31 and 0.29
#: of the FP4 peak, against 0.48-0.55 of the FP8 peak for FP8. The median of the four
#: (`split_k_gemm_cost`'s `fp4_cap`). Not applied to MoE experts (TensorRT-LLM's TRTLLM-Gen MoE
#: kernels reach the model's uncapped FP4 rate within 20 %, `tests/test_moe_kernels_published.py`)
#: nor to training GEMMs (no measurement).
FP4_GEMM_OVER_FP8 = 1.59
#: Share of the 16-bit tensor rate a weight-only 4-bit MoE expert GEMM (MXFP4 / NVFP4 / int4
#: weights x 16-bit activations: gpt-oss on Hopper) issues on a GPU with FP8 tensor cores,
#: ratio: its kernels dequantise the weights to 16 bit inside the main loop, on the CUDA cores,
#: once per row tile (a measured ratio, not a model of that work). Fitted (least squares in
#: log) to NVIDIA's measured TensorRT-LLM 1.3 Triton MoE backend in W4A16 on H100 and H200
#: (AIConfigurator @095f58a5 `moe_perf.parquet`, `moe_dtype` w4a16_mxfp4, gpt-oss-20b / 120b on
#: one GPU, balanced routing, 1-16,384 tokens: 81 modules): the kernels level off at 375-385
#: TFLOP/s (39 % of the 16-bit peak) where the model's 16-bit rate gave 1.7-1.8x that; RMS log
#: 0.40 -> 0.21, MAPE 27.7 -> 16.9 % (`benchmarks_data/moe_kernels_published.csv`, the
#: `triton` rows). Blackwell's TRTLLM-Gen W4A16 modules run slower still (2.6-5.3x the model):
#: the share is a lower bound of the slowdown there. Not applied on GPUs without FP8 tensor
#: cores (Ampere's Marlin kernels: no measurement), to dense layers, nor to training.
W4A16_MOE_PEAK_SHARE = 0.62


def gemm_flops(m, n, k, batch=1.0) -> jax.Array:
    """Arithmetic of `batch` (m x k) @ (k x n) GEMMs: 2 batch m n k, FLOP."""
    return 2.0 * batch * m * n * k


def gemm_hbm_bytes(m, n, k, weight_bytes, act_bytes, batch=1.0) -> jax.Array:
    """HBM traffic of `batch` GEMMs reading both operands and writing the output once:
    batch (m k a + k n w + m n a), with a = `act_bytes` per activation element and
    w = `weight_bytes` per weight element, B."""
    return batch * (m * k * act_bytes + k * n * weight_bytes + m * n * act_bytes)


def tile_efficiency(acc: Accelerator, m, n, batch=1.0) -> jax.Array:
    """Fraction of the tensor-core work of an m x n output that is useful, s.t. tile and wave
    quantisation.

    Output tiles are `TILE` x `TILE` (rows shrink to a multiple of `MMA_ROWS` for skinny GEMMs,
    as cuBLAS picks small-m kernels); padding wastes `m n / (m_pad n_pad)`. With at least one
    tile per SM, tiles run in waves of `num_sms` and the last wave is partly idle; with fewer
    tiles than SMs the kernel splits the k loop (split-K) and keeps every SM busy. Exact
    ceilings forward, straight-through gradients.
    """
    tile_m = jnp.minimum(TILE, ceil_div(m, MMA_ROWS) * MMA_ROWS)
    tiles_m = ceil_div(m, tile_m)
    tiles_n = ceil_div(n, TILE)
    padding = (m * n) / (tiles_m * tile_m * tiles_n * TILE)
    tiles = tiles_m * tiles_n * batch
    waves = ceil_div(tiles, acc.num_sms)
    wave = jnp.where(tiles >= acc.num_sms, tiles / (waves * acc.num_sms), 1.0)
    return padding * wave


def k_loop_loss(m, n, k, precision) -> jax.Array:
    """Time factor >= 1 of a training GEMM's fixed k-loop cost per output tile, mean over the
    three GEMMs of a weight (forward: reduction over k; data gradient: over n; weight gradient:
    over m), for fp8 / fp4 GEMMs:

        1 + (k0 / 3) (1/m + 1/n + 1/k),   k0 = `K_LOOP_FP8` * 2^(p - 2)

    (p the precision code: 2 fp8, 3 fp4; 1 for 16 bit and fp32, whose fixed cost stays in the
    fitted `matmul_size_scale`). Each GEMM of reduction depth K takes (K + k0) / K times its
    long-k time (`K_LOOP_FP8`); the mean of the three keeps the backward pass at twice the
    forward's time (`training._layer.LayerGemms`), so the forward GEMM alone carries the mean
    of its pass's three depths, and the step's sum is right. fp4 halves the time of each k step
    again against a fixed cost that does not shrink (the epilogue writes the same 16-bit
    output), so its k0 doubles: an assumption, unmeasured. Narrow fine-grained experts (k = 768
    for Qwen3-30B-A3B's down projection) lose most: 1.47 against about 1.09 for a dense GEMM of
    8,192 x 8,192 x 8,192."""
    p = jnp.asarray(precision)
    k0 = jnp.where(p >= 2, K_LOOP_FP8 * 2.0 ** (p - 2.0), 0.0)
    return 1.0 + k0 / 3.0 * (1.0 / m + 1.0 / n + 1.0 / k)


def k_loop_forward(k, precision) -> jax.Array:
    """Time factor >= 1 of one fp8 / fp4 GEMM of reduction depth k from its k loop's fixed cost
    per output tile: 1 + k0 / k, k0 = `K_LOOP_FP8` * 2^(p - 2) (1 in 16 bit and fp32). The
    forward-only (inference) counterpart of `k_loop_loss`."""
    p = jnp.asarray(precision)
    k0 = jnp.where(p >= 2, K_LOOP_FP8 * 2.0 ** (p - 2.0), 0.0)
    return 1.0 + k0 / k


def gemm_time(acc: Accelerator, eff: Efficiency, m, n, k, precision, batch=1.0,
              act_bytes=None, kernels=1.0, k_loop=False) -> jax.Array:
    """Time of `batch` independent (m x k) @ (k x n) GEMMs in `kernels` launches (one batched
    kernel by default; `batch` for one kernel per GEMM), wave-quantised, s: `gemm_cost(...)
    .time` (the model is stated there)."""
    return gemm_cost(acc, eff, m, n, k, precision, batch, act_bytes, kernels, k_loop).time


def gemm_cost(acc: Accelerator, eff: Efficiency, m, n, k, precision, batch=1.0,
              act_bytes=None, kernels=1.0, k_loop=False) -> OpCost:
    """The `OpCost` of `batch` independent (m x k) @ (k x n) GEMMs in `kernels` launches:
    FLOPs, HBM and L2 bytes, each roof's time and the total `time` (`gemm_time`), s.

    FLOPs (`gemm_flops`) at `peak * matmul_efficiency * tile_efficiency`, divided by
    `k_loop_loss` where `k_loop` (a bool or boolean array; True for a routed expert's grouped
    GEMM: its narrow k and n leave the range of the dense GEMMs whose fixed costs the fitted
    `matmul_size_scale` and `matmul_lowp` already carry); HBM traffic
    (`gemm_hbm_bytes`) with `act_bytes` per activation element (default the precision's width)
    and weights at the precision's width; L2 traffic is the tile-reuse operand stream
    `2*m*n*k*B / L2_REUSE`. Compute and HBM times meet at the GEMM knee `GEMM_SHARPNESS`.
    """
    b = bytes_per_element(precision)
    ab = b if act_bytes is None else act_bytes
    flops = gemm_flops(m, n, k, batch)
    m_pad = ceil_div(m, MMA_ROWS) * MMA_ROWS  # size effects act on the padded tile rows
    rate = (peak_matmul_flops(acc, precision) * matmul_efficiency(eff, m_pad, n, k, precision)
            * tile_efficiency(acc, m, n, batch))
    if k_loop is not False:  # a Python False keeps the term out of the trace
        rate = rate / jnp.where(k_loop, k_loop_loss(m_pad, n, k, precision), 1.0)
    hbm = gemm_hbm_bytes(m, n, k, b, ab, batch)
    l2 = flops * b / L2_REUSE
    return op_cost(acc, eff, flops, hbm, l2, kernels=kernels, flops_per_s=rate,
                   sharpness=GEMM_SHARPNESS)


def split_k_gemm_cost(acc: Accelerator, eff: Efficiency, m, n, k, math, w_bytes, a_bytes,
                      groups=1.0, peak_fraction=1.0, fp4_cap=True) -> Cost:
    """`groups` independent (m x k) @ (k x n) GEMMs in one kernel: weights (k x n) at
    `w_bytes` per element, activations in and out at `a_bytes`, on `peak_fraction` of the
    tensor peak (`InferencePlan.gemm_peak_fraction`); a `Cost`.

    When the output, m x n counted in `TILE`-square tiles, is fewer tiles than the GPU has SMs,
    one kernel leaves SMs idle: it runs at the busy share u = tiles / SMs of the GPU's FLOP/s
    and bandwidth. Split-K (the standard remedy) fills every SM but needs a second kernel to
    reduce the partial sums (they stay in L2: no extra HBM traffic counted). The cheaper of the
    two is taken, as a library's heuristic would: skinny decode GEMMs split, GEMMs close to one
    tile per SM do not. The cost is continuous in m; between the switch and one tile per SM it
    falls by up to one kernel launch as fewer SMs sit idle. A 4-bit GEMM runs against at most
    `FP4_GEMM_OVER_FP8` x the FP8 peak where `fp4_cap` (a bool or boolean array) is true; False
    for MoE experts."""
    flops = gemm_flops(m, n, k, groups)
    nbytes = gemm_hbm_bytes(m, n, k, w_bytes, a_bytes, groups)
    peak = peak_matmul_flops(acc, math)
    if fp4_cap is not False:  # a dense 4-bit GEMM: at most FP4_GEMM_OVER_FP8 x the FP8 peak
        peak = jnp.where(jnp.asarray(fp4_cap) & (jnp.asarray(math) >= 3), jnp.minimum(
            peak, jnp.maximum(FP4_GEMM_OVER_FP8 * acc.flops_fp8, 1.0)), peak)
    rate = peak * peak_fraction * matmul_efficiency(eff, m, n, k, math)
    busy = jnp.clip(groups * m * n / TILE**2 / acc.num_sms, 1e-6, 1.0)
    split = compute_cost(acc, eff, flops, nbytes, rate, 2.0, GEMM_SHARPNESS)
    whole = compute_cost(acc, eff, flops, nbytes, rate * busy, 1.0, GEMM_SHARPNESS)
    whole = eqx.tree_at(lambda c: c.memory, whole, whole.memory / busy)
    use_split = (busy < 1.0) & (split.time < whole.time)
    return jax.tree.map(lambda a, b: jnp.where(use_split, a, b), split, whole)
