"""The arithmetic rate of a fused (flash) attention kernel, the same in training and inference."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..specs._efficiency import Efficiency, matmul_efficiency
from ..specs._hardware import Accelerator
from ._roofline import peak_matmul_flops


def fused_attention_rate(acc: Accelerator, eff: Efficiency, precision, q_len, keys,
                         head_dim) -> jax.Array:
    """Achieved FLOP/s of a fused attention kernel over `q_len` queries and `keys` keys of width
    `head_dim`:

        rate = P_16 * e_attention * matmul_efficiency(q_len, keys, head_dim) / e_matmul_peak

    The kernel runs its two products in 16 bit even in fp8 / fp4 recipes (P_16: the tensor peak
    at min(`precision`, 16 bit)), at its own fraction `eff.attention` of that peak, with the
    small-size loss of a (q_len x keys x head_dim) GEMM (its `matmul_peak` factor divided out:
    `eff.attention` is the large-size fraction).
    """
    return (peak_matmul_flops(acc, jnp.minimum(precision, 1.0)) * eff.attention
            * matmul_efficiency(eff, q_len, keys, head_dim, 1.0) / eff.matmul_peak)
