"""Predictions for the `infer` rows of benchmark CSVs (used by `diffperf validate` and
`diffperf predict`): vmapped evaluation in fixed-size chunks (one compiled program for any
number of rows)."""

from __future__ import annotations

import jax
import numpy as np

from .._stored_programs import stored_jit
from ..feasibility import VALID_OR_OUT_OF_HBM, explain
from ..inference._infer import infer
from ..specs._efficiency import Efficiency
from ..specs._inference_plan import InferencePlan
from ..specs._transformer import Transformer
from ._data import (
    INFER,
    MODEL_OPTIONAL_COUNTS,
    MODEL_OPTIONAL_FLAGS,
    BenchmarkRow,
    row_model,
    row_system,
)
from ._stack import (
    FAST_COMPILE,
    Progress,
    capacity_warning,
    columns,
    evaluate_chunks,
    gpus_per_node_ok,
    row_efficiencies,
    row_runtimes,
    row_systems,
    spec_field,
    stack_specs,
)

#: Optional values of an infer row and the plan's value when a row lacks one.
_PLAN_OPTIONAL = {"ep": 1.0, "gemm_peak_fraction": 1.0, "grouped_decode_attention": 1.0,
                  "prefill_tokens": 0.0, "weight_scale_block": 16.0}
_MODEL_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "gated_mlp",
               "num_experts", "experts_per_token")


def infer_specs(row: BenchmarkRow) -> tuple[Transformer, object, InferencePlan]:
    """`(Transformer, System, InferencePlan)` of an infer row (raises ValueError if invalid).

    The row's `precision` is used for GEMM activations, for the KV cache unless the row gives
    `kv_precision` (TensorRT-LLM 0.9's FP8 recipes quantise it too; the rows of that table do
    not state it), and for the weights unless the row gives `weight_precision` (weight-only
    quantisation).
    """
    v = row.values
    if v["tp"] * v["pp"] != v["num_gpus"]:
        raise ValueError(f"tp*pp = {v['tp'] * v['pp']:g} does not equal "
                         f"num_gpus = {v['num_gpus']:g}")
    return _specs(v, lambda: row_system(v))


def _specs(v: dict, system_of) -> tuple[Transformer, object, InferencePlan]:
    """The model, `system_of()` and the plan of values `v` (one row's, or [rows] arrays with
    the precisions as codes): the one definition of an infer row's specs."""
    model = row_model(v, v["input_len"] + v["output_len"])
    system = system_of()
    p = v["precision"]
    opt = {k: v.get(k, d) for k, d in _PLAN_OPTIONAL.items()}
    plan = InferencePlan(tp=v["tp"], pp=v["pp"], ep=opt["ep"], batch=v["batch"],
                         input_len=v["input_len"], output_len=v["output_len"],
                         weight_precision=v.get("weight_precision", p),
                         gemm_peak_fraction=opt["gemm_peak_fraction"],
                         activation_precision=p, kv_precision=v.get("kv_precision", p),
                         grouped_decode_attention=opt["grouped_decode_attention"],
                         prefill_tokens=opt["prefill_tokens"],
                         weight_scale_block=opt["weight_scale_block"])
    return model, system, plan


def _screen(row: BenchmarkRow) -> bool:
    """False for a row that fails a check `infer_specs` makes outside the spec classes."""
    v = row.values
    return v["tp"] * v["pp"] == v["num_gpus"] and gpus_per_node_ok(v)


def batched_infer_specs(rows: list[BenchmarkRow]):
    """`infer_specs` of several rows at once (leaves of shape [rows], equal leaf for leaf to
    the stacked specs of the single rows; raises ValueError when any row's specs are
    invalid)."""
    v = columns(rows, _MODEL_KEYS + ("tp", "pp") + INFER,
                {**MODEL_OPTIONAL_FLAGS, **MODEL_OPTIONAL_COUNTS, **_PLAN_OPTIONAL})
    p = [r.values["precision"] for r in rows]
    v["precision"] = spec_field(InferencePlan, "activation_precision", p)
    v["weight_precision"] = spec_field(InferencePlan, "weight_precision",
                                       [r.values.get("weight_precision", q)
                                        for r, q in zip(rows, p)])
    v["kv_precision"] = spec_field(InferencePlan, "kv_precision",
                                   [r.values.get("kv_precision", q) for r, q in zip(rows, p)])
    model, _, plan = _specs(v, lambda: None)
    return model, row_systems(rows), plan  # last: the costliest part of a batch that fails


