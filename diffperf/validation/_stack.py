"""Benchmark rows stacked for one vmapped evaluation: the stacked specs of the rows of one
kind, per-row efficiency factors, the compiler options of a one-off evaluation, and the message
of a row whose plan does not fit in memory."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..feasibility import explain
from ..presets import resolve_efficiency
from ..specs._efficiency import Efficiency
from ._data import BenchmarkRow


def stack(trees):
    """Stack a list of pytrees with identical structure along a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def constants_static(tree):
    """A stacked `tree` with every leaf whose values are equal along the batch replaced by that
    one value as a Python float. `eqx.filter_vmap` broadcasts such leaves instead of mapping
    them, and the model sees them concrete: trace-time specialisation
    (`Transformer.known_absent` / `known_present`) and XLA's constant folding then apply to what
    all rows share (e.g. no row of the shipped data has MLA or shared experts)."""
    def one(x):
        a = np.asarray(x)
        return float(a[0]) if a.ndim == 1 and a.size and np.all(a == a[0]) else x
    return jax.tree.map(one, tree)


def causal_flops_convention(row: BenchmarkRow) -> bool:
    """True for sources whose model TFLOP/s count causal (half) attention FLOPs: Megatron-Bridge
    tables (see benchmarks_data/SOURCES.md, 'Two model-FLOP conventions')."""
    return "megatron-bridge" in row.source.lower() or row.id.startswith("mbridge")


#: Validation evaluates a few hundred rows once: compile time dominates, so LLVM's expensive
#: optimisation passes (2x the compile time, nothing measurable at run time here) are skipped.
FAST_COMPILE = {"xla_llvm_disable_expensive_passes": True}


class StackedRows(NamedTuple):
    """Specs of the evaluable rows of one kind, stacked along a leading row axis (built with
    the float dtype in force when called: float64 under `jax_enable_x64`)."""

    rows: list  # the BenchmarkRows that could be turned into specs, in order
    models: object  # stacked Transformer
    systems: object  # stacked System
    plans: object  # stacked TrainingPlan / InferencePlan
    failed: list  # [{"id", "error"}] of rows whose specs are invalid


def stack_specs(rows: list[BenchmarkRow], to_specs) -> StackedRows:
    """Stack the `(Transformer, System, plan)` that `to_specs(row)` builds for every row (rows
    whose specs raise ValueError go to `failed`). Models are None when no row is valid."""
    ok, failed, specs = [], [], []
    for row in rows:
        try:
            specs.append(to_specs(row))
            ok.append(row)
        except ValueError as e:
            failed.append({"id": row.id, "error": str(e)})
    if not ok:
        return StackedRows([], None, None, None, failed)
    models, systems, plans = (stack([s[i] for s in specs]) for i in range(3))
    return StackedRows(ok, models, systems, plans, failed)


def row_efficiencies(rows: list[BenchmarkRow], efficiency: Efficiency | None):
    """One `Efficiency` per row, stacked: each row's GPU factors (see `resolve_efficiency`)."""
    cache = {}
    for r in rows:
        g = r.values["gpu"]
        if g not in cache:
            cache[g] = resolve_efficiency(efficiency, g)
    return stack([cache[r.values["gpu"]] for r in rows])


def capacity_warning(reason: int, memory_total, capacity, host_total=None,
                     host_capacity=None) -> str | None:
    """The message of a plan that does not fit in HBM (reason 10) or, with offloading, in host
    memory (reason 12), with the numbers; None for other reasons. HBM is checked first, so an
    HBM overflow also names a host-memory overflow."""
    has_host = host_total is not None and host_capacity is not None
    host = (explain(12, float(host_total), float(host_capacity)) if has_host else explain(12))
    if reason == 12:
        return host
    if reason != 10:
        return None
    text = explain(10, float(memory_total), float(capacity))
    return f"{text}; {host}" if has_host and float(host_total) > float(host_capacity) else text
