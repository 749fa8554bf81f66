"""Time, memory and utilisation of one optimizer step of distributed transformer training.

One GPU of the slowest (last) pipeline stage is modelled per micro-batch: the operations of a
layer (`_layer`: every GEMM with its exact local shape, the attention core, the element-wise
kernels) and its tensor / context / expert parallel communication (`_layer_comm`), then the
step terms (`_terms`): the pipeline schedule (1F1B or interleaved), activation offloading, the
data-parallel gradient reduction and the optimizer. `train_step` adds them up.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from .._checks import check_finite_report
from .._stored_programs import stored_jit
from ..costs._roofline import peak_matmul_flops
from ..feasibility import MEMORY_REASONS, describe_failure, training_reason
from ..presets import resolve_efficiency
from ..specs._efficiency import Efficiency
from ..specs._hardware import System
from ..specs._runtime import Runtime
from ..specs._training_plan import TrainingPlan, layer_count_error
from ..specs._transformer import Transformer
from ._flops import hardware_flops_per_step, model_flops_per_step
from ._host import host_wait, micro_batch_host_wait
from ._layer import head_time, layer_costs
from ._memory import TrainingMemory, param_counts, training_memory
from ._offload import host_copies_exposed
from ._terms import (
    dp_collectives,
    dp_exposed,
    dp_overlap_window,
    free_compute_share,
    local_params,
    offload_exposed,
    optimizer_time,
    pipeline_bubble,
    pipeline_p2p,
    stage_compute,
    zero3_collectives,
)


class TrainingReport(eqx.Module):
    """Prediction for one optimizer step. Times in s, memory in B, rates per second.

    The step time is `compute + tp_comm + cp_comm + ep_comm + pp_comm + dp_comm + bubble +
    optimizer + offload + host`, where the communication and offload terms are only the parts
    not hidden behind compute, and `host` the time the GPU waits for the host to issue work.
    """

    step_time: jax.Array
    compute_time: jax.Array  # GEMMs, attention, element-wise kernels incl. recomputation
    recompute_time: jax.Array  # the part of compute_time spent recomputing activations
    tp_comm_time: jax.Array  # exposed tensor-parallel all-reduces / all-gathers in the layers
    cp_comm_time: jax.Array  # exposed context-parallel K / V exchanges
    ep_comm_time: jax.Array  # exposed expert-parallel all-to-alls
    pp_comm_time: jax.Array  # exposed pipeline send/recv
    dp_comm_time: jax.Array  # exposed data-parallel gradient / parameter communication
    bubble_time: jax.Array  # pipeline fill and drain
    optimizer_time: jax.Array
    offload_time: jax.Array  # exposed activation and weight copies to / from host memory
    host_time: jax.Array  # the GPU waiting for the host to issue the step's work (`_host`)
    memory: TrainingMemory
    fits: jax.Array  # total memory <= HBM capacity
    model_flops: jax.Array  # per step, whole job, without recomputation (MFU numerator), FLOP
    hardware_flops: jax.Array  # per step, whole job, with recomputation (HFU numerator), FLOP
    mfu: jax.Array  # model FLOPs / (step time * GPUs * dense peak at the plan's precision)
    hfu: jax.Array
    tokens_per_s: jax.Array  # whole job
    tokens_per_s_per_gpu: jax.Array
    num_gpus: jax.Array
    feasible: jax.Array  # valid plan that fits in memory
    reason: jax.Array  # 0 if feasible, else the code of the first failed check (see feasibility)


def train_step(model: Transformer, system: System, plan: TrainingPlan,
               efficiency: Efficiency | None = None,
               runtime: Runtime | None = None) -> TrainingReport:
    """Predict one optimizer step of `model` trained on `system` with `plan`.

    step = compute + tp_comm + cp_comm + ep_comm + bubble + pp_comm + dp_comm + optimizer +
    offload + host, each term a function of `_layer` / `_terms` / `_host` (communication and
    offload counted only where not hidden behind compute, host where the GPU waits for it).

    Pure JAX: works unchanged under `jit`, `vmap` (over any leaves of the four arguments) and
    `grad`. Invalid plans are not rejected here; they come back with `feasible = False` and a
    `reason` code (see `diffperf.feasibility.explain`); the numbers of a structurally invalid
    plan (a reason other than 0, 10, 12) are not a prediction and may be anything, NaN
    included: mask them. Use `diffperf.predict_training` for a checked single prediction.

    **Arguments:**

    - `model`: the transformer.
    - `system`: GPUs and network.
    - `plan`: the parallel plan.
    - `efficiency`: calibrated factors (default: the shipped `default_efficiency()`).
    - `runtime`: the software runtime's host costs (default `Runtime()`: a host that never
      binds, the calibration set's Megatron-Core / NeMo; presets: `diffperf.presets.runtime`).

    **Returns:** a `TrainingReport`.
    """
    eff = resolve_efficiency(efficiency)
    runtime = Runtime() if runtime is None else runtime
    acc, net = system.accelerator, system.network
    layer = layer_costs(model, plan, system, eff)
    wait = host_wait(model, plan, layer, runtime, eff.host_overhead)
    m = plan.num_micro_batches
    stage_layers = plan.end_stage_layers(model.layers)

    # The last stage's m micro-batches and its layers' exposed communication; the pipeline.
    head = head_time(model, plan, system, eff)
    compute = m * stage_compute(model, plan, layer, head)
    recompute = m * stage_layers * layer.recompute
    tp_comm, cp_comm, ep_comm = (m * stage_layers * c
                                 for c in (layer.tp_comm, layer.cp_comm, layer.ep_comm))
    host = m * micro_batch_host_wait(model, plan, layer, head, runtime, eff.host_overhead)
    bubble = pipeline_bubble(model, plan, layer, wait)
    pp_comm = pipeline_p2p(model, plan, net, eff)
    # The window-based overlaps in turn (the overlap rule: `_terms`): offloading, then DP.
    params = local_params(model, plan)
    counts = param_counts(model, plan, params[0])  # once, for offloading and the optimizer
    free = free_compute_share(layer)
    offload, offload_hidden = host_copies_exposed(
        model, plan, acc, layer, free, offload_exposed(model, plan, acc, layer, free), counts)
    dp_total = jnp.where(plan.zero >= 3, zero3_collectives(model, plan, net, eff, params),
                         dp_collectives(model, plan, net, eff, params))
    dp_comm = dp_exposed(model, plan, dp_total,
                         dp_overlap_window(model, plan, eff, layer, compute, offload_hidden))
    optimizer = optimizer_time(model, plan, acc, eff, params, counts)

    step = (compute + tp_comm + cp_comm + ep_comm + bubble + pp_comm + dp_comm + optimizer
            + offload + host)
    memory = training_memory(model, plan, eff)
    n_gpus = plan.num_gpus
    peak = peak_matmul_flops(acc, plan.precision)
    mflops = model_flops_per_step(model, plan)
    hflops = hardware_flops_per_step(model, plan)
    tokens = plan.global_batch * model.seq_len
    reason = training_reason(model, plan, acc, memory.total, memory.host)
    return TrainingReport(
        step_time=step, compute_time=compute, recompute_time=recompute, tp_comm_time=tp_comm,
        cp_comm_time=cp_comm, ep_comm_time=ep_comm, pp_comm_time=pp_comm, dp_comm_time=dp_comm,
        bubble_time=bubble, optimizer_time=optimizer, offload_time=offload, host_time=host,
        memory=memory,
        fits=memory.total <= acc.hbm_capacity, model_flops=mflops, hardware_flops=hflops,
        mfu=mflops / (step * n_gpus * peak), hfu=hflops / (step * n_gpus * peak),
        tokens_per_s=tokens / step, tokens_per_s_per_gpu=tokens / step / n_gpus,
        num_gpus=n_gpus, feasible=reason == 0, reason=reason)


def predict_training(model: Transformer, system: System, plan: TrainingPlan,
                     efficiency: Efficiency | None = None,
                     runtime: Runtime | None = None) -> TrainingReport:
    """`train_step` for one configuration, checked: raises ValueError naming the fields and
    values when the plan is structurally invalid (a plan that merely does not fit in HBM or,
    with offloading, in host memory is returned with `feasible` False)."""
    batched = [n for n, leaf in (("model", model), ("system", system), ("plan", plan),
                                 ("runtime", runtime))
               if any(jnp.ndim(x) for x in jax.tree.leaves(leaf))]
    if batched:
        raise ValueError(f"predict_training takes one configuration, but the {batched[0]} has "
                         f"array leaves (a batch): use jax.vmap(train_step) for batches")
    problem = layer_count_error(
        float(model.layers), float(plan.pp), float(plan.vp), float(plan.recompute) == 2.0,
        float(plan.recompute_layers), float(plan.offload_layers),
        name=lambda f: f"TrainingPlan.{f}")
    if problem:
        raise ValueError(problem)
    report = _jitted_train_step(model, system, plan, efficiency, runtime)
    reason = int(jax.device_get(report.reason))
    if reason not in (0, *MEMORY_REASONS):
        raise ValueError(f"infeasible plan: {describe_failure(reason, model, plan)}")
    check_finite_report(report, "the training prediction",
                        f"seq_len={float(model.seq_len):g}, global_batch="
                        f"{float(plan.global_batch):g}, micro_batch={float(plan.micro_batch):g}")
    return report


@stored_jit  # jax.jit; the command line also stores the program, skipping the trace later
def _jitted_train_step(model, system, plan, efficiency, runtime):
    return train_step(model, system, plan, efficiency, runtime)

