"""Predictions for the training rows of benchmark CSVs: vmapped evaluation in fixed-size chunks
(one compiled program for any number of rows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._stored_programs import stored_jit
from ..feasibility import MEMORY_REASONS, describe_failure
from ..specs._efficiency import Efficiency
from ..specs._training_plan import TrainingPlan, layer_count_error
from ..training._step import model_flops_per_step, train_step
from ._data import (
    MODEL_OPTIONAL_COUNTS,
    MODEL_OPTIONAL_FLAGS,
    TRAIN_OPTIONAL_COUNTS,
    TRAIN_OPTIONAL_FLAGS,
    BenchmarkRow,
    row_model,
    train_specs,
)
from ._stack import (
    FAST_COMPILE,
    Progress,
    StackedRows,
    capacity_warning,
    causal_flops_convention,
    columns,
    evaluate_chunks,
    gpus_per_node_ok,
    row_efficiencies,
    row_runtimes,
    row_systems,
    spec_field,
    stack_specs,
    take,
)


@stored_jit(compiler_options=FAST_COMPILE, filter=True)  # eqx.filter_jit; stored by the CLI
def _train_batch(models, systems, plans, effs, runtimes, causal):
    """A vmapped `train_step` (each row with its runtime) and the model FLOPs per step in each
    row's convention, over one chunk of rows (the whole report: see
    `_infer_rows._infer_batch`)."""
    def one(m, s, p, e, rt, c):
        r = train_step(m, s, p, e, rt)
        mf = jnp.where(c, model_flops_per_step(m, p, causal_attention=True),
                       model_flops_per_step(m, p))
        return r, mf
    return jax.vmap(one)(models, systems, plans, effs, runtimes, causal)


def _kept(out) -> dict:
    """The fields of a training report (and the model FLOPs) `predict_train_rows` uses."""
    r, mf = out
    return {"reason": r.reason, "num_gpus": r.num_gpus, "step_time": r.step_time,
            "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu, "memory": r.memory.total,
            "host": r.memory.host, "model_flops": mf}


#: The `TrainingPlan` fields `train_specs` sets from optional values, with their defaults
#: (the reader's own tables; a row's runtime may have replaced a flag's default already).
_PLAN_OPTIONAL = {**TRAIN_OPTIONAL_FLAGS, **TRAIN_OPTIONAL_COUNTS}
#: ... and from required ones.
_PLAN_REQUIRED = ("tp", "pp", "dp", "cp", "ep", "micro_batch", "global_batch", "vp",
                  "sequence_parallel", "recompute", "zero", "precision", "flash_attention")
_MODEL_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "gated_mlp",
               "num_experts", "experts_per_token", "seq_len")


def _screen(row: BenchmarkRow) -> bool:
    """False for a row that fails a check `train_specs` makes outside the spec classes (GPU
    count, layers per pipeline chunk, GPUs per node)."""
    v = row.values
    return (v["tp"] * v["pp"] * v["dp"] * v["cp"] == v["num_gpus"] and gpus_per_node_ok(v)
            and layer_count_error(v["layers"], v["pp"], v["vp"], v["recompute"] == "full",
                                  v.get("recompute_layers", 0), v.get("offload_layers", 0))
            is None)


def batched_train_specs(rows: list[BenchmarkRow]):
    """`train_specs` of several rows at once: `(Transformer, System, TrainingPlan)` with leaves
    of shape [rows], equal leaf for leaf to the stacked specs of the single rows (raises
    ValueError when any row's specs are invalid; `_screen` makes the checks outside the spec
    classes). Keep in step with `validation._data.train_specs`."""
    v = columns(rows, _MODEL_KEYS, {**MODEL_OPTIONAL_FLAGS, **MODEL_OPTIONAL_COUNTS})
    model = row_model(v, v["seq_len"])
    plan = TrainingPlan(**{f: spec_field(TrainingPlan, f, [r.values[f] for r in rows])
                           for f in _PLAN_REQUIRED},
                        **{f: spec_field(TrainingPlan, f, [r.values.get(f, d) for r in rows])
                           for f, d in _PLAN_OPTIONAL.items()})
    return model, row_systems(rows), plan  # last: the costliest part of a batch that fails


def stacked_train_specs(rows: list[BenchmarkRow], progress: Progress | None = None
                        ) -> StackedRows:
    """`stack_specs` of train rows (`(Transformer, System, TrainingPlan)`), built a chunk of
    rows at a time (`batched_train_specs`)."""
    st = stack_specs(rows, train_specs, batched_train_specs, _screen, progress)
    return st._replace(runtimes=row_runtimes(st.rows)) if st.rows else st


def predict_train_rows(rows: list[BenchmarkRow], eff: Efficiency | None = None,
                       stacked: StackedRows | None = None, progress: Progress | None = None):
    """Predictions for train rows: (list of (row, {metric: predicted}, warning)), failed list.

    `eff`: one `Efficiency` for every row, a `GpuEfficiency` (each row gets its GPU's factors)
    or None (the shipped default, per GPU). `stacked`: the rows' `stacked_train_specs`, if
    already built. The rows are evaluated `_stack.CHUNK_ROWS` at a time (`progress`: a
    `_stack.Progress` reporting them)."""
    st = stacked if stacked is not None else stacked_train_specs(rows)
    ok, failed = st.rows, list(st.failed)
    if not ok:
        return [], failed
    causal = np.asarray([causal_flops_convention(r) for r in ok])
    if progress is not None:
        progress.start(len(ok), "training rows", "compiling the model first")
    rep = evaluate_chunks(_train_batch, (st.models, st.systems, st.plans,
                                         row_efficiencies(ok, eff), st.runtimes, causal),
                          len(ok), _kept, progress)
    hbm = np.asarray(st.systems.accelerator.hbm_capacity)
    host_memory = np.asarray(st.systems.accelerator.host_memory)
    out = []
    for i, row in enumerate(ok):
        reason = int(rep["reason"][i])
        if reason not in (0, *MEMORY_REASONS):
            model, plan = take((st.models, st.plans), i)
            failed.append({"id": row.id, "error": describe_failure(reason, model, plan)})
            continue
        n = float(rep["num_gpus"][i])
        step = float(rep["step_time"][i])
        pred = {
            "step_time_s": step,
            "tokens_per_s_per_gpu": float(rep["tokens_per_s_per_gpu"][i]),
            "model_tflops_per_gpu": float(rep["model_flops"][i]) / step / n / 1e12,
            "peak_memory_gb": float(rep["memory"][i]) / 1e9,
        }
        out.append((row, pred, capacity_warning(reason, rep["memory"][i], hbm[i],
                                                rep["host"][i], host_memory[i])))
    return out, failed
