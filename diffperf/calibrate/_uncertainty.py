"""Uncertainty of a calibration: Laplace approximation and prediction intervals.

Convention. The loss is `L(theta) = (1/N) sum_i r_i^2 + prior(theta)` with `r_i` the log ratio
of predicted to measured over the N fitted cells. Reading `exp(-N L / (2 s^2))` as the
posterior of `theta` (Gaussian log residuals of variance `s^2`, the prior in the same units),
the Laplace approximation at the optimum is Gaussian with

    cov(theta) = (N / (2 s^2) * H)^-1 = 2 s^2 / N * H^-1,    H = d^2 L / d theta^2 (see `hessian`),

and `s^2 = sum r_i^2 / max(N - P, 1)` (P = len(theta)). This treats the cells as independent,
which they are not, so the parameter covariance is optimistic; a prediction interval adds the
model error of the configuration predicted, from the fit's error model
(`_error_model.ErrorModel`: a log-scale regression on covariates that say how far the
configuration lies from the calibration data, with conformal quantiles):

    half-width (log) = sqrt((z sd_par)^2 + (q_a s(x))^2),   sd_par^2 = g^T cov g,
    g = d log f(eff(theta)) / d theta,   interval = f * exp(-+ half-width).

The error model is fitted on residuals of measurements the prediction did not see where the
fit has them: `diffperf calibrate` with cross-validation uses its held-out predictions (else its
in-sample residuals) and any held-out tables (`--moe-holdout`, `--infer-holdout`);
`calibration/refit.py` and `calibration/fit_error_model.py` the leave-one-source-out
residuals, the held-out tables and the serving simulator's errors under load. The residuals
already contain some parameter error, so adding `g^T cov g` is slightly conservative (about
1 % log sd for the median cell).
"""

from __future__ import annotations

import dataclasses
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
    fitted_gpu,
    runtime,
    system_gpu,
)
from ..validation._data import TRAIN_TIME_METRICS
from ._error_model import COVARIATES, QUANTITY_KINDS, Descriptor, ErrorModel, covariates
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


#: File names of the held-out tables in `benchmarks_data/` (never fitted): MoE training runs,
#: and TensorRT-LLM 1.0's throughput tables; `diffperf calibrate` adds their residuals to the
#: error model's (`--moe-holdout`, `--infer-holdout`).
MOE_HOLDOUT = "train_moe_holdout.csv"
INFER_HOLDOUT = "infer_trtllm10_holdout.csv"


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
        key = (p["id"], quantity_of(p["metric"], p.get("batch")))
        g = groups.setdefault(key, {"id": p["id"], "kind": p["kind"], "source": p["source"],
                                    "quantity": key[1], "r": [], "parameter_sd": []})
        g["r"].append(math.log(p["predicted"] / p["measured"]))
        if parameter_sd is not None:
            g["parameter_sd"].append(parameter_sd.get((p["id"], p["metric"]), 0.0))
    return [{**g, "r": float(np.mean(g["r"])),
             "parameter_sd": float(np.mean(g["parameter_sd"])) if g["parameter_sd"] else 0.0}
            for g in groups.values()]


def residual_sds(preds: list[dict]) -> dict:
    """RMS log residual log(predicted / measured) per quantity (`QUANTITIES`), per kind
    ("train", "infer") and over everything ("all"), one residual per measurement
    (`measurements`), from prediction cells as `_results.predictions_table` makes them
    (in-sample or cross-validated): a summary of the fit (intervals use its error model)."""
    groups: dict = {}
    for m in measurements(preds):
        for key in (m["quantity"], m["kind"], "all"):
            groups.setdefault(key, []).append(m["r"])
    return {k: float(np.sqrt(np.mean(np.square(v)))) for k, v in groups.items()}


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
    #: What widens it beyond a calibrated configuration of its quantity (error model).
    reasons: tuple[str, ...] = ()

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
    """What a prediction interval needs from a fit: parameterisation, optimum, covariance, and
    the error model."""

    par: object
    theta: np.ndarray
    covariance: np.ndarray
    residual_sd: dict
    #: The model error of a configuration (`_error_model.ErrorModel`); None for a fit saved
    #: without one (intervals are then refused).
    error_model: ErrorModel | None = None
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


