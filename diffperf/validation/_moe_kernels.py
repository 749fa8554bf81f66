"""Published MoE kernel benchmarks against `diffperf.inference.moe_module_time`.

`benchmarks_data/moe_kernels_published.csv` holds one row per published timing of one MoE
layer's expert module (routing, the grouped expert GEMMs and their helpers) on one GPU:
TensorRT-LLM's TRTLLM-Gen and CUTLASS backends, FlashInfer's entry points to TensorRT-LLM's
kernels, and vLLM's / SGLang's Triton `fused_moe`. Each row names the model preset whose layer
it ran, the plan that reproduces its per-GPU shape (`tp`, `ep`, `attention_dp`: e.g. one rank
of TP 8 holds every expert at an eighth of its width) and the tokens entering the layer per
attention rank; `activation_precision`, where given, differs from the weights' `precision`
(MXFP4 weights with MXFP8 activations); `router_gemm` is 1 where the timing includes the
router GEMM (TensorRT-LLM's blog), 0 where the benchmark takes the router's logits as input.

Benchmark harnesses replay the module from a CUDA graph (vLLM's `benchmark_moe.py`, SGLang's
tuning script) or time its kernels alone, so every kernel is costed at the graph-replay fixed
cost (`Runtime(decode_graph=1)`, no size limit): an assumption the TensorRT-LLM blog does not
state.

Only TensorRT-LLM's CUTLASS backend writes a permuted copy of the routed rows before its expert
GEMMs (`expandInputRowsKernel`); Triton's `fused_moe` and the TRTLLM-Gen kernels (also behind
FlashInfer's entry points) gather the rows by index inside the first GEMM
(`Runtime.moe_permute_copy` 0 for them, `kernel_runtime`)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import presets
from .._paths import BENCHMARKS_DATA
from ..inference import moe_module_time
from ..specs import InferencePlan, Runtime

MOE_KERNELS_CSV = Path(BENCHMARKS_DATA) / "moe_kernels_published.csv"

#: Kernel benchmarks replay the module from a CUDA graph (module docstring).
BENCHMARK_RUNTIME = Runtime(decode_graph=1.0)
#: The kernels that write a permuted copy of the routed rows (module docstring).
PERMUTED_COPY_KERNELS = ("cutlass",)


def kernel_runtime(kernel: str) -> Runtime:
    """`BENCHMARK_RUNTIME` with the kernel family's permuted copy (`Runtime.moe_permute_copy`:
    1 for TensorRT-LLM's CUTLASS backend, 0 for the kernels that gather rows inside the GEMM)."""
    copy = 1.0 if kernel in PERMUTED_COPY_KERNELS else 0.0
    return eqx.tree_at(lambda r: r.moe_permute_copy, BENCHMARK_RUNTIME, copy)


@dataclass(frozen=True)
class MoeKernelRow:
    """One published timing: `time_us` of the module for `tokens` tokens (per attention rank)
    of `model`'s MoE layer on one `gpu` of `system`, run as `plan`."""

    source: str
    engine: str
    kernel: str
    gpu: str
    system: str
    model: str
    plan: InferencePlan
    tokens: float
    time_us: float
    router_gemm: bool = True


def read_moe_kernel_rows(path: str | Path = MOE_KERNELS_CSV) -> list[MoeKernelRow]:
    """The rows of the published MoE kernel table; a `ValueError` naming the row and field
    for a value that is missing or not a positive number."""
    rows = []
    with Path(path).open(newline="") as f:
        for i, r in enumerate(csv.DictReader(f), start=2):
            def number(field: str, r=r, i=i) -> float:
                try:
                    value = float(r[field])
                except (KeyError, TypeError, ValueError):
                    raise ValueError(f"{path} line {i}: {field}={r.get(field)!r} is not a "
                                     "number") from None
                may_be_zero = field in ("attention_dp", "router_gemm")
                if not (value >= 0 if may_be_zero else value > 0):
                    bound = ">= 0" if may_be_zero else "> 0"
                    raise ValueError(f"{path} line {i}: {field}={value} must be {bound}")
                return value
            plan = InferencePlan(tp=number("tp"), ep=number("ep"),
                                 attention_dp=number("attention_dp"),
                                 weight_precision=r["precision"],
                                 activation_precision=(r.get("activation_precision")
                                                       or r["precision"]))
            rows.append(MoeKernelRow(r["source"], r["engine"], r["kernel"], r["gpu"],
                                     r["system"], r["model"], plan, number("tokens"),
                                     number("time_us"), number("router_gemm") > 0))
    return rows


def predict_moe_kernel_row(row: MoeKernelRow, efficiency=None) -> float:
    """The model's time of the row's module, microseconds (`moe_module_time` under
    `kernel_runtime(row.kernel)`, with the GPU's shipped efficiency factors unless given)."""
    model = presets.model(row.model)
    system = presets.system(row.system)
    eff = presets.resolve_efficiency(efficiency, row.gpu)
    t = moe_module_time(model, system, row.plan, row.tokens, kernel_runtime(row.kernel), eff,
                        router_gemm=row.router_gemm)
    return float(t.total) * 1e6


def tokens_per_expert(row: MoeKernelRow) -> float:
    """Mean routed tokens per expert of the row's layer: tokens x (tp with attention data
    parallelism, else 1) x top-k / experts."""
    model = presets.model(row.model)
    ranks = float(row.plan.tp) if float(row.plan.attention_dp) > 0 else 1.0
    return row.tokens * ranks * float(model.experts_per_token) / float(model.num_experts)


def model_module_times(system, efficiency, hidden, expert_width, num_experts, top_k, moe_tp,
                       tokens) -> tuple[np.ndarray, np.ndarray]:
    """(module, routed-expert GEMMs) of `moe_module_time`, s, for one GPU of `system` holding
    every expert of the shape (full `expert_width` split over `moe_tp` GPUs, no expert
    parallelism) in NVFP4, at each of `tokens`: the model the tables' factors were solved
    against (TensorRT-LLM's CUTLASS backend: its permuted copy, CUDA-graph launches, no router
    GEMM; `diffperf.inference._moe_gemm_factors.measured_gemm_factor` not applied). For
    calibration/moe_gemm_tables.py and tests/test_moe_gemm_factors.py."""
    m = eqx.tree_at(lambda m: (m.hidden, m.ffn_hidden, m.num_experts, m.experts_per_token),
                    presets.model("qwen3-30b-a3b"),
                    tuple(jnp.asarray(float(v)) for v in (hidden, expert_width, num_experts,
                                                          top_k)))
    plan = InferencePlan(tp=float(moe_tp), ep=1.0, weight_precision="fp4",
                         activation_precision="fp4")
    runtime = kernel_runtime("cutlass")  # moe_gemm_table 0: the model the factors scale
    out = jax.vmap(lambda n: moe_module_time(m, system, plan, n, runtime, efficiency,
                                             router_gemm=False))(
        jnp.asarray(tokens, jnp.result_type(float)))
    return np.asarray(out.total), np.asarray(out.experts)

