"""Uncertainty of a calibration: Laplace approximation and delta-method prediction intervals.

Convention. The loss is `L(theta) = (1/N) sum_i r_i^2 + prior(theta)` with `r_i` the log ratio
of predicted to measured over the N fitted cells. Reading `exp(-N L / (2 s^2))` as the
posterior of `theta` (Gaussian log residuals of variance `s^2`, the prior in the same units),
the Laplace approximation at the optimum is Gaussian with

    cov(theta) = (N / (2 s^2) * H)^-1 = 2 s^2 / N * H^-1,    H = d^2 L / d theta^2 (see `hessian`),

and `s^2 = sum r_i^2 / max(N - P, 1)` (P = len(theta)). This treats the cells as independent,
which they are not (two columns of one row, one systematic model error across a table), so the
parameter covariance is optimistic; the prediction interval therefore also adds the model error
`residual_sd` by default:

    var(log f) = g^T cov g + residual_sd[q]^2,    g = d log f(eff(theta)) / d theta,
    interval = f * exp(+-z sd),  z = Phi^-1((1 + level) / 2).

`residual_sd[q]` is the RMS log residual of the predicted quantity q (`QUANTITIES`: a training
step, a batch-1 end-to-end latency, a batched decode throughput, a first-token latency), one
residual per measurement. Estimated from cross-validated residuals, it already contains some
parameter error, so adding `g^T cov g` on top is slightly conservative (1.9 % log sd for the
median cell in quadrature). `calibrate` sets it from the in-sample residuals;
`calibration/refit.py` replaces it with the leave-one-source-out residuals (the error on tables
the fit never saw, which is what a new configuration faces) and measures how many held-out
values fall inside their interval (`interval_coverage`). Both it and `diffperf calibrate` add
the MoE training error measured on MoE runs the fit never saw (`moe_step_error`), and the
error of inference outside the fit's inference data (a GPU or GEMM precision no fitted inference
row ran), measured on held-out inference rows of that kind (`unseen_inference_error`), and that of
MoE inference (`moe_inference_error`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import read_json
from ..presets import (
    DEFAULT_RUNTIME,
    _default_efficiency_data,
    chip_of,
    fitted_gpu,
    runtime,
    system_gpu,
)
from ..specs._hardware import PRECISION_CODES
from ..validation._data import TRAIN_TIME_METRICS
from ._parameterisation import Parameterisation
from ._results import Fit

#: Largest z * sd (log scale) of a reported interval: beyond it (a factor of e^5 = 148 each
#: way) the fit's covariance is degenerate and an interval would say nothing.
MAX_LOG_HALF_WIDTH = 5.0

#: Measured columns grouped by the quantity they measure; one model error per quantity.
#: Training tokens/s and model TFLOP/s are the step time in other units. Inference splits by
#: regime, because the two err at different scales: `latency` is the end-to-end latency (and
#: TPOT) of a batch-1 run, bound by streaming the weights; `throughput` is a batched run's
#: output tokens/s per GPU, and its latency or TPOT when a row measures those instead
#: (`quantity_of(metric, batch)`).
QUANTITIES = {
    "step_time": TRAIN_TIME_METRICS,
    "latency": ("e2e_latency_s", "tpot_s"),
    "throughput": ("output_tok_s_per_gpu",),
    "ttft": ("ttft_s",),
}


#: The model error of a MoE model's training step, used instead of `step_time` when a fit
#: records it. The fitted tables hold few MoE runs, and runs of fine-grained MoE models the fit
#: never saw miss by far more than dense ones (`calibration/refit.py` measures it on the
#: held-out `benchmarks_data/train_moe_holdout.csv` and the MoE rows' leave-one-source-out
#: predictions).
MOE_STEP_TIME = "step_time_moe"


#: The model error of a training step under a runtime whose host issues the work (eager
#: frameworks: `Runtime` host times > 0), used instead of `step_time` when a fit records it.
#: Those runs (small models on few GPUs, host-bound) miss by more than the large runs of the
#: calibration set, and they are many (720 vTrain rows): pooled with the others they would
#: widen every large run's interval, so they are kept apart, also from the `train` / `all`
#: fallbacks.
HOST_STEP_TIME = "step_time_host"


def issues_from_host(runtime_name) -> bool:
    """Whether the runtime (a preset name, None for the default, or a `Runtime`) spends host
    time per operator, collective or step (an eager framework), which makes its runs' model
    error `HOST_STEP_TIME`."""
    if runtime_name is None or isinstance(runtime_name, str):
        return _preset_issues_from_host(runtime_name or DEFAULT_RUNTIME)
    rt = runtime_name
    return max(float(rt.host_op_time), float(rt.host_backward_op_time),
               float(rt.host_collective_time), float(rt.host_step_time)) > 0.0


@functools.cache
def _preset_issues_from_host(name: str) -> bool:
    return issues_from_host(runtime(name))


def training_quantity(num_experts, runtime_name=None) -> str:
    """The model-error key of a training prediction for a model with `num_experts` experts per
    MoE layer (`Transformer.num_experts`, a benchmark row's column) under the runtime
    `runtime_name` (a preset name or a `Runtime`): `MOE_STEP_TIME` for a MoE model (> 1),
    else `HOST_STEP_TIME` under a runtime whose host issues the work (`issues_from_host`),
    else `"step_time"`."""
    if float(np.max(np.asarray(num_experts))) > 1:
        return MOE_STEP_TIME
    return HOST_STEP_TIME if issues_from_host(runtime_name) else "step_time"


#: File name of the held-out MoE training runs in `benchmarks_data/` (never fitted): the rows
#: `moe_step_error` measures a fit's MoE error on.
MOE_HOLDOUT = "train_moe_holdout.csv"


def moe_step_error(fit, fitted_predictions: list[dict], held_out_rows: list[dict]) -> dict:
    """Set `fit.residual_sd[MOE_STEP_TIME]`, the model error of a MoE model's training step:
    the RMS log residual log(predicted / measured) over the fit's own MoE rows and MoE runs it
    never saw, one residual per measurement (a row's columns averaged).

    - `fitted_predictions`: prediction cells of the fitted rows (`_results.predictions_table`
      form), cross-validated where possible; only the MoE rows' cells are used.
    - `held_out_rows`: `validate(...)["rows"]` of held-out MoE runs predicted with this fit.

    Leaves `fit` unchanged when there is no MoE measurement. **Returns:** `{"fitted": n,
    "held_out": n, "residuals": array}`.
    """
    moe_ids = {r.id for r in fit.problem.ds.train_rows
               if training_quantity(r.values["num_experts"]) == MOE_STEP_TIME}
    fitted = [m["r"] for m in measurements([p for p in fitted_predictions if p["id"] in moe_ids])]
    held: dict[str, list[float]] = {}
    for row in held_out_rows:
        held.setdefault(row["id"], []).append(math.log(row["predicted"] / row["measured"]))
    residuals = np.array(fitted + [float(np.mean(v)) for v in held.values()])
    if residuals.size:
        fit.residual_sd[MOE_STEP_TIME] = float(np.sqrt(np.mean(residuals ** 2)))
    return {"fitted": len(fitted), "held_out": len(held), "residuals": residuals}


#: The model error of an inference prediction on a GPU, or at a GEMM precision, that no fitted
#: inference row ran (`is_unseen_inference`): the fit knows such a GPU only from training
#: rows, or such a precision only from the datasheet. Applied as the larger of it and the
#: prediction's own quantity error; measured on held-out inference rows of that kind
#: (`unseen_inference_error`).
UNSEEN_INFERENCE = "infer_unseen"

#: The model error of inference of a MoE model with more experts per layer than any fitted
#: inference row (`inference_support`'s "max_experts"; the shipped fit's are Mixtral's 8),
#: applied as the larger of it and the prediction's own quantity error: fine-grained MoE layers
#: cost far more than their GEMMs (router, permutation, small grouped GEMMs), which the model
#: does not represent. Measured on held-out rows of such models (`moe_inference_error`).
MOE_INFERENCE = "infer_moe"

#: File name of the held-out inference rows in `benchmarks_data/` (never fitted): the rows
#: `unseen_inference_error` and `moe_inference_error` measure a fit's errors on.
INFER_HOLDOUT = "infer_trtllm10_holdout.csv"


#: Names of the precision codes `inference_support` records.
PRECISION_CLASS_NAMES = {0: "fp32", 1: "16-bit", 2: "fp8", 3: "fp4"}


def _precision_class(precision) -> int:
    """The precision code (`diffperf.specs.PRECISION_CODES`: 0 fp32 / tf32, 1 bf16 / fp16, 2 fp8,
    3 fp4) of a GEMM precision name or code; a ValueError names anything else (int8 / int4
    are weight storage, not a GEMM precision)."""
    if isinstance(precision, str) and precision.strip().lower() in PRECISION_CODES:
        return PRECISION_CODES[precision.strip().lower()]
    if not isinstance(precision, (str, bool)) and precision in (0, 1, 2, 3):
        return int(precision)
    raise ValueError(f"GEMM precision must be one of {sorted(PRECISION_CODES)} or a code 0-3, "
                     f"got {precision!r} (int8 / int4 weights run their GEMMs at the "
                     f"activation precision)")


def inference_support(infer_rows) -> dict:
    """The GPUs, GEMM precisions and largest expert count of fitted inference rows
    (`BenchmarkRow`s with `values["gpu"]`, `values["precision"]`, the GEMM input precision,
    and `values["num_experts"]`) as `{"gpus": [ids], "precisions": [codes], "max_experts": n}`:
    what `inference_floors` compares against."""
    rows = list(infer_rows)
    return {"gpus": sorted({chip_of(r.values["gpu"]) for r in rows}),
            "precisions": sorted({_precision_class(r.values["precision"]) for r in rows}),
            "max_experts": int(max(float(r.values["num_experts"]) for r in rows))}


def beyond_fitted_experts(support: dict | None, num_experts) -> bool:
    """Whether a MoE model with `num_experts` experts per layer has more than any fitted
    inference row (`support["max_experts"]`; False when the fit recorded no support)."""
    if not support:
        return False
    return float(np.max(np.asarray(num_experts))) > support.get("max_experts", 1)


def is_unseen_inference(support: dict | None, gpu: str | None, precision) -> bool:
    """Whether an inference prediction on `gpu` with GEMM inputs at `precision` (name or code;
    None: not checked) lies outside `support` (`inference_support`): a GPU none of whose
    fitted inference rows ran (compared as the chips whose factors apply: a system id stands
    for its GPU, the H800 for the H100), or a GEMM precision no fitted inference row used.
    False when the fit recorded no support (a training-only fit, or one saved before the
    support was recorded)."""
    return any(_unseen_axes(support, gpu, precision))


def _unseen_axes(support: dict | None, gpu: str | None, precision) -> tuple[bool, bool]:
    """(the GPU's chip, the GEMM precision) lies outside `support`; both False without one."""
    if not support:
        return False, False
    new_gpu = gpu is not None and chip_of(gpu) not in {chip_of(g) for g in support["gpus"]}
    new_precision = (precision is not None
                     and _precision_class(precision) not in support["precisions"])
    return new_gpu, new_precision


def inference_floors(support: dict | None, gpu: str | None, precision,
                     num_experts=1) -> tuple[str, ...]:
    """The model errors an inference prediction's interval is at least as wide as, beyond its
    quantity's: `UNSEEN_INFERENCE` on a GPU or at a GEMM precision outside the fit's inference
    data (`is_unseen_inference`), `MOE_INFERENCE` for a MoE model with more experts than any
    fitted inference row (`beyond_fitted_experts`)."""
    floors = (UNSEEN_INFERENCE,) if is_unseen_inference(support, gpu, precision) else ()
    return floors + ((MOE_INFERENCE,) if beyond_fitted_experts(support, num_experts) else ())


def _held_out_log_ratios(held_out_rows: list[dict], held_out_data) -> tuple[dict, dict]:
    """`({id: parsed row}, {id: mean log(predicted / measured)})` of the held-out inference
    rows (`validate(...)["rows"]`) whose parsed rows (`BenchmarkRow`s) are in `held_out_data`."""
    by_id = {r.id: r for r in held_out_data if r.kind == "infer"}
    res: dict[str, list[float]] = {}
    for row in held_out_rows:
        if row["id"] in by_id:
            res.setdefault(row["id"], []).append(math.log(row["predicted"] / row["measured"]))
    return by_id, {i: float(np.mean(v)) for i, v in res.items()}


def unseen_inference_error(fit, held_out_rows: list[dict], held_out_data) -> dict:
    """Set `fit.residual_sd[UNSEEN_INFERENCE]`: the RMS log residual log(predicted / measured)
    of the held-out inference rows on a GPU or at a GEMM precision outside the fit's inference
    support (`fit.inference_support`), one residual per row (its columns averaged). Rows of
    models with more experts than any fitted row have their own error
    (`moe_inference_error`) and are left out.

    - `held_out_rows`: `validate(...)["rows"]` of held-out inference rows predicted with this fit.
    - `held_out_data`: the parsed rows of the same file (`BenchmarkRow`s, for their GPU, GEMM
      precision and experts).

    Also records their mean log residual in `fit.metadata["floor_bias"]` (the interval notes
    say which way such predictions err). Leaves `fit` unchanged when no such row exists.
    **Returns:** `{"unseen": n, "seen": n,
    "residuals": array of the unseen rows}` (within the fitted expert counts).
    """
    by_id, ratio = _held_out_log_ratios(held_out_rows, held_out_data)
    dense = [i for i in ratio if not beyond_fitted_experts(fit.inference_support,
                                                           by_id[i].values["num_experts"])]
    unseen = [i for i in dense if is_unseen_inference(fit.inference_support,
                                                      by_id[i].values["gpu"],
                                                      by_id[i].values["precision"])]
    residuals = np.array([ratio[i] for i in unseen])
    if residuals.size:
        fit.residual_sd[UNSEEN_INFERENCE] = float(np.sqrt(np.mean(residuals ** 2)))
        fit.metadata.setdefault("floor_bias", {})[UNSEEN_INFERENCE] = float(residuals.mean())
    return {"unseen": len(unseen), "seen": len(dense) - len(unseen), "residuals": residuals}


def moe_inference_error(fit, held_out_rows: list[dict], held_out_data) -> dict:
    """Set `fit.residual_sd[MOE_INFERENCE]`: the RMS log residual of the held-out inference
    rows of MoE models with more experts per layer than any fitted inference row
    (`beyond_fitted_experts`), one per row (`held_out_rows` / `held_out_data` as in
    `unseen_inference_error`).

    Also records their mean log residual in `fit.metadata["floor_bias"]`. Leaves `fit`
    unchanged when there is no such row. **Returns:** `{"held_out": n,
    "residuals": array}`.
    """
    by_id, ratio = _held_out_log_ratios(held_out_rows, held_out_data)
    held = [ratio[i] for i in ratio
            if beyond_fitted_experts(fit.inference_support, by_id[i].values["num_experts"])]
    residuals = np.array(held)
    if residuals.size:
        fit.residual_sd[MOE_INFERENCE] = float(np.sqrt(np.mean(residuals ** 2)))
        fit.metadata.setdefault("floor_bias", {})[MOE_INFERENCE] = float(residuals.mean())
    return {"held_out": len(held), "residuals": residuals}


def quantity_of(metric: str, batch: float | None = None) -> str:
    """The `QUANTITIES` key a measured column belongs to; a latency or TPOT measured at
    `batch` > 1 is a `throughput` measurement."""
    for q, cols in QUANTITIES.items():
        if metric in cols:
            return decode_quantity(batch) if q == "latency" and batch is not None else q
    raise ValueError(f"unknown measured column {metric!r}")


def decode_quantity(batch: float, output_len: float | None = None) -> str:
    """The quantity whose model error applies to an end-to-end latency, TPOT or throughput
    predicted at `batch` sequences: `latency` for batch 1, else `throughput`; `ttft` when
    `output_len` is 1 (no decode step: the end-to-end latency is the first-token latency)."""
    if output_len is not None and output_len <= 1:
        return "ttft"
    return "latency" if batch <= 1 else "throughput"


def measurements(preds: list[dict], parameter_sd: dict | None = None) -> list[dict]:
    """One entry per row and quantity: the columns of a row that measure one quantity (a NeMo
    row's tokens/s and model TFLOP/s) are one measurement, not two. Each entry has the row's
    `id`, `kind`, `source`, `quantity`, the mean log residual `r` = log(predicted / measured)
    of its cells and, given `{(id, metric): sd}`, their mean parameter sd `parameter_sd`."""
    groups: dict = {}
    for p in preds:
        quantity = quantity_of(p["metric"], p.get("batch"))
        if quantity == "step_time" and issues_from_host(p.get("runtime")):
            quantity = HOST_STEP_TIME
        key = (p["id"], quantity)
        g = groups.setdefault(key, {"id": p["id"], "kind": p["kind"], "source": p["source"],
                                    "quantity": key[1], "r": [], "parameter_sd": []})
        g["r"].append(math.log(p["predicted"] / p["measured"]))
        if parameter_sd is not None:
            g["parameter_sd"].append(parameter_sd.get((p["id"], p["metric"]), 0.0))
    return [{**g, "r": float(np.mean(g["r"])),
             "parameter_sd": float(np.mean(g["parameter_sd"])) if g["parameter_sd"] else 0.0}
            for g in groups.values()]


def residual_sds(preds: list[dict]) -> dict:
    """RMS log residual log(predicted / measured) per quantity (`QUANTITIES`; `HOST_STEP_TIME`
    for runs of a host-issuing runtime), per kind ("train", "infer") and over everything
    ("all", both without the `HOST_STEP_TIME` runs), one residual per measurement
    (`measurements`), from prediction cells as `_results.predictions_table` makes them
    (in-sample or cross-validated)."""
    groups: dict = {}
    for m in measurements(preds):
        keys = ((m["quantity"],) if m["quantity"] == HOST_STEP_TIME
                else (m["quantity"], m["kind"], "all"))
        for key in keys:
            groups.setdefault(key, []).append(m["r"])
    return {k: float(np.sqrt(np.mean(np.square(v)))) for k, v in groups.items()}


def model_error_sd(residual_sd: dict, quantity: str | None = None,
                   kind: str | None = None, floors: tuple[str, ...] = ()) -> float:
    """The model error that applies to a prediction: that of its quantity (`MOE_STEP_TIME`
    falls back to `"step_time"`), else of its kind, else the overall one (0 when the fit
    recorded none); at least each error named in `floors` that the fit has (an inference
    prediction's `inference_floors`)."""
    key = governing_error(residual_sd, quantity, kind, floors)
    return 0.0 if key is None else float(residual_sd[key])


def governing_error(residual_sd: dict, quantity: str | None = None, kind: str | None = None,
                    floors: tuple[str, ...] = ()) -> str | None:
    """The key of `residual_sd` whose error `model_error_sd` returns: the largest of the
    quantity's (or its fallback's) and the floors' present in the fit (None: no error)."""
    keys = [k for k in (_error_key(residual_sd, quantity, kind), *floors)
            if k is not None and k in residual_sd]
    return max(keys, key=lambda k: residual_sd[k]) if keys else None


def _error_key(residual_sd: dict, quantity: str | None, kind: str | None) -> str | None:
    """The key of `residual_sd` whose model error applies (see `model_error_sd`), or None."""
    fallback = "step_time" if quantity in (MOE_STEP_TIME, HOST_STEP_TIME) else None
    return next((k for k in (quantity, fallback, kind, "all")
                 if k is not None and k in residual_sd), None)


def require_measured_kind(residual_sd: dict, kind: str | None) -> None:
    """Raise a ValueError when the fit recorded model errors but none of `kind` ("train" /
    "infer"): it saw no measurement of that kind, so an interval would borrow the other kind's
    error (e.g. a training-only fit's ~1 % for an inference latency)."""
    # The MoE step error (`MOE_STEP_TIME`) and the unseen-inference and MoE-inference errors
    # are measured on held-out rows, not only fitted ones, so they do not show that the fit saw
    # rows of their kind.
    of_kind = {"train": ("train", "step_time"),
               "infer": ("infer", "latency", "throughput", "ttft")}.get(kind, (kind,))
    if kind is not None and residual_sd and not any(k in residual_sd for k in of_kind):
        raise ValueError(f"the fit has no {kind} measurements, so no model error for "
                         f"{kind} predictions (fit {kind} rows too)")


def use_cross_validated_error(fit, cv_predictions: list[dict], cv_kind: str) -> None:
    """Make `fit`'s prediction intervals use the model error measured by cross-validation
    (`residual_sds` of the held-out predictions) instead of the in-sample one. Only for CV
    kinds that hold out every row ("source", "kfold")."""
    if cv_kind not in ("source", "kfold"):
        raise ValueError(f"cross-validation {cv_kind!r} does not hold out every row")
    fit.residual_sd = residual_sds(cv_predictions)
    fit.metadata["residual_sd_basis"] = f"cross-validated ({cv_kind})"


def cell_parameter_sd(problem, theta, covariance) -> tuple[np.ndarray, np.ndarray]:
    """Parameter part of the log-prediction standard deviation, sqrt(g^T cov g), of every
    train [Rt, 3] and infer [Ri, 4] cell of `problem` at `theta` (forward-mode Jacobian of
    the batched model, one pass per parameter)."""
    w_t, w_i = (jnp.asarray(w) for w in problem.base_weights())
    lp = lambda th: problem.loss(th, w_t, w_i)[1][:2]
    j_t, j_i = jax.jit(jax.jacfwd(lp))(jnp.asarray(theta))
    cov = np.asarray(covariance)
    sd = lambda j: np.sqrt(np.maximum(np.einsum("...p,pq,...q->...", np.asarray(j), cov,
                                                np.asarray(j)), 0.0))
    return sd(j_t), sd(j_i)


def interval_coverage(preds: list[dict], residual_sd: dict, level: float = 0.9,
                      parameter_sd: dict | None = None) -> dict:
    """How often the `level` prediction interval contains the measured value, per measurement
    (`measurements`).

    `preds`: prediction cells (use held-out ones: `diffperf.calibrate.cross_validate`);
    `residual_sd`: the model error per quantity (`residual_sds`); `parameter_sd`: optional
    `{(id, metric): sqrt(g^T cov g)}` added in quadrature.

    Two scores: `inside` uses `residual_sd` as given; `inside_other_sources` re-estimates
    each measurement's model error from the residuals in `preds` of the *other* sources'
    measurements of its quantity (the honest test for a new table: its own errors do not set
    its interval), and is None where no other source measures that quantity.

    **Returns** `{group: {"n", "inside", "n_other_sources", "inside_other_sources",
    "half_width_pct"}}` (fractions; mean half-width in percent of the prediction) for every
    quantity, kind, `"source:<name>"` and "all"."""
    z = NormalDist().inv_cdf(0.5 + level / 2.0)
    meas = measurements(preds, parameter_sd)
    by_quantity: dict = {}
    for m in meas:
        by_quantity.setdefault(m["quantity"], []).append(m)
    groups: dict = {}
    for m in meas:
        sd = math.hypot(model_error_sd(residual_sd, m["quantity"], m["kind"]),
                        m["parameter_sd"])
        others = [o["r"] for o in by_quantity[m["quantity"]] if o["source"] != m["source"]]
        inside_other = None
        if others:
            sd_other = math.hypot(float(np.sqrt(np.mean(np.square(others)))), m["parameter_sd"])
            inside_other = abs(m["r"]) <= z * sd_other
        width = (math.exp(z * sd) - math.exp(-z * sd)) / 2.0 * 100.0
        for key in (m["quantity"], m["kind"], "source:" + m["source"], "all"):
            g = groups.setdefault(key, {"n": 0, "in": 0, "n_o": 0, "in_o": 0, "w": 0.0})
            g["n"] += 1
            g["in"] += abs(m["r"]) <= z * sd
            g["w"] += width
            if inside_other is not None:
                g["n_o"] += 1
                g["in_o"] += inside_other
    return {k: {"n": g["n"], "inside": g["in"] / g["n"], "n_other_sources": g["n_o"],
                "inside_other_sources": g["in_o"] / g["n_o"] if g["n_o"] else None,
                "half_width_pct": g["w"] / g["n"]}
            for k, g in groups.items()}


def hessian(problem, theta, w_t, w_i, method: str = "fd") -> np.ndarray:
    """Hessian of the loss at `theta`: `"autodiff"` = `jax.hessian` (exact, but compiles the
    model a second time, forward-over-reverse: slow on 2 CPU cores); `"fd"` (default) = central
    differences of the exact autodiff gradient, reusing the compiled loss (relative error
    ~1e-8 in float64)."""
    if method == "autodiff":
        f = lambda th: problem.loss(th, jnp.asarray(w_t), jnp.asarray(w_i))[0]
        return np.asarray(jax.jit(jax.hessian(f))(jnp.asarray(theta)))
    if method != "fd":
        raise ValueError(f"unknown Hessian method {method!r}")
    theta = np.asarray(theta, dtype=np.float64)
    p = theta.size
    cols = []
    for j in range(p):
        h = 1e-5 * max(1.0, abs(theta[j]))
        tp, tm = theta.copy(), theta.copy()
        tp[j] += h
        tm[j] -= h
        _, gp = problem.vg(tp[None], w_t[None], w_i[None])
        _, gm = problem.vg(tm[None], w_t[None], w_i[None])
        cols.append((np.asarray(gp[0]) - np.asarray(gm[0])) / (2 * h))
    return np.stack(cols, axis=1)


def laplace(problem, theta, w_t, w_i, method: str = "fd") -> np.ndarray:
    """Covariance of the unconstrained parameters at the optimum `theta` (see module doc)."""
    w_t, w_i = np.asarray(w_t), np.asarray(w_i)
    hess = hessian(problem, theta, w_t, w_i, method)
    theta = jnp.asarray(theta)
    hess = 0.5 * (hess + hess.T)
    (val, aux), _ = problem.vg(theta[None], w_t[None], w_i[None])
    lp_t, lp_i = np.asarray(aux[0][0]), np.asarray(aux[1][0])
    r2 = (np.sum(np.asarray(w_t) * (lp_t - problem.ds.y_train) ** 2)
          + np.sum(np.asarray(w_i) * (lp_i - problem.ds.y_infer) ** 2))
    n = float(np.sum(np.asarray(w_t)) + np.sum(np.asarray(w_i)))
    p = theta.shape[0]
    s2 = r2 / max(n - p, 1.0)
    evals, evecs = np.linalg.eigh(hess)
    evals = np.maximum(evals, 1e-12 * max(evals.max(), 1e-30))
    hinv = (evecs / evals) @ evecs.T
    return 2.0 * s2 / n * hinv


@dataclass
class PredictionInterval:
    """A prediction with its interval (same units as the prediction)."""

    value: float
    low: float
    high: float
    level: float
    log_sd: float  # standard deviation of log(prediction)

    def format(self, unit: str = "s", digits: int = 3) -> str:
        """E.g. `12.9 s (90% interval 12.1 to 13.8 s)`; `digits` significant digits, and whole
        numbers where those would need an exponent (1050 ms, not 1.05e+03 ms)."""
        def f(x):
            text = f"{x:.{digits}g}"
            return f"{x:.0f}" if "e+" in text else text
        u = f" {unit}" if unit else ""
        return (f"{f(self.value)}{u} ({self.level * 100:.0f}% interval {f(self.low)} to "
                f"{f(self.high)}{u})")

    __str__ = format


@dataclass
class FitUncertainty:
    """What a prediction interval needs from a fit: parameterisation, optimum, covariance."""

    par: object
    theta: np.ndarray
    covariance: np.ndarray
    residual_sd: dict
    #: GPUs, GEMM precisions and largest expert count of the fitted inference rows
    #: (`inference_support`; None when the fit did not record them).
    inference_support: dict | None = None
    #: Mean log residual log(predicted / measured) of the held-out rows behind each floor
    #: error (`metadata.floor_bias`; > 0: those runs were predicted too fast).
    floor_bias: dict | None = None
    #: False when the fit's optimiser stopped before converging (`metadata.converged`): its
    #: covariance is not that of an optimum, so intervals are refused.
    converged: bool = True


def require_converged(u: FitUncertainty) -> None:
    """A ValueError when the fit's optimiser stopped before converging: its covariance is not
    that of an optimum, so its intervals would not mean anything."""
    if not u.converged:
        raise ValueError("the fit did not converge (its metadata.converged is false): its "
                         "covariance is not that of an optimum, so no interval; refit with "
                         "more steps (--lbfgs-steps)")


def load_uncertainty(fit=None) -> FitUncertainty:
    """From a `Fit`, a fitted JSON path, or None (the shipped `presets/efficiency.json`)."""
    if isinstance(fit, FitUncertainty):
        return fit
    if isinstance(fit, Fit):
        if fit.covariance is None:
            raise ValueError("this fit has no covariance (calibrate(..., uncertainty=True))")
        return FitUncertainty(fit.par, np.asarray(fit.theta), np.asarray(fit.covariance),
                              dict(fit.residual_sd), fit.inference_support,
                              _checked_bias(fit.metadata.get("floor_bias")),
                              fit.metadata.get("converged") is not False)
    if fit is None:
        data, where = _default_efficiency_data(), "diffperf/presets/efficiency.json"
    else:
        data, where = read_json(fit, "efficiency file"), str(fit)
    unc = data.get("uncertainty") if isinstance(data, dict) else None
    if unc is None or (isinstance(unc, dict) and not unc):
        raise ValueError(f"{where} has no uncertainty section (refit it with diffperf "
                         f"calibrate, without --no-uncertainty)")
    u = _checked_uncertainty(unc, where)
    meta = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    u.floor_bias = _checked_bias(meta.get("floor_bias"))
    u.converged = meta.get("converged") is not False
    return u


def _checked_bias(bias) -> dict | None:
    """`metadata.floor_bias` as {key: finite float}; anything else is ignored (it only words
    the interval notes)."""
    if not isinstance(bias, dict):
        return None
    return {k: float(v) for k, v in bias.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _checked_uncertainty(unc, where: str) -> FitUncertainty:
    """A `FitUncertainty` from a fitted file's "uncertainty" section, or a ValueError naming
    the file and the bad key: a parameterisation with the fitted layout, a finite theta of
    that length, a finite square covariance of that size with a non-negative diagonal, and
    finite non-negative model errors."""
    if not isinstance(unc, dict):
        raise ValueError(f"{where}: 'uncertainty' must be an object, got {type(unc).__name__}")
    for key in ("parameterisation", "theta", "covariance"):
        if key not in unc:
            raise ValueError(f"{where}: 'uncertainty' lacks {key!r} (write it with diffperf "
                             f"calibrate)")
    try:
        par = Parameterisation.from_json(unc["parameterisation"])
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"{where}: 'uncertainty.parameterisation' is malformed "
                         f"({type(e).__name__}: {e})") from None
    n = par.size

    def array(key, ndim):
        try:
            a = np.asarray(unc[key], dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: 'uncertainty.{key}' must be numbers") from None
        shape = (n,) * ndim
        if a.shape != shape:
            raise ValueError(f"{where}: 'uncertainty.{key}' has shape {a.shape}; the "
                             f"parameterisation has {n} parameters, so {shape} is expected")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{where}: 'uncertainty.{key}' contains NaN or infinite values")
        return a

    theta, cov = array("theta", 1), array("covariance", 2)
    if np.any(np.diag(cov) < 0):
        i = int(np.argmin(np.diag(cov)))
        raise ValueError(f"{where}: 'uncertainty.covariance' has a negative variance "
                         f"{np.diag(cov)[i]:g} for {par.names()[i]!r}")
    sd = unc.get("residual_sd", {})
    if not isinstance(sd, dict):
        raise ValueError(f"{where}: 'uncertainty.residual_sd' must be an object")
    for k, v in sd.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}: 'uncertainty.residual_sd.{k}' must be a finite "
                             f"number >= 0, got {v!r}")
    return FitUncertainty(par, theta, cov, {k: float(v) for k, v in sd.items()},
                          _checked_support(unc.get("inference_support"), where))


def _checked_support(support, where: str) -> dict | None:
    """A fitted file's `uncertainty.inference_support` (None when absent), or a ValueError
    naming the file and the bad key: GPU id strings and precision codes 0-3."""
    if support is None:
        return None
    count = lambda x: (isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
                       and math.isfinite(x) and x == round(x))
    ok = (isinstance(support, dict)
          and isinstance(support.get("gpus"), list)
          and all(isinstance(g, str) for g in support["gpus"])
          and isinstance(support.get("precisions"), list)
          and all(count(p) and 0 <= p <= 3 for p in support["precisions"])
          and count(support.get("max_experts", 1)) and support.get("max_experts", 1) >= 1)
    if not ok:
        raise ValueError(f"{where}: 'uncertainty.inference_support' must be "
                         f"{{\"gpus\": [GPU ids], \"precisions\": [codes 0-3], "
                         f"\"max_experts\": n >= 1}}, got {support!r}")
    return {"gpus": list(support["gpus"]), "precisions": [int(p) for p in support["precisions"]],
            "max_experts": int(support.get("max_experts", 1))}


def prediction_interval(fn_of_efficiency: Callable, fit=None, level: float = 0.9,
                        gpu: str | None = None, kind: str | None = None,
                        model_error: bool = True,
                        quantity: str | None = None,
                        floors: tuple[str, ...] = ()) -> PredictionInterval:
    """Delta-method interval of a positive prediction `fn_of_efficiency(eff)`.

    **Arguments:**

    - `fn_of_efficiency`: pure JAX function of an `Efficiency` returning a positive scalar,
      e.g. `lambda e: dp.train_step(m, s, p, e).step_time`.
    - `fit`: a `Fit`, a fitted JSON path, or None (the shipped calibration).
    - `level`: two-sided coverage (0.9 = 90 %).
    - `gpu`: GPU id whose per-GPU factors apply (None: shared factors).
    - `kind`: `"train"` or `"infer"`: which model error to add when the fit has none for
      `quantity` (None: the overall one).
    - `model_error`: add the fit's RMS log residual (the model's own error, not only the
      parameter uncertainty). Without it the interval is a confidence interval of the model.
    - `quantity`: what `fn_of_efficiency` predicts (a `QUANTITIES` key: `"step_time"`,
      `"latency"` (batch 1), `"throughput"` (batched runs; see `decode_quantity`), `"ttft"`;
      or `MOE_STEP_TIME` / `HOST_STEP_TIME`: see `training_quantity`), which selects the
      model error of that quantity.
    - `floors`: model errors the interval is at least as wide as (an inference prediction's
      `inference_floors`: outside the fit's inference data, a MoE model).

    **Returns:** a `PredictionInterval` (`str()` gives "12.9 s (90% interval 12.1 to 13.8 s)").
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if quantity is not None and quantity not in (*QUANTITIES, MOE_STEP_TIME, HOST_STEP_TIME):
        raise ValueError(f"unknown quantity {quantity!r} (one of {', '.join(QUANTITIES)}, "
                         f"{MOE_STEP_TIME}, {HOST_STEP_TIME})")
    u = load_uncertainty(fit)
    require_converged(u)
    if model_error:
        require_measured_kind(u.residual_sd, kind)
    theta = jnp.asarray(u.theta, dtype=jnp.result_type(float))
    fitted = None if gpu is None else fitted_gpu(gpu, u.par.groups)  # H800: H100's offsets
    logf = lambda th: jnp.log(fn_of_efficiency(u.par.efficiency(th, fitted)))
    value, g = jax.value_and_grad(logf)(theta)
    value, g = float(value), np.asarray(g, dtype=np.float64)
    var = float(g @ u.covariance @ g)
    if not (math.isfinite(value) and math.isfinite(var)):
        raise ValueError("the prediction or its variance is not finite; no interval")
    error = model_error_sd(u.residual_sd, quantity, kind, floors) if model_error else 0.0
    low, high, sd = _bounds(np.array([value]), np.array([var]), np.array([error]), level)
    if not np.isfinite(low[0]):
        z = NormalDist().inv_cdf(0.5 + level / 2.0)
        raise ValueError(f"the log-prediction's standard deviation is {sd[0]:.3g}, too wide "
                         f"for a meaningful interval (a factor of e^{2 * z * sd[0]:.3g}); the "
                         f"fit's covariance is degenerate or it did not converge")
    return PredictionInterval(math.exp(value), float(low[0]), float(high[0]), level,
                              float(sd[0]))


def _bounds(log_value: np.ndarray, parameter_var: np.ndarray, model_error: np.ndarray,
            level: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(low, high, sd)` of log-normal intervals: sd^2 = parameter variance + model error^2;
    low / high NaN where z * sd exceeds `MAX_LOG_HALF_WIDTH` or anything is not finite."""
    z = NormalDist().inv_cdf(0.5 + level / 2.0)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow only where not `ok`
        sd = np.sqrt(np.maximum(parameter_var, 0.0) + model_error ** 2)
        ok = np.isfinite(log_value) & np.isfinite(sd) & (z * sd <= MAX_LOG_HALF_WIDTH)
        low = np.where(ok, np.exp(log_value - z * sd), np.nan)
        high = np.where(ok, np.exp(log_value + z * sd), np.nan)
    return low, high, sd


def row_intervals(predict_rows: Callable, gpus: list[str], quantities: list[str], kind: str,
                  fit=None, level: float = 0.9, precisions: list | None = None,
                  num_experts: list | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`prediction_interval` for many configurations at once: one forward-mode Jacobian of a
    batched prediction instead of one compiled gradient per configuration.

    - `predict_rows`: pure JAX function of a stacked `Efficiency` (one entry per row, each row
      with its GPU's factors) returning the `[R]` positive predictions, e.g. a vmapped
      `train_step(...).step_time`.
    - `gpus`, `quantities`: each row's GPU id and `QUANTITIES` key (its model error).
    - `kind`, `fit`, `level`: as in `prediction_interval`.
    - `precisions`, `num_experts`: each inference row's GEMM input precision (name or code)
      and experts per MoE layer, which set its `inference_floors`. None: no floors (training).

    **Returns:** `(value, low, high, keys)`: arrays, low / high NaN for a row whose interval
    would be wider than `MAX_LOG_HALF_WIDTH` or not finite (no interval, never a silent one),
    and each row's `governing_error` key (the model error that set its width).
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    u = load_uncertainty(fit)
    require_converged(u)
    require_measured_kind(u.residual_sd, kind)
    par = u.par
    fitted = [fitted_gpu(g, par.groups) for g in gpus]  # H800: H100's offsets
    group = jnp.asarray([-1 if f is None else par.groups.index(f) for f in fitted])
    logf = lambda th: jnp.log(predict_rows(par.row_efficiency(th, group)))  # noqa: E731
    theta = jnp.asarray(u.theta, dtype=jnp.result_type(float))
    value, jac = jax.jit(lambda th: (logf(th), jax.jacfwd(logf)(th)))(theta)
    value, jac = np.asarray(value, dtype=np.float64), np.asarray(jac, dtype=np.float64)
    var = np.einsum("rp,pq,rq->r", jac, u.covariance, jac)
    floors = ([()] * len(gpus) if precisions is None else
              [inference_floors(u.inference_support, g, p, e)
               for g, p, e in zip(gpus, precisions, num_experts or [1] * len(gpus))])
    keys = [governing_error(u.residual_sd, q, kind, f) for q, f in zip(quantities, floors)]
    error = np.array([0.0 if k is None else u.residual_sd[k] for k in keys])
    low, high, _ = _bounds(value, var, error, level)
    return np.exp(value), low, high, keys


def interval_summary(fn_of_efficiency: Callable, efficiency_path, gpu: str | None, kind: str,
                     quantity: str, unit: str = "s", scale: float = 1.0,
                     precision=None, num_experts=1, hypothetical: bool = False) -> dict:
    """The CLIs' `--interval` entry: `prediction_interval` at 90 % of `fn_of_efficiency` (in
    s) as `{"level", "low", "high", "quantity", "text"}` (text in `unit` = s / `scale`), or
    `{"error"}` when the efficiency file carries no usable uncertainty (none, malformed, or so
    wide that no interval is meaningful). `precision`, `num_experts`: an inference
    prediction's GEMM input precision and experts per MoE layer (its `inference_floors`);
    `hypothetical`: what-if hardware (`--set`), outside every fitted measurement, so an
    inference prediction also takes the `UNSEEN_INFERENCE` floor."""
    try:
        u = load_uncertainty(efficiency_path)
        floors = (inference_floors(u.inference_support, gpu, precision, num_experts)
                  if kind == "infer" else ())
        if kind == "infer" and hypothetical and UNSEEN_INFERENCE not in floors:
            floors = (UNSEEN_INFERENCE,) + floors
        iv = prediction_interval(lambda e: fn_of_efficiency(e) * scale, u, 0.9,
                                 gpu, kind, quantity=quantity, floors=floors)
    except ValueError as e:
        return {"error": str(e)}
    out = {"level": iv.level, "low": iv.low / scale, "high": iv.high / scale,
           "quantity": quantity, "text": iv.format(unit, 3)}
    caveats = interval_caveats(u, gpu, kind, quantity, floors, precision, num_experts,
                               hypothetical)
    if caveats:
        out["note"] = "; ".join(caveats)
    return out


def interval_caveats(u: FitUncertainty, gpu: str | None, kind: str | None,
                     quantity: str | None, floors: tuple[str, ...] = (),
                     precision=None, num_experts=1, hypothetical: bool = False) -> list[str]:
    """What an interval rests on beyond its fit's data: a GPU the fit had no measurements of
    (shared factors, and the calibrated GPUs' model error, are assumed to carry over), an
    inference prediction outside the fit's inference data (`floors`: the wider error that sets
    the interval, and why), a MoE model beyond the fitted ones whose error the fit did not
    measure, or a quantity whose own model error the fit did not record (a broader one is
    used)."""
    notes = []
    sd = u.residual_sd
    if gpu is not None and u.par.groups and fitted_gpu(gpu, u.par.groups) is None:
        notes.append(f"no calibration data for {system_gpu(gpu)}: the shared factors and the "
                     f"model error on {', '.join(u.par.groups)} are assumed to carry over")
    floor = governing_error(sd, quantity, kind, floors)
    if floor in floors and sd[floor] > model_error_sd(sd, quantity, kind):
        bias = (u.floor_bias or {}).get(floor)
        direction = ("" if bias is None else
                     f"; those runs were predicted {bias_text(bias)} on average (geometric "
                     f"mean)")
        if floor == MOE_INFERENCE:
            most = (u.inference_support or {}).get("max_experts", 1)
            fitted = (f"more experts per layer than any fitted inference row ({most})"
                      if most > 1 else "experts, and no fitted inference row is of a MoE model")
            notes.append(f"a MoE model with {fitted}: the interval uses the model error of "
                         f"held-out fine-grained MoE inference runs ({sd[floor]:.1%}, RMS log)"
                         f"{direction}; router, token permutation and small expert GEMMs "
                         f"cost more than modelled")
        else:
            why = _unseen_reason(u, gpu, precision, hypothetical)
            notes.append(f"{why}: the interval uses the model error of held-out inference rows "
                         f"outside the fit's data ({sd[floor]:.1%}, RMS log){direction}")
    moe_beyond = (MOE_INFERENCE in floors if u.inference_support
                  else float(np.max(np.asarray(num_experts))) > 8)
    if kind == "infer" and moe_beyond and MOE_INFERENCE not in sd:
        notes.append("no inference measurement of a MoE model with this many experts is in the "
                     "calibration, so the real error may be larger than the interval's")
    key = _error_key(sd, quantity, kind)
    fallback = "step_time" if quantity in (MOE_STEP_TIME, HOST_STEP_TIME) else None
    if quantity is not None and key is not None and key not in (quantity, fallback):
        notes.append(f"this fit has no model error for {quantity}: the {key} one "
                     f"({sd[key]:.1%}) is used")
    return notes


def bias_text(mean_log: float) -> str:
    """A mean log residual log(predicted / measured) in words: "18% too fast", "2.0x too
    fast", "10% too slow"."""
    ratio = math.exp(abs(mean_log))
    size = f"{ratio:.1f}x" if ratio >= 1.5 else f"{ratio - 1:.0%}"
    return f"{size} too {'fast' if mean_log > 0 else 'slow'}"


def _unseen_reason(u: FitUncertainty, gpu: str | None, precision,
                   hypothetical: bool = False) -> str:
    """Why an inference prediction lies outside the fit's inference data, e.g. "the fit has no
    inference measurement on b200 or at fp4 GEMM precision"."""
    if hypothetical:
        return "what-if hardware (--set) lies outside every fitted measurement"
    new_gpu, new_precision = _unseen_axes(u.inference_support, gpu, precision)
    reasons = [f"on {system_gpu(gpu)}"] * new_gpu + [
        f"at {PRECISION_CLASS_NAMES[_precision_class(precision)]} GEMM precision"] * new_precision
    return f"the fit has no inference measurement {' or '.join(reasons) or 'like this one'}"