def require_error_model(u: FitUncertainty, kind: str | None = None) -> ErrorModel:
    """The fit's error model, or a ValueError when it has none, or no measurement of `kind`
    ("train" or "infer"; a served prediction is "infer")."""
    if u.error_model is None:
        raise ValueError("this fit has no error model (fitted on fewer than two measurements, "
                         "or saved by an older diffperf): refit it with diffperf calibrate")
    if kind is not None and kind not in u.error_model.support:
        raise ValueError(f"the fit has no {kind} measurements, so no model error for "
                         f"{kind} predictions (fit {kind} rows too)")
    return u.error_model


def load_uncertainty(fit=None) -> FitUncertainty:
    """From a `Fit`, a fitted JSON path, or None (the shipped `presets/efficiency.json`)."""
    if isinstance(fit, FitUncertainty):
        return fit
    if isinstance(fit, Fit):
        if fit.covariance is None:
            raise ValueError("this fit has no covariance (calibrate(..., uncertainty=True))")
        return FitUncertainty(fit.par, np.asarray(fit.theta), np.asarray(fit.covariance),
                              dict(fit.residual_sd), fit.error_model,
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
    if unc.get("error_model") is not None:
        u.error_model = ErrorModel.from_json(unc["error_model"],
                                             f"{where}: uncertainty.error_model")
    meta = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    u.converged = meta.get("converged") is not False
    return u


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
    return FitUncertainty(par, theta, cov, {k: float(v) for k, v in sd.items()})


def in_support(quantity: str) -> np.ndarray:
    """The covariates of a configuration of `quantity` inside the calibrated support (every
    novelty and regime covariate 0): what an interval without a `Descriptor` assumes."""
    if quantity not in QUANTITY_KINDS:
        raise ValueError(f"unknown quantity {quantity!r} (one of {', '.join(QUANTITY_KINDS)})")
    c = np.zeros(len(COVARIATES))
    c[COVARIATES.index(f"q:{quantity}")] = 1.0
    return c


def _model_half_width(model: ErrorModel, descriptor: Descriptor | None, quantity: str | None,
                      kind: str | None, level: float) -> tuple[float, tuple[str, ...]]:
    """(log half-width of the model error, reasons) of a configuration: from its descriptor,
    or of a calibrated configuration of its quantity (default: the kind's headline one)."""
    if descriptor is not None:
        return model.for_descriptor(descriptor, level), tuple(model.reasons(descriptor))
    q = quantity or {"train": "step_time", "infer": "throughput"}.get(kind or "train")
    return float(model.log_half_width(in_support(q), level)), ()


def prediction_interval(fn_of_efficiency: Callable, fit=None, level: float = 0.9,
                        gpu: str | None = None, kind: str | None = None,
                        model_error: bool = True,
                        quantity: str | None = None,
                        descriptor: Descriptor | None = None) -> PredictionInterval:
    """Delta-method interval of a positive prediction `fn_of_efficiency(eff)`, widened by the
    fit's error model.

    **Arguments:**

    - `fn_of_efficiency`: pure JAX function of an `Efficiency` returning a positive scalar,
      e.g. `lambda e: dp.train_step(m, s, p, e).step_time`.
    - `fit`: a `Fit`, a fitted JSON path, or None (the shipped calibration).
    - `level`: two-sided coverage (0.9 = 90 %).
    - `gpu`: GPU id whose per-GPU factors apply (None: shared factors).
    - `kind`: `"train"` or `"infer"` (the fit must have measurements of it).
    - `model_error`: add the model error (the model's own error, not only the parameter
      uncertainty). Without it the interval is a confidence interval of the model.
    - `descriptor`: the configuration predicted (`_error_model.descriptor` /
      `spec_descriptor`): the covariates the error model widens the interval by, and says why
      (`PredictionInterval.reasons`).
    - `quantity`: without a descriptor, what `fn_of_efficiency` predicts (an
      `_error_model.QUANTITY_KINDS` key: "step_time", "latency" (batch 1), "throughput"
      (batched runs; see `decode_quantity`), "ttft", ...): the interval is then that of a
      configuration inside the calibrated support.

    **Returns:** a `PredictionInterval` (`str()` gives "12.9 s (90% interval 12.1 to 13.8 s)").
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if quantity is not None and quantity not in QUANTITY_KINDS:
        raise ValueError(f"unknown quantity {quantity!r} (one of {', '.join(QUANTITY_KINDS)})")
    u = load_uncertainty(fit)
    require_converged(u)
    theta = jnp.asarray(u.theta, dtype=jnp.result_type(float))
    fitted = None if gpu is None else fitted_gpu(gpu, u.par.groups)  # H800: H100's offsets
    logf = lambda th: jnp.log(fn_of_efficiency(u.par.efficiency(th, fitted)))
    value, g = jax.value_and_grad(logf)(theta)
    value, g = float(value), np.asarray(g, dtype=np.float64)
    var = float(g @ u.covariance @ g)
    if not (math.isfinite(value) and math.isfinite(var)):
        raise ValueError("the prediction or its variance is not finite; no interval")
    z = NormalDist().inv_cdf(0.5 + level / 2.0)
    error, reasons = 0.0, ()
    if model_error:
        model = require_error_model(u, kind or (None if descriptor is None else
                                                QUANTITY_KINDS[descriptor.quantity]))
        half, reasons = _model_half_width(model, descriptor, quantity, kind, level)
        error = half / z  # as a normal sd, added in quadrature to the parameter part
    low, high, sd = _bounds(np.array([value]), np.array([var]), np.array([error]), level)
    if not np.isfinite(low[0]):
        raise ValueError(f"the log-prediction's standard deviation is {sd[0]:.3g}, too wide "
                         f"for a meaningful interval (a factor of e^{2 * z * sd[0]:.3g}); the "
                         f"fit's covariance is degenerate or it did not converge")
    return PredictionInterval(math.exp(value), float(low[0]), float(high[0]), level,
                              float(sd[0]), reasons)


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


def row_intervals(predict_rows: Callable, gpus: list[str], descriptors: list[Descriptor],
                  kind: str, fit=None, level: float = 0.9
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """`prediction_interval` for many configurations at once: one forward-mode Jacobian of a
    batched prediction instead of one compiled gradient per configuration.

    - `predict_rows`: pure JAX function of a stacked `Efficiency` (one entry per row, each row
      with its GPU's factors) returning the `[R]` positive predictions, e.g. a vmapped
      `train_step(...).step_time`.
    - `gpus`, `descriptors`: each row's GPU id and configuration (`_error_model.descriptor`).
    - `kind`, `fit`, `level`: as in `prediction_interval`.

    **Returns:** `(value, low, high, why)`: arrays, low / high NaN for a row whose interval
    would be wider than `MAX_LOG_HALF_WIDTH` or not finite (no interval, never a silent one),
    and what widens each row's interval (`ErrorModel.reasons`, "; "-joined; its quantity when
    nothing does).
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    u = load_uncertainty(fit)
    require_converged(u)
    model = require_error_model(u, kind)
    par = u.par
    fitted = [fitted_gpu(g, par.groups) for g in gpus]  # H800: H100's offsets
    group = jnp.asarray([-1 if f is None else par.groups.index(f) for f in fitted])
    logf = lambda th: jnp.log(predict_rows(par.row_efficiency(th, group)))  # noqa: E731
    theta = jnp.asarray(u.theta, dtype=jnp.result_type(float))
    value, jac = jax.jit(lambda th: (logf(th), jax.jacfwd(logf)(th)))(theta)
    value, jac = np.asarray(value, dtype=np.float64), np.asarray(jac, dtype=np.float64)
    var = np.einsum("rp,pq,rq->r", jac, u.covariance, jac)
    error, why = descriptor_errors(model, descriptors, level)
    low, high, _ = _bounds(value, var, error, level)
    return np.exp(value), low, high, why


def descriptor_errors(model: ErrorModel, descriptors: list[Descriptor],
                      level: float) -> tuple[np.ndarray, list[str]]:
    """Each configuration's model error as a normal sd (its log half-width / z) and what
    widens it ("; "-joined reasons, or its quantity when nothing does)."""
    z = NormalDist().inv_cdf(0.5 + level / 2.0)
    C = np.array([covariates(d, model.support) for d in descriptors]).reshape(
        len(descriptors), len(COVARIATES))
    error = model.log_half_width(C, level) / z  # one matrix product for every row
    why = ["; ".join(model.reasons(d, c=c)) or d.quantity for d, c in zip(descriptors, C)]
    return error, why


def interval_summary(fn_of_efficiency: Callable, efficiency_path, gpu: str | None, kind: str,
                     descriptor: Descriptor, unit: str = "s", scale: float = 1.0,
                     what_if_hardware: bool = False) -> dict:
    """The CLIs' `--interval` entry: `prediction_interval` at 90 % of `fn_of_efficiency` (in
    s) for the configuration `descriptor`, as `{"level", "low", "high", "quantity", "text",
    "why"}` (text in `unit` = s / `scale`; why: what widens it) with a `"note"` in words when
    something does or the GPU has no fitted factors, or `{"error"}` when the efficiency file
    carries no usable uncertainty (none, malformed, or so wide that no interval is
    meaningful). `what_if_hardware`: the hardware was changed (`--set`), which the error
    model counts as an unseen GPU."""
    try:
        u = load_uncertainty(efficiency_path)
        if what_if_hardware:
            descriptor = dataclasses.replace(descriptor, gpu="what-if hardware (--set)")
        iv = prediction_interval(lambda e: fn_of_efficiency(e) * scale, u, 0.9, gpu, kind,
                                 descriptor=descriptor)
    except ValueError as e:
        return {"error": str(e)}
    out = {"level": iv.level, "low": iv.low / scale, "high": iv.high / scale,
           "quantity": descriptor.quantity, "text": iv.format(unit, 3), "why": list(iv.reasons)}
    notes = []
    if iv.reasons:
        notes.append("the interval is wider than a calibrated configuration's: "
                     + "; ".join(iv.reasons))
    if gpu is not None and u.par.groups and fitted_gpu(gpu, u.par.groups) is None:
        notes.append(f"no calibration data for {system_gpu(gpu)}: the shared factors are "
                     f"assumed to carry over")
    if notes:
        out["note"] = "; ".join(notes)
    return out


def error_model_intervals(values: dict, descriptors: dict, fit=None,
                          level: float = 0.9) -> dict:
    """Intervals from the fit's error model alone (no parameter part: for predictions that are
    not a differentiable function of the fitted factors, such as the serving simulator's
    percentiles; the parameter part is ~1 % log sd, `calibration/report.md`).

    `values`: `{name: positive prediction}`; `descriptors`: `{name: Descriptor}` (the same
    names). **Returns** `{name: {"value", "low", "high"}, "level", "why": [...]}` (why: what
    widens the intervals, each reason once), or `{"error"}` when the fit has no error model
    or a prediction is not positive and finite."""
    try:
        u = load_uncertainty(fit)
        model = require_error_model(u, "infer")
        out: dict = {"level": level}
        why: list[str] = []
        for name, v in values.items():
            half = model.for_descriptor(descriptors[name], level)
            v = float(v)
            if not (math.isfinite(v) and v > 0 and half <= MAX_LOG_HALF_WIDTH):
                raise ValueError(f"no interval for {name}: prediction {v:g}")
            out[name] = {"value": v, "low": v * math.exp(-half), "high": v * math.exp(half)}
            why += [r for r in model.reasons(descriptors[name]) if r not in why]
    except ValueError as e:
        return {"error": str(e)}
    out["why"] = why
    return out