@stored_jit(compiler_options=FAST_COMPILE, filter=True)  # eqx.filter_jit; stored by the CLI
def _infer_batch(models, systems, plans, effs, runtimes):
    """A vmapped `infer` over one chunk of rows, each with its runtime. The whole report:
    returning only the fields kept changes XLA's fusion, and with it the last bit of some
    float32 results."""
    return jax.vmap(lambda m, s, p, e, r: infer(m, s, p, e, r))(models, systems, plans, effs,
                                                                runtimes)


def _kept(r) -> dict:
    """The fields of an inference report `predict_infer_rows` uses."""
    return {"reason": r.reason, "e2e_latency": r.e2e_latency, "ttft": r.ttft, "tpot": r.tpot,
            "output_tok_s_per_gpu": r.output_tok_s_per_gpu, "memory": r.memory.total}


def stacked_infer_specs(rows: list[BenchmarkRow], progress: Progress | None = None):
    """Stack the `(Transformer, System, InferencePlan)` of every infer row with valid specs
    (a `_stack.StackedRows`; invalid rows go to its `failed`), a chunk of rows at a time,
    with each row's `Runtime` (its `runtime` column)."""
    st = stack_specs(rows, infer_specs, batched_infer_specs, _screen, progress)
    return st._replace(runtimes=row_runtimes(st.rows)) if st.rows else st


def predict_infer_rows(rows: list[BenchmarkRow], eff: Efficiency | None = None,
                       stacked=None, progress: Progress | None = None):
    """Predict infer rows, `_stack.CHUNK_ROWS` at a time in one compiled program.

    `eff`: one `Efficiency` for every row, a `GpuEfficiency` (each row gets its GPU's factors)
    or None (the shipped default, per GPU). `stacked`: the rows' `stacked_infer_specs`, if
    already built; `progress`: a `_stack.Progress` reporting the chunks.

    **Returns:** `(predictions, failed)`: predictions is a list of `(row, {metric: predicted},
    warning or None)` with metrics e2e_latency_s, ttft_s, tpot_s, output_tok_s_per_gpu and
    peak_memory_gb (weights + KV cache + activations + reserve per GPU; not a measured
    column); failed a list of `{"id", "error"}` for rows that cannot be evaluated (invalid or
    infeasible plan). A plan that only exceeds HBM capacity is predicted with a warning.
    """
    st = stacked if stacked is not None else stacked_infer_specs(rows)
    ok, failed = st.rows, list(st.failed)
    if not ok:
        return [], failed
    if progress is not None:
        progress.start(len(ok), "inference rows", "compiling the model first")
    rep = evaluate_chunks(_infer_batch, (st.models, st.systems, st.plans,
                                         row_efficiencies(ok, eff), st.runtimes),
                          len(ok), _kept, progress)
    hbm = np.asarray(st.systems.accelerator.hbm_capacity)
    precision = np.asarray(st.plans.math_precision)
    out = []
    for i, row in enumerate(ok):
        reason = int(rep["reason"][i])
        if reason not in VALID_OR_OUT_OF_HBM:
            failed.append({"id": row.id, "error": explain(reason, precision=int(precision[i]))})
            continue
        pred = {"e2e_latency_s": float(rep["e2e_latency"][i]), "ttft_s": float(rep["ttft"][i]),
                "tpot_s": float(rep["tpot"][i]),
                "output_tok_s_per_gpu": float(rep["output_tok_s_per_gpu"][i]),
                "peak_memory_gb": float(rep["memory"][i]) / 1e9}
        out.append((row, pred, capacity_warning(reason, rep["memory"][i], hbm[i])))
    return out, failed
