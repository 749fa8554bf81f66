"""`Cost`: the resources of one operation, and its time.

An operation executes FLOPs at some rate, moves bytes through HBM, spends time on the network
and launches kernels:

    time = smax(FLOPs / rate, bytes / (BW_hbm * e_hbm)) + network + kernels * t_kernel

with `smax` the smooth maximum of `smooth_max` and `t_kernel = launch_overhead +
kernel_overhead` the fixed cost of one kernel. Keeping the terms apart (not only their sum) is
what lets a report say which resource binds.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..specs._efficiency import Efficiency
from ..specs._hardware import Accelerator
from ._roofline import SHARPNESS, smooth_max


class Cost(eqx.Module):
    """Resources of one operation summed over all its executions in a phase (one GPU).

    `compute` and `memory` are the times the op would take if only arithmetic or only HBM
    traffic limited it; `network` is communication time (bandwidth + latency + software
    overhead); `launch` is the fixed per-kernel cost. All times s, `flops` FLOP, `bytes` B.
    """

    flops: jax.Array
    bytes: jax.Array
    compute: jax.Array
    memory: jax.Array
    network: jax.Array
    launch: jax.Array
    kernels: jax.Array
    sharpness: float = eqx.field(static=True, default=SHARPNESS)  # knee of the smooth maximum

    @property
    def roofline(self) -> jax.Array:
        """Smooth maximum of the compute and memory times (exactly 0 for an absent op), s."""
        return jnp.where(self.compute + self.memory > 0,
                         smooth_max(self.compute, self.memory, self.sharpness), 0.0)

    @property
    def time(self) -> jax.Array:
        """Total time of the operation, s."""
        return self.roofline + self.network + self.launch

    def __mul__(self, n) -> Cost:
        """The cost of `n` executions (exact: every field scales linearly)."""
        return jax.tree.map(lambda x: x * n, self)

    __rmul__ = __mul__


def kernel_time(acc: Accelerator, eff: Efficiency) -> jax.Array:
    """Fixed cost of one kernel: `launch_overhead + kernel_overhead`, s."""
    return acc.launch_overhead + eff.kernel_overhead


def compute_cost(acc: Accelerator, eff: Efficiency, flops, nbytes, rate, kernels,
                 sharpness: float = SHARPNESS) -> Cost:
    """A kernel (or `kernels` kernels) doing `flops` FLOP at `rate` FLOP/s and moving `nbytes` B
    through HBM: compute = flops / rate, memory = nbytes / (BW_hbm * e_hbm), launch = kernels *
    `kernel_time`, s."""
    zero = jnp.zeros_like(jnp.asarray(flops, dtype=jnp.result_type(float)))
    return Cost(flops=flops + zero, bytes=nbytes + zero, compute=flops / rate,
                memory=nbytes / (acc.hbm_bandwidth * eff.hbm), network=zero,
                launch=kernels * kernel_time(acc, eff), kernels=kernels + zero,
                sharpness=sharpness)


def network_cost(time, nbytes) -> Cost:
    """A transfer of `nbytes` B that takes `time` s on the network (no kernels counted)."""
    zero = jnp.zeros_like(time)
    return Cost(flops=zero, bytes=nbytes + zero, compute=zero, memory=zero, network=time,
                launch=zero, kernels=zero)
