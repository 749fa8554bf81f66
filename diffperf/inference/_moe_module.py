"""The time of one MoE layer's expert module on one GPU: the quantity MoE kernel benchmarks time.

Kernel benchmarks (TensorRT-LLM's MoE backends, vLLM's and SGLang's fused_moe) time the module
that turns a layer's hidden states into its routed experts' output for `tokens` tokens:

    t = t_router + t_experts + t_permute + kernels * t_kernel

- `t_router`: the router GEMM (tokens x hidden x experts), 1 kernel (2 when it splits its k
  loop); left out with `router_gemm=False`, for benchmarks that take the router's logits as
  their input (vLLM's, SGLang's, FlashInfer's and AIConfigurator's MoE benchmarks do);
- `t_experts`: the routed experts' up (gate + up) and down GEMMs of the busiest expert-parallel
  GPU, each a grouped GEMM over its experts at the mean tokens per picked expert
  (`diffperf.inference.busiest_gpu_experts`), 1-2 kernels each; both at their roofline times
  (`diffperf.costs.split_k_gemm_cost`, with the low-precision k loop of the routed experts),
  times the runtime's `moe_gemm_time_factor` (1 by default) and, with `moe_gemm_table`, the
  measured factor of TensorRT-LLM's CUTLASS NVFP4 backend (`measured_gemm_factor`);
- `t_permute`: the token permutation's traffic (`moe_permute_cost` in
  `diffperf/inference/_infer.py`: the permuted copy where `Runtime.moe_permute_copy` says
  the engine writes one, and the combine), at HBM bandwidth;
- the layer's `MOE_KERNELS` routing kernels (top-k, permutation, un-permutation);
- `t_kernel`: each kernel's fixed cost, `graph_kernel_time` (graph node + tail) when the
  runtime replays the pass from a CUDA graph, else the eager launch plus the tail.

These are the operations, at the same costs, that one MoE layer of `inference_ops`' decode step
charges for routing and experts (under a padding CUDA-graph runtime, at the padded batch, as
there). Not included: the rest of the layer's element-wise work (activation quantization and
function, whose bytes `inference_ops` counts with the norms) and any communication
(tensor-parallel all-reduce, expert dispatch)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..costs._cost import kernel_time
from ..presets import resolve_efficiency
from ..specs import InferencePlan, Runtime, System, Transformer
from ..specs._efficiency import Efficiency
from ._host import graph_kernel_time, graph_padded_batch, graph_share
from ._infer import MOE_KERNELS, _dims, _layer_gemms, moe_permute_cost, rank_plan


class MoeModuleTime(eqx.Module):
    """One MoE layer's expert module on one GPU, s: `router` (the router GEMM) and `experts`
    (the routed experts' up and down GEMMs) at their roofline times, `permute` the token
    permutation's traffic time, `fixed` the fixed costs of all its kernels (those ops' and the
    routing kernels'), `total` their sum; `kernels`, count."""

    router: jax.Array
    experts: jax.Array
    permute: jax.Array
    fixed: jax.Array
    total: jax.Array
    kernels: jax.Array


def moe_module_time(model: Transformer, system: System, plan: InferencePlan, tokens,
                    runtime: Runtime | None = None,
                    efficiency: Efficiency | None = None,
                    router_gemm: bool = True) -> MoeModuleTime:
    """Time of one MoE layer's expert module for `tokens` (>= 1) tokens entering it on one GPU
    of `plan` (the module docstring states the model), s. With attention data parallelism the
    experts see the tokens of all `tp` ranks (`tokens` x tp), as in `inference_ops`. The fixed
    cost per kernel is the CUDA-graph replay's when `runtime` captures decode passes of
    `tokens` tokens (`Runtime.decode_graph`, `graph_max_tokens`), else the eager launch's; a
    padding graph runtime runs the padded batch (`graph_padded_batch`). `router_gemm=False`
    (a Python bool) leaves the router GEMM out. Pure JAX (jit / vmap / grad). A dense model's
    module is zero."""
    eff = resolve_efficiency(efficiency)
    runtime = Runtime() if runtime is None else runtime
    x = _dims(model, rank_plan(plan))
    tokens = jnp.asarray(tokens, jnp.result_type(float))
    graph = graph_share(runtime.decode_graph, tokens, runtime)
    tokens = tokens + graph * (graph_padded_batch(tokens, runtime) - tokens)
    share = jnp.where(x.moe, 1.0 - x.dense, 0.0)  # `_layer_gemms` averages over all layers
    moe = share > 0
    per_layer = _layer_gemms(model, system, eff, x, tokens, runtime.moe_gemm_time_factor,
                             runtime.moe_gemm_table)
    names = ("router", "mlp_up", "mlp_down") if router_gemm else ("mlp_up", "mlp_down")
    ops = {k: per_layer[k] * (1.0 / jnp.where(moe, share, 1.0)) for k in names}
    kernels = sum(ops[k].kernels for k in names) + MOE_KERNELS
    fixed = kernels * ((1.0 - graph) * kernel_time(system.accelerator, eff)
                       + graph * graph_kernel_time(eff, runtime))
    router = ops["router"].roofline if router_gemm else jnp.zeros_like(tokens)
    experts = ops["mlp_up"].roofline + ops["mlp_down"].roofline
    permute = (moe_permute_cost(model, system, eff, x, tokens, runtime.moe_permute_copy).roofline
               / jnp.where(moe, share, 1.0))
    zero = jnp.zeros_like(tokens)
    parts = [jnp.where(moe, v, zero) for v in (router, experts, permute, fixed, kernels)]
    return MoeModuleTime(router=parts[0], experts=parts[1], permute=parts[2], fixed=parts[3],
                         total=parts[0] + parts[1] + parts[2] + parts[3], kernels=parts[4])
