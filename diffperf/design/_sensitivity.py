"""Elasticities d log(time) / d log(parameter) of a workload w.r.t. every hardware and technology
parameter, by one reverse-mode `jax.grad`.

An elasticity of -0.6 for `hbm_bandwidth` means 1 % more bandwidth makes the workload 0.6 %
faster. For a time that is a sum of terms each inversely proportional to one rate, minus the
elasticity of a rate is exactly the share of time that rate binds (which is how `bottlenecks`
splits time into compute / memory / network / fixed latency): the shares are read off the
gradient, not guessed from the breakdown.

Two workloads (`workload_time`):

- `train`: one optimizer step (`TrainingReport.step_time`) of a model on a GPU count with a fixed
  plan (default: the fastest plan of `_attribution.candidate_plans` on that system, bf16);
- `infer`: end-to-end latency (`InferenceReport.e2e_latency`) of a serving plan (default
  Llama-2 70B, tp 8, batch 1, 128 in / 128 out).

Hardware elasticities are w.r.t. every `Accelerator` and `Network` leaf; technology elasticities
are w.r.t. every leaf of `_technology.TechParams`, the `Design` budgets and the `ArchParams`,
through `diffperf.design.generate` (the GPU rebuilt from its reference design). The continuous node
coordinate is included as d log T / d log node_nm, and the memory / network generation indices as
d log T / d index (per generation step).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..explore._search_training import plan_from_values
from ..inference._infer import infer
from ..presets import resolve_efficiency
from ..specs._efficiency import Efficiency
from ..specs._hardware import System, precision_code
from ..specs._inference_plan import InferencePlan
from ..specs._runtime import Runtime
from ..specs._training_plan import TrainingPlan
from ..specs._transformer import Transformer
from ..training._step import train_step
from . import _technology as T
from ._attribution import candidate_plans, candidate_step_time

#: Leaves grouped by the resource they describe (for `bottlenecks`).
GROUPS = {
    "compute": ("flops_fp32", "flops_bf16", "flops_fp8", "flops_fp4", "vector_flops",
                "l2_bandwidth"),
    "memory": ("hbm_bandwidth",),
    "network": ("nvlink_bandwidth", "scaleout_bandwidth"),
}


def best_training_plan(model: Transformer, system: System, gpus: int, global_batch: int,
                       precision: str = "bf16", efficiency: Efficiency | None = None,
                       runtime: Runtime | None = None, plan_defaults: dict | None = None
                       ) -> TrainingPlan:
    """Fastest feasible plan of `_attribution.candidate_plans` on `system` (one vmapped call),
    with a software `runtime` and its `plan_defaults` (default: the calibration set's)."""
    eff = resolve_efficiency(efficiency)
    grid = candidate_plans(model, gpus, global_batch)
    values = grid.product(grid.names)
    n = grid.size
    values = {k: jnp.asarray(v) for k, v in values.items()}
    fixed = plan_defaults or {}  # a runtime's software defaults win over the study's choice
    values |= {"precision": jnp.full(n, float(precision_code(precision))),
               "zero": jnp.full(n, float(fixed.get("zero", 1.0))),
               "sequence_parallel": jnp.full(n, float(fixed.get("sequence_parallel", 1.0)))}

    @jax.jit
    def times(vals):
        return jax.vmap(lambda v: candidate_step_time(model, system, v, gpus, global_batch,
                                                      eff, runtime, plan_defaults))(vals)
    t = np.asarray(times(values))
    if not np.isfinite(t).any():
        raise ValueError(f"no candidate plan is feasible for {gpus} GPUs and global batch "
                         f"{global_batch} (tp 1-8, pp powers of two, dp * micro-batch must "
                         f"divide the global batch, the plan must fit in HBM)")
    i = int(np.argmin(t))
    pick = {k: float(np.asarray(v)[i]) for k, v in values.items()}
    return plan_from_values(pick, gpus, global_batch, plan_defaults)


def default_inference_plan() -> InferencePlan:
    return InferencePlan(tp=8, batch=1, input_len=128, output_len=128)


def workload_time(workload: str, model: Transformer, plan, efficiency: Efficiency | None = None,
                  runtime: Runtime | None = None):
    """A function `system -> time (s)` for `workload` in ("train", "infer") with a fixed plan
    and software `runtime` (default: the calibration set's)."""
    eff = resolve_efficiency(efficiency)
    if workload == "train":
        return lambda system: train_step(model, system, plan, eff, runtime).step_time
    if workload == "infer":
        return lambda system: infer(model, system, plan, eff, runtime).e2e_latency
    raise ValueError(f"workload must be 'train' or 'infer', got {workload!r}")


def _flat(tree, prefix: str) -> dict:
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = ".".join(str(getattr(p, "name", getattr(p, "key", p))) for p in path)
        out[f"{prefix}{name}"] = leaf
    return out


def elasticities(fn, params) -> tuple[float, dict]:
    """`(value, {leaf path: d log fn / d log leaf})` of a positive scalar `fn(params)`; leaves
    that are zero get elasticity 0 (d log of a zero parameter is undefined)."""
    value, grads = jax.value_and_grad(fn)(params)
    el = jax.tree.map(lambda g, x: g * x / value, grads, params)
    return float(value), {k: float(v) for k, v in _flat(el, "").items()}


#: Whole-number or on / off leaves: the time is a step function of them (the NVLink domain
#: changes where a collective leaves the fast fabric), so a derivative there is the slope of a
#: kink, not what one more unit would buy. Left out of the ranking; use `--set` what-ifs.
DISCRETE_LEAVES = ("accelerator.num_sms", "network.nvlink_domain", "network.nvlink_sharp")


def hardware_elasticities(time_fn, system: System) -> tuple[float, dict]:
    """Elasticities of `time_fn(system)` w.r.t. every continuous Accelerator and Network leaf
    (`DISCRETE_LEAVES` left out)."""
    value, el = elasticities(time_fn, system)
    return value, {k: v for k, v in el.items() if k not in DISCRETE_LEAVES}


def technology_elasticities(time_fn, gpu: str, nvlink_domain: float = 8.0) -> tuple[float, dict]:
    """Elasticities of `time_fn(system)` where the system is generated from the reference design
    of `gpu` (a100 / h100 / b200): every TechParams, Design and ArchParams leaf, plus the
    continuous node (per log nm) and the memory / network generation indices (per step)."""
    row = T._reference_row(gpu)
    tech, design, arch_name = T.reference_point(gpu)
    design = eqx.tree_at(lambda d: d.nvlink_domain, design, jnp.asarray(nvlink_domain, float))
    arch = T.architecture(arch_name)

    def fn(params):
        g = T.generate(params["tech"], params["design"], params["arch"])
        return time_fn(System(g.accelerator, g.network))

    value, el = elasticities(fn, {"tech": tech, "design": design, "arch": arch})
    names = {k: v for k, v in el.items()
             if k not in ("design.dies", "design.nvlink_domain", "tech.nvlink_sharp")}

    def by_coord(coords):
        n, mi, ni = coords
        g = T.generate(T.technology(n, mi, ni), design, arch)
        return jnp.log(time_fn(System(g.accelerator, g.network)))

    coords = jnp.asarray([row["node_nm"], row["memory_index"], row["network_index"]], float)
    d = jax.grad(by_coord)(coords)
    names["coord.node_nm"] = float(d[0] * coords[0])
    names["coord.memory_generation"] = float(d[1])
    names["coord.network_generation"] = float(d[2])
    return value, names


def ranked(el: dict, top: int | None = None) -> list[tuple[str, float]]:
    """Elasticities sorted by magnitude (largest first)."""
    items = sorted(el.items(), key=lambda kv: -abs(kv[1]))
    return items[:top] if top else items


def bottlenecks(el: dict, prefix: str = "") -> dict:
    """Share of time bound by compute / memory / network (minus the rate elasticities) and the
    remainder (fixed latencies, launch overheads), from hardware elasticities."""
    out = {}
    for group, leaves in GROUPS.items():
        out[group] = -sum(v for k, v in el.items()
                          if k.removeprefix(prefix).split(".")[-1] in leaves)
    out["latency/other"] = 1.0 - sum(out.values())
    return out
