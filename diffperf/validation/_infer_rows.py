"""Predictions for the `infer` rows of benchmark CSVs (used by `diffperf validate`)."""

from __future__ import annotations

import equinox as eqx
import jax

from ..feasibility import VALID_OR_OUT_OF_HBM, explain
from ..inference._infer import infer
from ..specs._efficiency import Efficiency
from ..specs._inference_plan import InferencePlan
from ..specs._transformer import Transformer
from ._data import BenchmarkRow, row_model, row_system
from ._stack import FAST_COMPILE, capacity_warning, row_efficiencies, stack_specs


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
    context = v["input_len"] + v["output_len"]
    model = row_model(v, context)
    sys_ = row_system(v)
    p = v["precision"]
    plan = InferencePlan(tp=v["tp"], pp=v["pp"], ep=v.get("ep", 1), batch=v["batch"],
                         input_len=v["input_len"], output_len=v["output_len"],
                         weight_precision=v.get("weight_precision", p),
                         gemm_peak_fraction=v.get("gemm_peak_fraction", 1.0),
                         activation_precision=p, kv_precision=v.get("kv_precision", p),
                         grouped_decode_attention=v.get("grouped_decode_attention", 1),
                         prefill_tokens=v.get("prefill_tokens", 0))
    return model, sys_, plan


@eqx.filter_jit(compiler_options=FAST_COMPILE)
def _infer_batch(models, systems, plans, effs):
    return jax.vmap(lambda m, s, p, e: infer(m, s, p, e))(models, systems, plans, effs)


def stacked_infer_specs(rows: list[BenchmarkRow]):
    """Stack the `(Transformer, System, InferencePlan)` of every infer row with valid specs
    (a `_stack.StackedRows`; invalid rows go to its `failed`)."""
    return stack_specs(rows, infer_specs)


def predict_infer_rows(rows: list[BenchmarkRow], eff: Efficiency | None = None,
                       stacked=None):
    """Predict infer rows in one vmapped call.

    `eff`: one `Efficiency` for every row, a `GpuEfficiency` (each row gets its GPU's factors)
    or None (the shipped default, per GPU).

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
    models, systems, plans = st.models, st.systems, st.plans
    rep = jax.device_get(_infer_batch(models, systems, plans, row_efficiencies(ok, eff)))
    out = []
    for i, row in enumerate(ok):
        reason = int(rep.reason[i])
        if reason not in VALID_OR_OUT_OF_HBM:
            failed.append({"id": row.id, "error": explain(reason, precision=int(
                plans.math_precision[i]))})
            continue
        pred = {"e2e_latency_s": float(rep.e2e_latency[i]), "ttft_s": float(rep.ttft[i]),
                "tpot_s": float(rep.tpot[i]),
                "output_tok_s_per_gpu": float(rep.output_tok_s_per_gpu[i]),
                "peak_memory_gb": float(rep.memory.total[i]) / 1e9}
        out.append((row, pred, capacity_warning(reason, rep.memory.total[i],
                                                systems.accelerator.hbm_capacity[i])))
    return out, failed
