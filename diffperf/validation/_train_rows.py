"""Predictions for the training rows of benchmark CSVs, in one vmapped evaluation."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..feasibility import MEMORY_REASONS, describe_failure
from ..specs._efficiency import Efficiency
from ..training._step import model_flops_per_step, train_step
from ._data import BenchmarkRow, train_specs
from ._stack import (
    FAST_COMPILE,
    StackedRows,
    capacity_warning,
    causal_flops_convention,
    row_efficiencies,
    stack_specs,
)


@eqx.filter_jit(compiler_options=FAST_COMPILE)
def _train_batch(models, systems, plans, effs, causal):
    def one(m, s, p, e, c):
        r = train_step(m, s, p, e)
        mf = jnp.where(c, model_flops_per_step(m, p, causal_attention=True),
                       model_flops_per_step(m, p))
        return r, mf
    return jax.vmap(one)(models, systems, plans, effs, causal)


def stacked_train_specs(rows: list[BenchmarkRow]) -> StackedRows:
    """`stack_specs` of train rows (`(Transformer, System, TrainingPlan)`)."""
    return stack_specs(rows, train_specs)


def predict_train_rows(rows: list[BenchmarkRow], eff: Efficiency | None = None,
                       stacked: StackedRows | None = None):
    """Predictions for train rows: (list of (row, {metric: predicted}, warning)), failed list.

    `eff`: one `Efficiency` for every row, a `GpuEfficiency` (each row gets its GPU's factors)
    or None (the shipped default, per GPU). `stacked`: the rows' `stacked_train_specs`, if
    already built."""
    st = stacked if stacked is not None else stacked_train_specs(rows)
    ok, failed = st.rows, list(st.failed)
    if not ok:
        return [], failed
    models, systems, plans = st.models, st.systems, st.plans
    causal = jnp.asarray([causal_flops_convention(r) for r in ok])
    rep, mflops = _train_batch(models, systems, plans, row_efficiencies(ok, eff), causal)
    rep, mflops = jax.device_get((rep, mflops))
    out = []
    for i, row in enumerate(ok):
        reason = int(rep.reason[i])
        if reason not in (0, *MEMORY_REASONS):
            model, _, plan = train_specs(row)
            failed.append({"id": row.id, "error": describe_failure(reason, model, plan)})
            continue
        n = float(rep.num_gpus[i])
        step = float(rep.step_time[i])
        pred = {
            "step_time_s": step,
            "tokens_per_s_per_gpu": float(rep.tokens_per_s_per_gpu[i]),
            "model_tflops_per_gpu": float(mflops[i]) / step / n / 1e12,
            "peak_memory_gb": float(rep.memory.total[i]) / 1e9,
        }
        host = (rep.memory.host[i], systems.accelerator.host_memory[i])
        out.append((row, pred, capacity_warning(reason, rep.memory.total[i],
                                                systems.accelerator.hbm_capacity[i], *host)))
    return out, failed
