"""Every calibratable factor of the model in one pytree, with physical defaults.

The defaults are set from first principles and public microbenchmarks before any fitting:
large cuBLAS GEMMs reach 75-85 % of dense tensor peak, streaming kernels 80-90 % of HBM
bandwidth, NCCL rings about 80 % of the NVLink / InfiniBand line rate, a kernel costs a few
microseconds of launch and tail, and a collective some ten microseconds of software latency.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from .._checks import (
    check_fraction,
    check_nonnegative,
    check_positive,
    names_number_fields,
    number_field as _F,
)


@names_number_fields
class Efficiency(eqx.Module):
    """Achieved fractions of peak, overheads and overlaps.

    **Arguments:**

    - `matmul_peak`: fraction of dense tensor peak a very large 16-bit GEMM reaches, (0, 1].
    - `matmul_size_scale`: GEMM dimension at which its efficiency is lost to small-size effects
      (pipeline fill, epilogue, k-loop prologue): see `matmul_efficiency`, elements.
    - `matmul_lowp`: extra factor on `matmul_peak` for fp8 / fp4 GEMMs (scaling, casts), (0, 1].
    - `attention`: fraction of 16-bit dense peak a fused (flash) attention kernel reaches,
      (0, 1] (FlashAttention-2/3 report 50-75 % forward, less backward).
    - `vector`: fraction of vector (CUDA-core) FLOP/s reached by element-wise kernels, (0, 1].
    - `hbm`: fraction of HBM bandwidth reached by streaming kernels, (0, 1].
    - `l2`: fraction of L2 bandwidth reached, (0, 1].
    - `nvlink`: fraction of NVLink bandwidth a NCCL collective reaches, (0, 1].
    - `all_to_all`: fraction of NVLink bandwidth a NCCL all-to-all reaches, (0, 1]: every rank
      exchanging with every other at once, which rings do not (default 0.67: NVIDIA's
      measured DeepSeek-V3 dispatch / combine inside one NVLink domain, arXiv:2603.07685
      Table 7, 0.58-0.73 over GB200 NVL72 EP 8-64 and DGX H100 EP 8).
    - `scaleout`: fraction of scale-out bandwidth a NCCL collective reaches, (0, 1].
    - `kernel_overhead`: per-kernel time beyond the launch (tail effect, sync), s.
    - `collective_overhead`: fixed software latency of one collective call, s.
    - `tp_overlap`: fraction of tensor-parallel communication hidden behind compute when the plan
      enables TP overlap, [0, 1].
    - `dp_overlap`: fraction of the backward pass of the last micro-batch that can hide the
      data-parallel gradient reduction when the plan enables DP overlap, [0, 1].
    - `pp_overlap`: fraction of pipeline send/recv time hidden behind compute, [0, 1].
    - `cp_overlap`: fraction of context-parallel KV exchange hidden behind attention, [0, 1].
    - `zero3_overlap`: fraction of ZeRO-3 parameter gathers hidden by prefetching, [0, 1].
    - `per_head_attention`: fraction of CUDA-core (vector) FP32 FLOP/s reached by a decode
      attention kernel with one thread block per query head (TensorRT-LLM's masked MHA: K/V
      dequantised, dot products, softmax and reductions in scalar FP32), (0, 1].
    - `memory_reserve`: per-GPU memory used by the CUDA context, NCCL buffers, workspace and
      fragmentation, B.
    - `host_overhead`: factor on every host time of the software runtime (`Runtime`'s per
      operator, per collective and per step times): the host CPU and framework measured
      against the runtime preset's reference, ratio > 0 (1: the preset as published / fitted;
      no effect on runtimes whose host times are 0, such as the default). Inference and
      serving multiply it by the accelerator's `host_time_factor` (the host CPU's speed:
      2.75 on Grace); training uses it alone.
    - `prefill_attention`: fraction of the 16-bit dense peak a forward-only fused attention
      kernel (an inference engine's prefill / context attention) reaches on long prompts at
      full occupancy, (0, 1] (`diffperf.costs.prefill_attention_time`, which adds the kernel's
      fixed time per query tile and its partial-wave loss). 0.59: the median of the values
      fitted to NVIDIA's measured context-attention kernels of vLLM 0.14 (A100 0.57, H100
      0.60), SGLang 0.5.14 (FlashAttention-3, H100 0.77) and TensorRT-LLM 1.0 / 1.3 (A100
      0.45, H100 0.54, B200 0.64) at head widths 64-256, `benchmarks_data/
      attention_kernels_published.csv`
      (`python calibration/attention_kernels.py --fit`). Not fitted to end-to-end
      rows (`attention` is, for training's forward + backward kernels and decode).
    """

    matmul_peak: jax.Array = _F(default=0.85)
    matmul_size_scale: jax.Array = _F(default=48.0)
    matmul_lowp: jax.Array = _F(default=0.80)
    attention: jax.Array = _F(default=0.55)
    vector: jax.Array = _F(default=0.60)
    hbm: jax.Array = _F(default=0.85)
    l2: jax.Array = _F(default=0.70)
    nvlink: jax.Array = _F(default=0.80)
    all_to_all: jax.Array = _F(default=0.67)
    scaleout: jax.Array = _F(default=0.85)
    kernel_overhead: jax.Array = _F(default=2e-6)
    collective_overhead: jax.Array = _F(default=10e-6)
    tp_overlap: jax.Array = _F(default=0.3)
    dp_overlap: jax.Array = _F(default=0.9)
    pp_overlap: jax.Array = _F(default=0.0)
    cp_overlap: jax.Array = _F(default=0.8)
    zero3_overlap: jax.Array = _F(default=0.8)
    per_head_attention: jax.Array = _F(default=0.15)
    memory_reserve: jax.Array = _F(default=2e9)
    host_overhead: jax.Array = _F(default=1.0)
    prefill_attention: jax.Array = _F(default=0.59)

    def __check_init__(self):
        for name in ("matmul_peak", "matmul_lowp", "attention", "vector", "hbm", "l2", "nvlink",
                     "all_to_all", "scaleout", "per_head_attention", "prefill_attention"):
            check_fraction("Efficiency", name, getattr(self, name), allow_zero=False)
        for name in ("tp_overlap", "dp_overlap", "pp_overlap", "cp_overlap", "zero3_overlap"):
            check_fraction("Efficiency", name, getattr(self, name))
        check_positive("Efficiency", "matmul_size_scale", self.matmul_size_scale)
        check_positive("Efficiency", "host_overhead", self.host_overhead)
        for name in ("kernel_overhead", "collective_overhead", "memory_reserve"):
            check_nonnegative("Efficiency", name, getattr(self, name))


def matmul_efficiency(eff: Efficiency, m, n, k, precision) -> jax.Array:
    """Fraction of dense peak reached by an (m x k) @ (k x n) GEMM.

    `matmul_peak / (1 + c/m + c/n + c/k)` with c = `matmul_size_scale`: smooth in every
    dimension, symmetric (so the two backward GEMMs of a layer run at the forward's efficiency),
    near `matmul_peak` for large GEMMs and falling like m/c for skinny (decode) GEMMs. fp8 / fp4
    GEMMs are further scaled by `matmul_lowp`.
    """
    c = eff.matmul_size_scale
    size_loss = 1.0 + c / m + c / n + c / k
    lowp = jnp.where(jnp.asarray(precision) >= 2, eff.matmul_lowp, 1.0)
    return eff.matmul_peak * lowp / size_loss
