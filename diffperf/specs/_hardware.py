"""GPU and network specifications (datasheet numbers, SI units)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._checks import (
    check_integer,
    check_nonnegative,
    check_positive,
    is_concrete,
    names_number_fields,
    number_field as _F,
)

#: Precision codes used by plans: index into `Accelerator.matmul_flops`.
PRECISIONS = {0: "fp32", 1: "bf16", 2: "fp8", 3: "fp4"}
#: Accepted spellings of each precision.
PRECISION_CODES = {"fp32": 0, "tf32": 0, "bf16": 1, "fp16": 1, "fp8": 2, "fp4": 3}
#: Integer weight formats of weight-only quantisation, as the precision of the same width
#: (their GEMMs run at the activations' precision, which must then be 16 bit or wider).
INTEGER_WEIGHTS = {"int8": "fp8", "int4": "fp4"}
#: Elements per 8-bit block scale of 4-bit weights, by weight format name: NVFP4 (`fp4`) one
#: FP8 E4M3 scale per 16 (NVIDIA, "Introducing NVFP4 for Efficient and Accurate Low-Precision
#: Inference", 2025); MXFP4 (OCP Microscaling Formats (MX) v1.0: one E8M0 scale per 32; gpt-oss's
#: checkpoints) and group-wise int4 (AWQ / GPTQ: a 16-bit scale and a 4-bit zero per 128, 4.16
#: bits) one per 32. `InferencePlan.weight_scale_block`.
WEIGHT_SCALE_BLOCK = {"fp4": 16.0, "int4": 32.0}
#: Bytes per element of each precision code. fp4 is NVFP4 (NVIDIA's Blackwell format, the one
#: TensorRT-LLM, vLLM and Transformer Engine use there): 4-bit E2M1 values with one FP8 E4M3 scale
#: per block of 16 (plus one FP32 scale per tensor, negligible), (16 x 4 + 8) / 16 = 4.5 bits =
#: 0.5625 B. 4-bit weights in other formats (MXFP4, int4) give their own block
#: (`WEIGHT_SCALE_BLOCK`, `InferencePlan.weight_scale_block`). fp8 carries per-tensor scales (or
#: DeepSeek's 128 x 128 blocks, 0.006 % more), counted as 1 B.
BYTES_PER_ELEMENT = (4.0, 2.0, 1.0, 0.5625)


def weight_storage(weights: str, gemm: str) -> str:
    """The precision name whose width stores `weights` (int8 -> fp8, int4 -> fp4; a precision
    name stays itself) when the GEMMs run at `gemm` (weight-only quantisation).

    Raises ValueError for an unknown name, weights wider than the GEMMs, and integer weights
    with GEMMs narrower than 16 bit (integer activations, W8A8, are not modelled), except int4
    weights with fp8 GEMMs: W4A8, the int4 weights dequantised to fp8 for fp8 tensor cores
    (TensorRT-LLM's W4A8 AWQ on Hopper)."""
    names = {**{n: n for n in PRECISION_CODES}, **INTEGER_WEIGHTS}
    w, g = str(weights).lower(), str(gemm).lower()
    if w not in names:
        raise ValueError(f"must be one of {sorted(names)}, got {weights!r}")
    storage = names[w]
    g_code = precision_code(g)
    if BYTES_PER_ELEMENT[PRECISION_CODES[storage]] > BYTES_PER_ELEMENT[g_code]:
        raise ValueError(f"{w} weights are wider than the GEMM precision {g}")
    w4a8 = w == "int4" and g_code == PRECISION_CODES["fp8"]
    if w in INTEGER_WEIGHTS and g_code >= PRECISION_CODES["fp8"] and not w4a8:
        raise ValueError(f"{w} weights need 16-bit or wider GEMMs (weight-only quantisation), "
                         f"or fp8 GEMMs for int4 (W4A8); {g} integer math (W8A8) is not "
                         f"modelled")
    return storage


def weight_scale_block(weights: str) -> float:
    """Elements per 8-bit block scale of 4-bit weights named `weights` (`WEIGHT_SCALE_BLOCK`:
    32 for int4 / MXFP4, 16 for NVFP4 and every other name, where it has no effect)."""
    return WEIGHT_SCALE_BLOCK.get(str(weights).lower(), 16.0)


def precision_code(name: str) -> int:
    """Map a precision name (fp32, tf32, bf16, fp16, fp8, fp4) to its integer code."""
    try:
        return PRECISION_CODES[str(name).lower()]
    except KeyError:
        raise ValueError(
            f"precision must be one of {sorted(PRECISION_CODES)}, got {name!r}") from None


@names_number_fields
class Accelerator(eqx.Module):
    """One GPU.

    **Arguments:**

    - `flops_fp32`: dense tensor-core FLOP/s for fp32 inputs (TF32 on A100 and later), FLOP/s.
    - `flops_bf16`: dense tensor-core FLOP/s for bf16 / fp16, FLOP/s.
    - `flops_fp8`: dense FP8 FLOP/s (0 = unsupported), FLOP/s.
    - `flops_fp4`: dense FP4 FLOP/s (0 = unsupported), FLOP/s.
    - `vector_flops`: non-tensor (CUDA-core) FP32 FLOP/s, FLOP/s.
    - `hbm_capacity`: HBM capacity, B.
    - `hbm_bandwidth`: HBM bandwidth, B/s.
    - `l2_capacity`: on-chip L2 / SRAM capacity, B.
    - `l2_bandwidth`: L2 bandwidth, B/s.
    - `num_sms`: streaming multiprocessors (for wave quantisation), count.
    - `launch_overhead`: fixed cost of launching one kernel, s.
    - `host_bandwidth`: per-direction bandwidth between the GPU and host (CPU) memory, B/s: PCIe,
      or NVLink-C2C on Grace superchips. Used by activation offloading. Default: PCIe Gen5 x16.
    - `host_memory`: host (CPU) memory per GPU that offloaded activations, weights and
      optimizer states may use, B: the reference system's memory divided by its GPUs (DGX
      H100: 2 TB / 8). Default 256 GB.
    - `host_memory_bandwidth`: the CPU's DRAM bandwidth per GPU, B/s: the reference system's
      peak (sockets x channels x transfer rate x 8 B, or the Grace CPU's LPDDR5X) divided by
      its GPUs, which all step their offloaded optimizer states at once (DGX H100: 2 x 8
      channels of DDR5-4800 = 614 GB/s / 8). Used by optimizer offloading (CPU Adam). Default
      76.8 GB/s.
    - `host_time_factor`: the host CPU's time for a serving engine's Python work (operator
      issue, per-request bookkeeping, scheduling) relative to a DGX H100's x86 host (Xeon
      Platinum 8480C), ratio: every host time of the inference and serving runtime
      (`Runtime.host_op_time`, `host_collective_time`, `host_step_time`, `host_seq_time`) is
      multiplied by it (`diffperf.inference.host_wait`, the serving iteration's host stream).
      1 for x86 hosts (default); 2.75 for a Grace CPU (TransformerEngine issue 2053: one
      `torch.nn.Linear` forward takes 37.08 us of CPU on GB200 against 13.48 us on a DGX
      H100). The training host stream does not use it: the training runtimes' per-operator
      times are fitted or assumed on other hosts, and the Grace factor made the held-out
      GB200 / GB300 MoE training rows 2x too slow (calibration/EXPERIMENTS.md).
    - `sfu_ratio`: the special-function unit's exponential (exp2) throughput relative to 16
      results per SM per clock against 128 FP32 lanes (Hopper, Blackwell: CUDA C++
      Programming Guide, "Throughput of Native Arithmetic Instructions"), ratio: the
      exponentials per second are `vector_flops` / 16 x `sfu_ratio`; they cap an FP8
      attention kernel's rate (`diffperf.costs.fused_attention_rate`) and, on GPUs with FP8
      tensor cores, the prefill attention kernel's at narrow heads
      (`diffperf.costs.prefill_attention_time`: a B200 at head width 64). 1 by default; 2 on
      Blackwell Ultra (B300 / GB300: "doubling SFU throughput over the standard NVIDIA
      Blackwell architecture", NVIDIA technical blog "Making Softmax More Efficient with
      NVIDIA Blackwell Ultra").
    """

    flops_fp32: jax.Array = _F()
    flops_bf16: jax.Array = _F()
    flops_fp8: jax.Array = _F()
    flops_fp4: jax.Array = _F()
    vector_flops: jax.Array = _F()
    hbm_capacity: jax.Array = _F()
    hbm_bandwidth: jax.Array = _F()
    l2_capacity: jax.Array = _F()
    l2_bandwidth: jax.Array = _F()
    num_sms: jax.Array = _F()
    launch_overhead: jax.Array = _F()
    host_bandwidth: jax.Array = _F(default=64e9)
    host_memory: jax.Array = _F(default=256e9)
    host_memory_bandwidth: jax.Array = _F(default=76.8e9)
    host_time_factor: jax.Array = _F(default=1.0)
    sfu_ratio: jax.Array = _F(default=1.0)

    def __check_init__(self):
        for name in ("flops_bf16", "vector_flops", "hbm_capacity", "hbm_bandwidth", "l2_capacity",
                     "l2_bandwidth", "host_bandwidth", "host_memory",
                     "host_memory_bandwidth", "host_time_factor", "sfu_ratio"):
            check_positive("Accelerator", name, getattr(self, name))
        for name in ("flops_fp32", "flops_fp8", "flops_fp4", "launch_overhead"):
            check_nonnegative("Accelerator", name, getattr(self, name))
        check_integer("Accelerator", "num_sms", self.num_sms)

    @property
    def matmul_flops(self) -> jax.Array:
        """Dense matmul FLOP/s stacked by precision code (fp32, bf16, fp8, fp4), shape (..., 4)."""
        return jnp.stack([self.flops_fp32, self.flops_bf16, self.flops_fp8, self.flops_fp4], -1)

    def peak_flops(self, precision) -> jax.Array:
        """Dense matmul FLOP/s at a precision code (0 if unsupported)."""
        p = jnp.asarray(precision)
        return jnp.where(p == 0, self.flops_fp32,
                         jnp.where(p == 1, self.flops_bf16,
                                   jnp.where(p == 2, self.flops_fp8, self.flops_fp4)))


@names_number_fields
class Network(eqx.Module):
    """Two-tier network: a fast scale-up domain (NVLink) and the scale-out fabric.

    Ranks are numbered so that the first `nvlink_domain` ranks share one NVLink domain, the next
    `nvlink_domain` the next one, and so on; a group of ranks with a given stride therefore maps
    onto the tier(s) it spans (see `diffperf.costs`).

    **Arguments:**

    - `nvlink_domain`: GPUs in one NVLink domain (8 for DGX/HGX, 72 for NVL72), count.
    - `nvlink_bandwidth`: per-GPU, per-direction NVLink bandwidth, B/s.
    - `nvlink_latency`: latency of one NVLink hop (one ring step), s.
    - `scaleout_bandwidth`: per-GPU, per-direction scale-out (InfiniBand / Ethernet) bandwidth, B/s.
    - `scaleout_latency`: latency of one scale-out hop (one ring step), s.
    - `nvlink_sharp`: 1 if the NVLink switches reduce in the network (NVLink SHARP / NVLS,
      third-generation NVSwitch and later: H100 systems on): an in-domain all-reduce then pays
      the smaller of a ring's 2 (n - 1) hop latencies and NCCL's flat NVLS latency
      (`costs._collectives.NVLS_LATENCY`, 23 us), as NCCL's tuner picks.
    """

    nvlink_domain: jax.Array = _F()
    nvlink_bandwidth: jax.Array = _F()
    nvlink_latency: jax.Array = _F()
    scaleout_bandwidth: jax.Array = _F()
    scaleout_latency: jax.Array = _F()
    nvlink_sharp: jax.Array = _F(default=0)

    def __check_init__(self):
        check_integer("Network", "nvlink_domain", self.nvlink_domain)
        check_integer("Network", "nvlink_sharp", self.nvlink_sharp, minimum=0)
        if is_concrete(self.nvlink_sharp) and np.any(np.asarray(self.nvlink_sharp) > 1):
            raise ValueError(f"Network.nvlink_sharp must be 0 or 1, got "
                             f"{float(np.max(np.asarray(self.nvlink_sharp))):g}")
        for name in ("nvlink_bandwidth", "scaleout_bandwidth"):
            check_positive("Network", name, getattr(self, name))
        for name in ("nvlink_latency", "scaleout_latency"):
            check_nonnegative("Network", name, getattr(self, name))


class System(eqx.Module):
    """A GPU cluster: identical accelerators on a two-tier network.

    The number of GPUs in a job is set by its plan (tp * pp * dp * cp), not here.
    """

    accelerator: Accelerator
    network: Network
