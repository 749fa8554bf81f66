"""The arithmetic rate of a fused (flash) attention kernel, the same in training and inference."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..specs._efficiency import Efficiency, matmul_efficiency
from ..specs._hardware import Accelerator
from ._roofline import peak_matmul_flops

#: Share of its tensor peak an FP8 fused attention kernel reaches, relative to the share a
#: 16-bit one reaches of the 16-bit peak: FlashAttention-3 on an H100 SXM5 reaches up to
#: 740 TFLOP/s in FP16 (75 % of 989) and close to 1.2 PFLOP/s in FP8 (61 % of 1,979) (Shah et
#: al. 2024, arXiv:2407.08608, abstract): (1200 / 1979) / (740 / 989) = 0.81. The softmax's
#: exponentials do not get faster with the products, so the FP8 kernel gains 1.62x, not 2x.
#: Measured on Hopper; assumed for the other FP8 GPUs.
FP8_ATTENTION_SHARE = (1200.0 / 1979.0) / (740.0 / 989.0)
#: Exponentials the special-function unit returns per FP32 FLOP of the CUDA cores on the GPUs
#: with FP8 tensor cores (compute capability 8.9-10.x): 16 exp2 results per SM per clock
#: against 128 FP32 FMA lanes x 2 FLOP (CUDA C++ Programming Guide, "Throughput of Native
#: Arithmetic Instructions"). An H100 SXM5 then computes 67 / 16 = 4.2 T exponentials/s
#: (FlashAttention-3 quotes 3.9 TFLOPS of special functions); a B200 4.7 T.
EXP_PER_VECTOR_FLOP = 16.0 / 256.0


def fused_attention_rate(acc: Accelerator, eff: Efficiency, precision, q_len, keys,
                         head_dim, fp8=0.0) -> jax.Array:
    """Achieved FLOP/s of a fused attention kernel over `q_len` queries and `keys` keys of width
    `head_dim`:

        rate = P_16 * e_attention * matmul_efficiency(q_len, keys, head_dim) / e_matmul_peak

    The kernel runs its two products in 16 bit even in fp8 / fp4 recipes (P_16: the tensor peak
    at min(`precision`, 16 bit)), at its own fraction `eff.attention` of that peak, with the
    small-size loss of a (q_len x keys x head_dim) GEMM (its `matmul_peak` factor divided out:
    `eff.attention` is the large-size fraction).

    `fp8` in [0, 1] is the share of the work an FP8 kernel runs (TensorRT-LLM's FP8 context
    FMHA), at

        rate_8 = max(rate_16, min(P_8, P_exp) * FP8_ATTENTION_SHARE * size)
        P_exp  = 4 head_dim * vector_flops * EXP_PER_VECTOR_FLOP * sfu_ratio

    the times added (1 / rate = (1 - fp8) / rate_16 + fp8 / rate_8). P_exp is the FLOP rate
    at which the special-function unit keeps up with the kernel's one exponential per score
    (4 head_dim FLOPs per score): the softmax does not get faster with the products. On an
    H100 P_exp (2.1 PFLOP/s at head_dim 128) is above the FP8 peak, and the FP8 kernel runs
    1.62x the 16-bit one (FlashAttention-3's figures); on a B200 it is about the 16-bit peak
    (FlashAttention-4: the B200's forward pass is bound by the exponentials, its SFUs
    unchanged from the H100), and FP8 gains nothing; Blackwell Ultra's doubled SFU throughput
    (`Accelerator.sfu_ratio` 2) gives back the 1.62x. A GPU without FP8 tensor cores
    (`flops_fp8` = 0) keeps the 16-bit rate.
    """
    size = eff.attention * matmul_efficiency(eff, q_len, keys, head_dim, 1.0) / eff.matmul_peak
    rate_16 = peak_matmul_flops(acc, jnp.minimum(precision, 1.0)) * size
    p_exp = 4.0 * head_dim * acc.vector_flops * EXP_PER_VECTOR_FLOP * acc.sfu_ratio
    # flops_fp8 = 0 (no FP8 tensor cores) leaves rate_8 = rate_16
    rate_8 = jnp.maximum(rate_16, jnp.minimum(acc.flops_fp8, p_exp) * FP8_ATTENTION_SHARE * size)
    return 1.0 / ((1.0 - fp8) / rate_16 + fp8 / rate_8)


#: Query rows of one tile of a fused attention kernel (one thread block's queries):
#: FlashAttention-2 / -3 and TensorRT-LLM's context FMHA use 128 at head width 128.
ATTENTION_Q_TILE = 128.0
#: Fixed time of one query tile of a forward (prefill) fused attention kernel on the SM that
#: runs it, s: tau = `PREFILL_TILE_TIME_FIXED` + `PREFILL_TILE_TIME_PER_WIDTH` x head_dim / 128.
#: Loading the tile's queries, the causal diagonal block and writing the output move head_dim
#: elements per row (the part that grows with the head width); the rest (the kernel's setup,
#: the diagonal block's softmax, the pipeline's fill and drain) does not. Its length does not
#: shrink with the tensor cores: the same on A100, H100 and B200. Fitted with
#: `PREFILL_WAVE_LOSS`, `PREFILL_SFU_SHARE` and one `Efficiency.prefill_attention` per engine
#: and GPU to NVIDIA's measured context-attention kernels (`benchmarks_data/
#: attention_kernels_published.csv`: its 1,749 bf16 kernels of 50 us or more at head widths
#: 64, 128 and 256, with and without a 128-token sliding window, with a 5 us fixed cost per
#: call; RMS log error 0.16; `python calibration/attention_kernels.py --fit`): 5.52 + 4.99 x
#: head_dim / 128 us (10.5 us at head width 128, 8.0 at 64, 15.5 at 256).
PREFILL_TILE_TIME_FIXED = 5.52e-6
#: The part of a query tile's fixed time that grows with the head width, s per 128 (fitted).
PREFILL_TILE_TIME_PER_WIDTH = 4.99e-6
#: Waves w0 of query tiles (tiles / SMs) that the kernel's tail and the causal imbalance of its
#: tiles cost: the time grows by (w + w0) / w, so one wave of tiles runs at 47 % of the rate of
#: many. Fitted with the tile time.
PREFILL_WAVE_LOSS = 1.11
#: Share of the special-function unit's exponential rate a prefill attention kernel reaches
#: where the softmax binds (fitted with the tile time): on a B200 at head width 64 (gpt-oss)
#: one exponential per 256 FLOPs caps the kernel at 0.78 x 1.2 = 0.93 PFLOP/s, 0.41 of the
#: 16-bit peak, where NVIDIA's measured 16k-token kernels run 1.35x slower than the tensor-core
#: rate alone says (FlashAttention-4: Blackwell's forward pass is bound by the exponentials).
PREFILL_SFU_SHARE = 0.775
#: p of the p-norm smooth minimum of the tensor-core rate and the exponentials' rate (at a tie
#: the rate is 2^(-1/8) = 0.917 of either).
PREFILL_SFU_SHARPNESS = 8.0


def prefill_attention_time(acc: Accelerator, eff: Efficiency, precision, flops, tiles, q_len,
                           keys, head_dim, fp8=0.0) -> jax.Array:
    """Time of a forward-only (prefill) fused causal attention kernel doing `flops` FLOPs in
    `tiles` query tiles (batch x heads x ceil(q_len / `ATTENTION_Q_TILE`)), s:

        t = (flops / R + tau * tiles / SMs) * (w + w0) / w,   w = tiles / SMs,
        R = R_16 / ((1 - fp8) + fp8 / g_8),
        R_16 = (( P_16 e_prefill)^-p + (P_exp s_sfu)^-p)^(-1/p),   P_exp = 4 d x exp/s

    with e_prefill = `Efficiency.prefill_attention`, tau = `prefill_tile_time(d)` (d =
    `head_dim`), w0 = `PREFILL_WAVE_LOSS`, P_exp the FLOP rate at which the special-function
    unit returns the softmax's one exponential per score (4 d FLOPs per score; GPUs with FP8
    tensor cores, as in `fused_attention_rate`; none on the others), s_sfu =
    `PREFILL_SFU_SHARE`, p = `PREFILL_SFU_SHARPNESS`, and g_8 the FP8 kernel's gain over the
    16-bit one (`fused_attention_rate`'s ratio at this shape; at head width 128: 1.62x on
    Hopper, 1 on B200, 1
    without FP8 tensor cores) for the share `fp8` of the work run in FP8. The exponentials
    bind at narrow heads on Blackwell (head width 64 on a B200: 0.93 PFLOP/s against 1.33 from
    the tensor cores). The fixed time per tile makes a
    short prompt's kernel slow per FLOP (a 512-token prompt at full occupancy reaches about
    a third of the rate of a 16k one on an H100), the partial wave a single short prompt's
    (batch 1 x 32 heads x 4 tiles fills one wave of 132 SMs). The training path keeps
    `fused_attention_rate` (its backward is fitted with it)."""
    return (prefill_attention_busy_time(acc, eff, precision, flops, tiles, q_len, keys,
                                        head_dim, fp8)
            * prefill_wave_factor(acc, tiles))


def prefill_wave_factor(acc: Accelerator, tiles) -> jax.Array:
    """(w + w0) / w, w = `tiles` / SMs, w0 = `PREFILL_WAVE_LOSS`: how much longer than its busy
    time a prefill attention kernel of `tiles` query tiles takes (>= 1)."""
    waves = jnp.maximum(tiles / acc.num_sms, 1e-9)  # > 0: no prompt costs 0, not 0 x inf
    return (waves + PREFILL_WAVE_LOSS) / waves


def prefill_attention_busy_time(acc: Accelerator, eff: Efficiency, precision, flops, tiles,
                                q_len, keys, head_dim, fp8=0.0) -> jax.Array:
    """`prefill_attention_time` without its partial-wave loss, flops / R + tau x tiles / SMs,
    s: the time of the same work in a kernel of many waves. A kernel of w waves takes
    busy x (w + w0) / w, so n prompts alike take (n + w0 SMs / tiles_1) x the busy time of one
    (tiles_1 its tiles): the serving simulator's affine prefill cost
    (`diffperf.inference.iteration_cost`)."""
    p16 = peak_matmul_flops(acc, jnp.minimum(precision, 1.0))
    width = jnp.maximum(head_dim, 1e-3)  # a zero width is no attention: keep the rates finite
    gain = (fused_attention_rate(acc, eff, precision, q_len, keys, width, 1.0)
            / fused_attention_rate(acc, eff, precision, q_len, keys, width, 0.0))
    tensor = p16 * eff.prefill_attention
    # the exponentials' rate (no cap without FP8 tensor cores, whose SFU-to-FP32 ratio the
    # constant does not describe), combined as m (1 + (m / M)^p)^(-1/p) with m, M the smaller
    # and larger rate: the p-norm of the reciprocals, with no overflow when one is tiny
    exp_rate = jnp.where(acc.flops_fp8 > 0,
                         4.0 * width * acc.vector_flops * EXP_PER_VECTOR_FLOP * acc.sfu_ratio
                         * PREFILL_SFU_SHARE, jnp.inf)
    low, high = jnp.minimum(tensor, exp_rate), jnp.maximum(tensor, exp_rate)
    ratio = jnp.where(jnp.isfinite(high), low / jnp.where(jnp.isfinite(high), high, 1.0), 0.0)
    rate_16 = low * (1.0 + ratio ** PREFILL_SFU_SHARPNESS) ** (-1.0 / PREFILL_SFU_SHARPNESS)
    rate = rate_16 / ((1.0 - fp8) + fp8 / gain)
    return flops / rate + prefill_tile_time(head_dim) * tiles / acc.num_sms


def prefill_tile_time(head_dim) -> jax.Array:
    """Fixed time of one query tile of a prefill attention kernel at head width `head_dim`, s:
    `PREFILL_TILE_TIME_FIXED` + `PREFILL_TILE_TIME_PER_WIDTH` x head_dim / 128."""
    return PREFILL_TILE_TIME_FIXED + PREFILL_TILE_TIME_PER_WIDTH * head_dim / 128.0
