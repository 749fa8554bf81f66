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
