"""Exhaustive parallel-plan search for training: every plan of a grid over TP x PP x CP x EP x
VP x micro-batch x recompute x ZeRO x SP x flash x overlaps (DP derived from the GPU count),
evaluated on the device with `diffperf.run_sweep`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from ..feasibility import REASONS, Reason, divides, even_layout, offload_supported
from ..presets import resolve_efficiency
from ..specs._efficiency import Efficiency
from ..specs._hardware import PRECISIONS, System
from ..specs._runtime import Runtime
from ..specs._training_plan import RECOMPUTE, TrainingPlan
from ..specs._transformer import Transformer
from ..training._step import train_step
from ._grid import Grid
from ._sweep import pareto_front, run_sweep

if TYPE_CHECKING:
    import pandas as pd

#: Extra reason codes used by searches (after the model's own, `feasibility.REASONS`): tp * pp
#: * cp does not divide the GPU count; a setting has no effect (sequence parallelism or TP
#: overlap at tp = 1, DP overlap or ZeRO without data parallelism, selective recomputation with
#: flash attention): the simpler twin is kept.
REASON_GPUS = Reason.SEARCH_GPUS
REASON_DUPLICATE = Reason.SEARCH_DUPLICATE
#: Search-only reason: pp * vp does not divide the layer count, so the stages (or interleaved
#: chunks) cannot all hold the same whole number of layers with Megatron's standard arguments.
REASON_UNEVEN = Reason.SEARCH_UNEVEN
#: Search-only reason: an offload that its software does not run. Megatron-core's activation
#: offloading runs only without pipeline parallelism and without recomputation, on fewer layers
#: than the model has (its `TransformerConfig` rejects the rest); optimizer offload needs a
#: sharded optimizer (ZeRO >= 1: DeepSpeed's ZeRO-Offload, Megatron-core's distributed
#: optimizer) and weight offload ZeRO-3 (ZeRO-Infinity). See `feasibility.offload_supported`.
REASON_OFFLOAD = Reason.SEARCH_OFFLOAD
#: The reason code of a plan that does not fit in HBM (`feasibility.REASONS`).
HBM_REASON = Reason.HBM

PLAN_AXES = ("tp", "pp", "cp", "ep", "vp", "micro_batch", "recompute", "zero",
             "sequence_parallel", "flash_attention", "overlap_tp", "overlap_dp", "precision",
             "fp32_gradients", "offload_layers", "expert_tp", "overlap_ep",
             "offload_optimizer", "offload_weights")


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def default_training_grid(model: Transformer, gpus: int, global_batch: int,
                          precisions=(0, 1), fp32_gradients=(1,), offload_layers=(0,),
                          plan_defaults: dict | None = None, offload_optimizer=(0,),
                          offload_weights=(0,)) -> Grid:
    """The default search space (1.8 x 10^7 plans for GPT-3 175B on 1,024 A100s).

    tp: powers of two up to 64; pp: divisors of the GPU count up to the layer count that divide
    the layer count or are powers of two; cp: 1, 2, 4, 8, 16; ep: divisors of the
    expert count (1 for dense), and for MoE models expert_tp tp or 1 and the all-to-all
    overlap off / on; vp: divisors of the layer count; micro-batch: divisors of the
    global batch up to 256; recompute none / selective / full; ZeRO 0-3; sequence parallelism,
    flash attention, TP and DP overlap on / off; `precisions` (codes; default tf32 and bf16).
    `fp32_gradients` (1 fp32, 0 16-bit gradient buffers), `offload_layers` (layers per chunk
    with activations in host memory), `offload_optimizer` (shares of the optimizer states in
    host memory) and `offload_weights` (0 / 1) become axes only when they differ from the
    defaults (fp32 gradients, no offloading). `plan_defaults` (plan field -> value: a software
    runtime's, `diffperf.presets.runtime_plan_defaults`) fixes those axes to its one value (a
    runtime without TP overlap searches overlap_tp = 0 only).
    """
    layers = int(np.asarray(model.layers))
    experts = int(np.asarray(model.num_experts))
    pow2 = [1, 2, 4, 8, 16, 32, 64]
    axes = ({
        "tp": [t for t in pow2 if gpus % t == 0],
        "pp": [p for p in _divisors(gpus, layers) if layers % p == 0 or p in pow2],
        "cp": [c for c in (1, 2, 4, 8, 16) if gpus % c == 0],
        "ep": _divisors(experts, experts) if experts > 1 else [1],
        "vp": _divisors(layers, layers),
        "micro_batch": _divisors(global_batch, 256),
        "recompute": [0, 1, 2],
        "zero": [0, 1, 2, 3],
        "sequence_parallel": [0, 1],
        "flash_attention": [0, 1],
        "overlap_tp": [0, 1],
        "overlap_dp": [0, 1],
        "precision": list(precisions),
    } | ({"expert_tp": [0, 1], "overlap_ep": [0, 1]} if experts > 1 else {})
      | ({"fp32_gradients": list(fp32_gradients)} if list(fp32_gradients) != [1] else {})
      | ({"offload_layers": list(offload_layers)} if list(offload_layers) != [0] else {})
      | ({"offload_optimizer": list(offload_optimizer)}
         if list(offload_optimizer) != [0] else {})
      | ({"offload_weights": list(offload_weights)} if list(offload_weights) != [0] else {}))
    return Grid(axes | {k: [v] for k, v in (plan_defaults or {}).items() if k in axes})


def check_training_grid(grid: Grid) -> None:
    """Raise a ValueError naming the axis and value when a grid axis is not a `PLAN_AXES`
    field or holds a value its `TrainingPlan` field refuses (e.g. recompute code 3)."""
    for name, values in grid.axes.items():
        if name not in PLAN_AXES:
            raise ValueError(f"grid axis {name!r} is not a plan field a search varies; "
                             f"choose from {', '.join(PLAN_AXES)}")
        for v in values:
            try:
                TrainingPlan(**{name: float(v)})
            except ValueError as e:
                raise ValueError(f"grid axis {name!r}: {e}") from None


def plan_from_values(values: dict, gpus, global_batch,
                     plan_defaults: dict | None = None) -> TrainingPlan:
    """A TrainingPlan from grid values (dp = gpus / (tp * pp * cp)). Works on traced values.
    `plan_defaults` (plan field -> value, e.g. a software runtime's) replaces the defaults of
    the fields `values` does not give, any `TrainingPlan` field (`overlap_tp_backward`)."""
    v = dict(values)
    defaults = {"tp": 1.0, "pp": 1.0, "cp": 1.0, "ep": 1.0, "vp": 1.0, "micro_batch": 1.0,
                "recompute": 0.0,
                "zero": 1.0, "sequence_parallel": 0.0, "flash_attention": 1.0,
                "overlap_tp": 1.0, "overlap_dp": 1.0, "precision": 1.0, "fp32_gradients": 1.0,
                "offload_layers": 0.0, "expert_tp": 0.0, "overlap_ep": 0.0,
                "offload_optimizer": 0.0, "offload_weights": 0.0}
    extra = {}
    for key, d in (plan_defaults or {}).items():
        if key in defaults:
            defaults[key] = d
        elif key not in ("dp", "global_batch"):
            extra[key] = d
    for key, d in defaults.items():
        v.setdefault(key, d)
    dp = gpus / (v["tp"] * v["pp"] * v["cp"])
    fields = {k: v[k] for k in PLAN_AXES}
    return TrainingPlan(dp=dp, global_batch=global_batch, **fields, **extra)


def _gpus_reason(reason, values, gpus):
    """Search-only reasons on top of the model's: the GPU count (`REASON_GPUS`) and settings
    that have no effect, so each distinct plan is counted and ranked once (`REASON_DUPLICATE`)."""
    tp, pp, cp = (values.get(k, 1.0) for k in ("tp", "pp", "cp"))
    per = tp * pp * cp
    dp = gpus / per
    no_effect = (
        ((values.get("sequence_parallel", 0.0) > 0) & (tp == 1))
        | ((values.get("overlap_tp", 0.0) > 0) & (tp == 1) & (cp == 1)
           & (values.get("ep", 1.0) == 1))
        | ((values.get("overlap_dp", 0.0) > 0) & (dp * cp == 1))
        | ((values.get("zero", 0.0) > 0) & (dp * cp == 1)  # unless an offload needs it
           & (values.get("offload_optimizer", 0.0) == 0)
           & (values.get("offload_weights", 0.0) == 0))
        | ((values.get("recompute", 0.0) == 1) & (values.get("flash_attention", 0.0) > 0))
        | ((values.get("expert_tp", 0.0) == 1) & (tp == 1))
        | ((values.get("overlap_ep", 0.0) > 0) & (values.get("ep", 1.0) == 1)))
    reason = jnp.where((reason == 0) & no_effect, REASON_DUPLICATE, reason)
    return jnp.where(divides(per, gpus), reason, REASON_GPUS)


def search_training(model: Transformer, system: System, gpus: int, global_batch: int,
                    grid: Grid | None = None, efficiency: Efficiency | None = None,
                    top_k: int = 10, devices=None,
                    progress: bool = True, even_layouts: bool = True,
                    runtime: Runtime | None = None, plan_defaults: dict | None = None,
                    plan_sink=None) -> dict:
    """Find the fastest feasible training plans.

    `plan_sink`: `run_sweep`'s `sink` (every feasible plan's flat index, step time and memory
    per block, e.g. to stream them to a file).

    `runtime`: the software runtime's host costs (default None: `train_step`'s default, the
    calibration set's); `plan_defaults` (plan field -> value, a runtime's
    `diffperf.presets.runtime_plan_defaults`): the values of the plan fields the grid does not
    vary (pass it to `default_training_grid` too, to fix the axes it names).

    `even_layouts` (default True): only plans whose pp * vp divides the layer count
    (`even_layout`); False also ranks uneven layouts, modelled as perfectly balanced.
    Plans that offload are kept only where their software runs them (`offload_supported`:
    activations as Megatron-core allows, optimizer states with ZeRO >= 1, weights with
    ZeRO-3). `default_training_grid` searches offloading and 16-bit gradients
    only when asked to.

    **Returns:** a dict with `evaluated`, `feasible`, `seconds` (wall time, compilation
    included), `reasons` (infeasible counts by reason text), `top` (DataFrame of the best plans
    with their step-time breakdown, memory and the reason each trails the best), `pareto`
    (DataFrame: step time vs memory per GPU front) and the raw `SweepResult`.
    """
    t0 = time.perf_counter()
    eff = resolve_efficiency(efficiency)
    grid = grid if grid is not None else default_training_grid(model, gpus, global_batch)
    check_training_grid(grid)

    def evaluate(values):
        plan = plan_from_values(values, gpus, global_batch, plan_defaults)
        r = train_step(model, system, plan, eff, runtime)
        reason = _gpus_reason(r.reason, values, gpus)
        if even_layouts:
            reason = jnp.where((reason == 0) & ~even_layout(model, plan), REASON_UNEVEN, reason)
        reason = jnp.where((reason == 0) & ~offload_supported(model, plan), REASON_OFFLOAD,
                           reason)
        return r.step_time, r.memory.total, reason

    # Equivalent plans (e.g. selective recompute with flash attention = none) tie exactly:
    # keep 4x as many and drop the duplicates below.
    res = run_sweep(grid, evaluate, k=4 * top_k, devices=devices, progress=progress,
                    label="search", sink=plan_sink)
    top_idx = res.top_index[np.isfinite(res.top_value)]
    front_ok = res.front_index >= 0
    front_idx = res.front_index[front_ok][pareto_front(res.front_value[front_ok],
                                                       res.front_secondary[front_ok])]
    both = describe_plans(model, system, gpus, global_batch, grid,
                          np.concatenate([top_idx, front_idx]), eff, explain_gap=False,
                          runtime=runtime, plan_defaults=plan_defaults)
    # Plans whose step times tie (to 1 us) are listed with the one needing less memory first.
    top = both.iloc[:top_idx.size]
    if len(top):  # (no feasible plan: an empty frame without columns)
        top = top.drop_duplicates(["step_time_s", "memory_gb"])
        top = top.iloc[np.lexsort((top["memory_gb"].to_numpy(),
                                   top["step_time_s"].to_numpy().round(6)))].head(top_k)
    top = _explain_gaps(top.reset_index(drop=True))
    pareto = both.iloc[top_idx.size:].reset_index(drop=True)
    reasons_all = dict(REASONS) | {
        REASON_GPUS: "tp * pp * cp does not divide the GPU count",
        REASON_DUPLICATE: "a setting has no effect (the simpler equivalent plan is kept)",
        REASON_UNEVEN: "pp * vp does not divide the layer count (uneven layout)",
        REASON_OFFLOAD: "activation offloading needs pp = 1 and no recomputation "
                        "(Megatron-core); optimizer offload ZeRO >= 1; weight offload ZeRO-3"}
    reasons = {reasons_all.get(i, str(i)): int(c) for i, c in enumerate(res.reasons)
               if c and i != 0}
    least = None
    if res.feasible == 0 and res.reasons[HBM_REASON]:
        # Nothing fits: the plan needing the least HBM among those that fail only on it (and
        # that the search would rank: an even layout, offloading Megatron-core supports).
        def memory_only(values):
            _, memory, reason = evaluate(values)
            plan = plan_from_values(values, gpus, global_batch, plan_defaults)
            ranked = offload_supported(model, plan)
            if even_layouts:
                ranked = ranked & even_layout(model, plan)
            return memory, memory, jnp.where((reason == HBM_REASON) & ranked, 0, 1)
        low = run_sweep(grid, memory_only, k=1, devices=devices, progress=False, label="memory")
        if np.isfinite(low.top_value[0]):
            least = describe_plans(model, system, gpus, global_batch, grid, low.top_index[:1],
                                   eff, explain_gap=False, runtime=runtime,
                                   plan_defaults=plan_defaults)
    return {"evaluated": res.evaluated, "feasible": res.feasible,
            "seconds": time.perf_counter() - t0, "reasons": reasons, "top": top,
            "pareto": pareto, "least_memory": least, "result": res, "grid": grid}


def _report_function(model, system, gpus, global_batch, eff, runtime=None, plan_defaults=None):
    """`values -> train_step reports` for a batch of grid-axis values (a dict of 1-D arrays).

    The model, system, efficiency, GPU count and global batch are closed over, so they are
    compile-time constants as in the sweep itself: the layer kinds the model lacks
    (`Transformer.known_absent`) and the plan fields no axis varies fold away. That halves the
    compilation against passing them as arguments (GPT-3 175B on CPU: about 2.8 s instead of
    5.8 s). Compiled without LLVM's expensive passes: for a hundred plans the faster
    compilation matters, the run time does not."""
    def reports(values):
        return jax.vmap(lambda v: train_step(
            model, system, plan_from_values(v, gpus, global_batch, plan_defaults), eff,
            runtime))(values)
    return jax.jit(reports, compiler_options={"xla_llvm_disable_expensive_passes": True})


_BREAKDOWN = {"compute_time": "compute", "tp_comm_time": "TP communication",
              "cp_comm_time": "CP communication", "ep_comm_time": "EP all-to-all",
              "pp_comm_time": "pipeline send/recv", "dp_comm_time": "DP communication",
              "bubble_time": "pipeline bubble", "optimizer_time": "optimizer",
              "offload_time": "host offload copies", "host_time": "host wait"}


def describe_plans(model, system, gpus, global_batch, grid: Grid, flat_indices,
                   eff: Efficiency, explain_gap: bool = True, runtime: Runtime | None = None,
                   plan_defaults: dict | None = None) -> pd.DataFrame:
    """Full reports of a few grid points as a DataFrame (one row per plan, best first);
    `runtime` and `plan_defaults` as in `search_training`."""
    import pandas as pd
    flat_indices = np.asarray(flat_indices, dtype=np.int64)
    if flat_indices.size == 0:
        return pd.DataFrame()
    values = grid.decode_host(flat_indices)
    n = flat_indices.size
    real = jnp.result_type(float)
    rep = _report_function(model, system, gpus, global_batch, eff, runtime, plan_defaults)(
        {k: jnp.asarray(v, dtype=real) for k, v in values.items()})
    rep = jax.device_get(rep)
    plan = jax.tree.map(lambda x: np.broadcast_to(x, (n,)),
                        plan_from_values(values, gpus, global_batch, plan_defaults))
    cols = ("tp", "pp", "dp", "cp", "ep", "vp", "micro_batch", "recompute", "zero",
            "sequence_parallel", "flash_attention", "overlap_tp", "overlap_dp", "fp32_gradients",
            "offload_layers", "expert_tp", "overlap_ep", "offload_weights")
    df = pd.DataFrame({k: np.rint(np.asarray(getattr(plan, k))[:n]).astype(int) for k in cols})
    df["offload_optimizer"] = np.asarray(plan.offload_optimizer, dtype=float)[:n]
    df["recompute"] = [RECOMPUTE[int(x)] for x in df["recompute"]]
    df["precision"] = [PRECISIONS[int(x)] for x in np.asarray(plan.precision)[:n]]
    df["step_time_s"] = rep.step_time
    for field in _BREAKDOWN:
        df[field.replace("_time", "_s")] = getattr(rep, field)
    df["memory_gb"] = rep.memory.total / 1e9
    df["mfu"] = rep.mfu
    df["feasible"] = rep.feasible
    return _explain_gaps(df) if explain_gap else df


def _explain_gaps(df: pd.DataFrame) -> pd.DataFrame:
    """Add a `vs_best` column: how far each plan trails the first and which term dominates."""
    if len(df) == 0:
        return df
    best = df.iloc[0]
    notes = ["best"]
    for i in range(1, len(df)):
        row = df.iloc[i]
        gaps = {name: row[f.replace("_time", "_s")] - best[f.replace("_time", "_s")]
                for f, name in _BREAKDOWN.items()}
        worst, gain = max(gaps, key=gaps.get), min(gaps, key=gaps.get)
        total = row["step_time_s"] - best["step_time_s"]
        if gaps[worst] <= total + 1e-9 or gaps[gain] >= 0:
            notes.append(f"+{total:.3f} s; mostly {worst} (+{gaps[worst]:.3f} s)")
        else:  # one term loses more than the whole gap, another wins some back
            notes.append(f"+{total:.3f} s; {worst} +{gaps[worst]:.3f} s, {gain} "
                         f"{gaps[gain]:+.3f} s")
    df = df.copy()
    df["vs_best"] = notes
    return df
