"""The roofline primitive: how long one kernel takes on one GPU.

A kernel moves bytes through each memory level and executes FLOPs; its time is the smooth
maximum of the per-resource times plus a fixed per-kernel overhead:

    t = smax(F / (P * e_mm), B_hbm / (BW_hbm * e_hbm), B_l2 / (BW_l2 * e_l2)) + n_k * t_k

The smooth maximum (see `smooth_max`) lets gradients reach whichever resource is near-binding.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..specs._efficiency import Efficiency
from ..specs._hardware import BYTES_PER_ELEMENT, Accelerator

#: Sharpness of the smooth maximum: at a tie the result exceeds the max by this fraction
#: (kernels whose compute and memory times are equal reach neither roof); far from a tie the
#: excess falls off as SHARPNESS**2 / 4 of the larger term.
SHARPNESS = 0.1
#: Knee of the smooth maximum for a GEMM's compute and operand-streaming times. A GEMM near its
#: ridge point overlaps the two imperfectly (pipeline prologue and epilogue, few k-iterations
#: per output tile): at a tie it takes 1.3x the larger term, 8.6 % more at a 2:1 ratio, 2.2 %
#: more when purely compute- or memory-bound (that constant share is absorbed by the fitted
#: `matmul_peak` / `hbm`). Chosen by leave-one-source-out cross-validation among 0.1 (the generic
#: knee), 0.3 and 0.6: 0.3 cut the TensorRT-LLM first-token-latency error (prefill GEMMs at
#: M = 128 sit at the ridge) without moving the training error (calibration/report.md).
GEMM_SHARPNESS = 0.3


def smooth_max(a: jax.Array, b: jax.Array, sharpness: float = SHARPNESS) -> jax.Array:
    """Smooth maximum of two non-negative times.

    `(a + b + sqrt((a - b)^2 + (k (a + b))^2)) / 2` with k = `sharpness`: equals
    `max(a, b) * (1 + k)` at a tie and `max(a, b) * (1 + O(k^2))` far from it. Cheap (one
    square root), scale-free, differentiable everywhere except at a = b = 0 (where the gradient
    is defined as that of max via the `+ tiny`).
    """
    s = a + b
    return 0.5 * (s + jnp.sqrt((a - b) ** 2 + (sharpness * s) ** 2 + 1e-30))


def exposed_after_overlap(total: jax.Array, window: jax.Array) -> jax.Array:
    """Part of a transfer of duration `total` left exposed when it can overlap a compute window
    of duration `window`: a smooth `clip(total - window, 0, total)`.

    Uses `(x + sqrt(x^2 + (k total)^2)) / 2` with x = total - window and k = `SHARPNESS`, so the
    smoothing scales with the transfer itself: it is non-increasing in `window`, equals about
    `total * (1 + k^2 / 4)` (capped at `total`) with no window and falls like
    `k^2 total^2 / (4 window)` when the window is much longer.
    """
    x = total - window
    c2 = (SHARPNESS * total) ** 2 + 1e-30
    # For a well-hidden transfer (x << 0) the direct form cancels catastrophically in float32;
    # its conjugate c^2 / (2 (sqrt(x^2 + c^2) - x)) is the same value computed stably.
    x_pos, x_neg = jnp.maximum(x, 0.0), jnp.minimum(x, 0.0)
    soft = jnp.where(x >= 0, 0.5 * (x_pos + jnp.sqrt(x_pos * x_pos + c2)),
                     0.5 * c2 / (jnp.sqrt(x_neg * x_neg + c2) - x_neg))
    return jnp.minimum(soft, total)


def ceil_div(a: jax.Array | float, b: jax.Array | float) -> jax.Array:
    """`ceil(a / b)` in the forward pass with the gradient of `a / b` (straight-through).

    Exact for integer-valued a, b (below 2^24 in float32) even though XLA evaluates `a / b` as
    `a` times a rounded reciprocal when `b` is a constant, which can put an exact quotient one
    ulp above the integer (21 / 7 -> 3.0000002, so 4 waves instead of 3): a ceiling k whose
    predecessor times b already reaches a is lowered to k - 1.
    """
    q = a / b
    k = jnp.ceil(q)
    k = jnp.where((k - 1.0) * b >= a, k - 1.0, k)
    return q + jax.lax.stop_gradient(k - q)


def peak_matmul_flops(acc: Accelerator, precision) -> jax.Array:
    """Dense tensor FLOP/s at a precision code, floored at 1 FLOP/s so unsupported precisions give
    a finite (huge) time instead of inf; plans flag them infeasible."""
    return jnp.maximum(acc.peak_flops(precision), 1.0)


def bytes_per_element(precision) -> jax.Array:
    """Bytes per element of a precision code (fp32 4, bf16 2, fp8 1, fp4 0.5625: NVFP4's 4-bit
    values and one 8-bit scale per 16, `specs.BYTES_PER_ELEMENT`)."""
    p = jnp.asarray(precision)
    b = BYTES_PER_ELEMENT
    return jnp.where(p == 0, b[0], jnp.where(p == 1, b[1], jnp.where(p == 2, b[2], b[3])))


#: Resources an `OpCost` can be bound by, in the order of its time fields (`OpCost.bound`).
OP_RESOURCES = ("compute", "memory", "l2", "network", "launch")


class OpCost(eqx.Module):
    """Resources and time of one operation on one GPU, as `op_time` charges them (the training
    counterpart of inference's `Cost` record, with the L2 roof and the exact `time`).

    Arithmetic `flops` (FLOP), `hbm_bytes` / `l2_bytes` / `network_bytes` moved (B), `kernels`
    launched (count); the times each resource alone would take, s: `compute` = flops / rate,
    `memory` = hbm_bytes / (BW_hbm e_hbm), `l2` = l2_bytes / (BW_l2 e_l2), `network` (a
    collective's time, 0 for a kernel), `launch` = kernels * t_kernel; and `time`, s: for a
    kernel smax(smax(compute, memory), l2) + launch (`op_time`), for a collective its
    `network` time. A sum of records (`+`) or a multiple (`*`) sums or scales every field, so
    a record may stand for several kernels or for a share-weighted mean over layers.
    """

    flops: jax.Array
    hbm_bytes: jax.Array
    l2_bytes: jax.Array
    network_bytes: jax.Array
    kernels: jax.Array
    compute: jax.Array
    memory: jax.Array
    l2: jax.Array
    network: jax.Array
    launch: jax.Array
    time: jax.Array

    @classmethod
    def zero(cls) -> OpCost:
        """An operation that does not occur: every field 0."""
        return cls(*(jnp.zeros(()) for _ in range(11)))

    @classmethod
    def transfer(cls, time, nbytes) -> OpCost:
        """A collective (or copy) moving `nbytes` B in `time` s, no kernels counted."""
        zero = jnp.zeros_like(jnp.asarray(time, dtype=jnp.result_type(float)))
        return cls(zero, zero, zero, nbytes + zero, zero, zero, zero, zero, time + zero, zero,
                   time + zero)

    @property
    def bound(self) -> jax.Array:
        """Index in `OP_RESOURCES` of the largest of the compute, memory, L2, network and
        launch times: the resource that binds (0, compute, for an absent op)."""
        parts = jnp.stack([self.compute, self.memory, self.l2, self.network, self.launch], -1)
        return jnp.argmax(parts, axis=-1)

    def where(self, condition) -> OpCost:
        """This record where `condition` holds, else the zero record (`jnp.where` per field)."""
        return jax.tree.map(lambda x: jnp.where(condition, x, 0.0), self)

    def __add__(self, other) -> OpCost:
        if isinstance(other, (int, float)) and other == 0:
            return jax.tree.map(lambda x: other + x, self)  # `sum()` starts at 0: 0 + x
        return jax.tree.map(lambda a, b: a + b, self, other)

    __radd__ = __add__

    def __mul__(self, n) -> OpCost:
        """`n` executions, or a weight `n` (every field scales linearly)."""
        return jax.tree.map(lambda x: x * n, self)

    def __rmul__(self, n) -> OpCost:
        return jax.tree.map(lambda x: n * x, self)


def op_cost(acc: Accelerator, eff: Efficiency, flops, hbm_bytes, l2_bytes=0.0, kernels=1.0,
            flops_per_s=None, sharpness: float = SHARPNESS) -> OpCost:
    """`op_time` with its parts: the `OpCost` of a kernel (or fused group of `kernels`
    kernels) on one GPU; its `time` is `op_time`'s value (same arguments)."""
    if flops_per_s is None:
        flops_per_s = acc.vector_flops * eff.vector
    t_compute = flops / flops_per_s
    t_hbm = hbm_bytes / (acc.hbm_bandwidth * eff.hbm)
    t_l2 = l2_bytes / (acc.l2_bandwidth * eff.l2)
    t = smooth_max(smooth_max(t_compute, t_hbm, sharpness), t_l2)
    launch = kernels * (acc.launch_overhead + eff.kernel_overhead)
    zero = jnp.zeros_like(t)
    return OpCost(flops=flops + zero, hbm_bytes=hbm_bytes + zero, l2_bytes=l2_bytes + zero,
                  network_bytes=zero, kernels=kernels + zero, compute=t_compute + zero,
                  memory=t_hbm + zero, l2=t_l2 + zero, network=zero, launch=launch + zero,
                  time=t + launch)


def op_time(acc: Accelerator, eff: Efficiency, flops, hbm_bytes, l2_bytes=0.0, kernels=1.0,
            flops_per_s=None, sharpness: float = SHARPNESS) -> jax.Array:
    """Time of a kernel (or fused group of `kernels` kernels) on one GPU, s:
    smax(smax(F / rate, B_hbm / (BW_hbm e_hbm), sharpness), B_l2 / (BW_l2 e_l2)) + kernels *
    (launch_overhead + kernel_overhead) (`op_cost` returns the parts too).

    **Arguments:**

    - `flops`: arithmetic work, FLOP.
    - `hbm_bytes`, `l2_bytes`: traffic to HBM and to L2, B.
    - `kernels`: kernel launches the op needs, count.
    - `flops_per_s`: achieved arithmetic rate, FLOP/s (default: the vector units at
      `eff.vector`, right for element-wise kernels).
    - `sharpness`: knee of the smooth maximum of the compute and HBM times (`smooth_max`).
    """
    return op_cost(acc, eff, flops, hbm_bytes, l2_bytes, kernels, flops_per_s, sharpness).time
