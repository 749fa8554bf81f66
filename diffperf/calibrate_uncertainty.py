"""Uncertainty of a calibration: Laplace approximation and delta-method prediction intervals.

Convention. The loss is `L(theta) = (1/N) sum_i r_i^2 + prior(theta)` with `r_i` the log ratio
of predicted to measured over the N fitted cells. Reading `exp(-N L / (2 s^2))` as the
posterior of `theta` (Gaussian log residuals of variance `s^2`, the prior in the same units),
the Laplace approximation at the optimum is Gaussian with

    cov(theta) = (N / (2 s^2) * H)^-1 = 2 s^2 / N * H^-1,    H = d^2 L / d theta^2 (see `hessian`),

and `s^2 = sum r_i^2 / max(N - P, 1)` (P = len(theta)). This treats the cells as independent,
which they are not (two columns of one row, one systematic model error across a table), so the
parameter covariance is optimistic; the prediction interval therefore also adds the model error
`residual_sd` (RMS in-sample log residual of the row's kind) by default:

    var(log f) = g^T cov g + residual_sd^2,    g = d log f(eff(theta)) / d theta,
    interval = f * exp(+-z sd),  z = Phi^-1((1 + level) / 2).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Callable

import numpy as np


def hessian(problem, theta, w_t, w_i, method: str = "fd") -> np.ndarray:
    """Hessian of the loss at `theta`: `"autodiff"` = `jax.hessian` (exact, but compiles the
    model a second time, forward-over-reverse: slow on 2 CPU cores); `"fd"` (default) = central
    differences of the exact autodiff gradient, reusing the compiled loss (relative error
    ~1e-8 in float64)."""
    import jax
    import jax.numpy as jnp
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
    import jax.numpy as jnp
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
        """E.g. `12.9 s (90% interval 12.1 to 13.8 s)`."""
        f = lambda x: f"{x:.{digits}g}"
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


def load_uncertainty(fit=None) -> FitUncertainty:
    """From a `Fit`, a fitted JSON path, or None (the shipped `presets/efficiency.json`)."""
    from .calibrate import Fit, Parameterisation
    if isinstance(fit, FitUncertainty):
        return fit
    if isinstance(fit, Fit):
        if fit.covariance is None:
            raise ValueError("this fit has no covariance (calibrate(..., uncertainty=True))")
        return FitUncertainty(fit.par, np.asarray(fit.theta), np.asarray(fit.covariance),
                              dict(fit.residual_sd))
    if fit is None:
        from importlib import resources
        text = resources.files("diffperf.presets").joinpath("efficiency.json").read_text()
        data, where = json.loads(text), "diffperf/presets/efficiency.json"
    else:
        where = str(fit)
        try:
            data = json.loads(Path(fit).read_text())
        except FileNotFoundError:
            raise ValueError(f"efficiency file {where} does not exist") from None
    unc = data.get("uncertainty") or {}
    if "covariance" not in unc or "parameterisation" not in unc:
        raise ValueError(f"{where} has no uncertainty section (write it with diffperf calibrate)")
    return FitUncertainty(Parameterisation.from_json(unc["parameterisation"]),
                          np.asarray(unc["theta"], dtype=np.float64),
                          np.asarray(unc["covariance"], dtype=np.float64),
                          dict(unc.get("residual_sd", {})))


def prediction_interval(fn_of_efficiency: Callable, fit=None, level: float = 0.9,
                        gpu: str | None = None, kind: str | None = None,
                        model_error: bool = True) -> PredictionInterval:
    """Delta-method interval of a positive prediction `fn_of_efficiency(eff)`.

    **Arguments:**

    - `fn_of_efficiency`: pure JAX function of an `Efficiency` returning a positive scalar,
      e.g. `lambda e: dp.train_step(m, s, p, e).step_time`.
    - `fit`: a `Fit`, a fitted JSON path, or None (the shipped calibration).
    - `level`: two-sided coverage (0.9 = 90 %).
    - `gpu`: GPU id whose per-GPU factors apply (None: shared factors).
    - `kind`: `"train"` or `"infer"`: which model error to add (None: the overall one).
    - `model_error`: add the fit's RMS log residual (the model's own error, not only the
      parameter uncertainty). Without it the interval is a confidence interval of the model.

    **Returns:** a `PredictionInterval` (`str()` gives "12.9 s (90% interval 12.1 to 13.8 s)").
    """
    import jax
    import jax.numpy as jnp
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    u = load_uncertainty(fit)
    theta = jnp.asarray(u.theta, dtype=jnp.result_type(float))
    logf = lambda th: jnp.log(fn_of_efficiency(u.par.efficiency(th, gpu)))
    value, g = jax.value_and_grad(logf)(theta)
    value, g = float(value), np.asarray(g, dtype=np.float64)
    var = float(g @ u.covariance @ g)
    if model_error:
        sd_m = u.residual_sd.get(kind) if kind else None
        sd_m = u.residual_sd.get("all", 0.0) if sd_m is None else sd_m
        var += float(sd_m) ** 2
    sd = math.sqrt(max(var, 0.0))
    z = NormalDist().inv_cdf(0.5 + level / 2.0)
    v = math.exp(value)
    return PredictionInterval(v, v * math.exp(-z * sd), v * math.exp(z * sd), level, sd)


def interval_text(fn_of_efficiency: Callable, gpu: str | None, kind: str, unit: str = "s",
                  level: float = 0.9, efficiency_path=None, digits: int = 3) -> str | None:
    """For the CLI: "12.9 s (90% interval 12.1 to 13.8 s)", or None when the efficiency file
    (default: the shipped one) carries no uncertainty section."""
    try:
        return prediction_interval(fn_of_efficiency, efficiency_path, level, gpu, kind).format(
            unit, digits)
    except ValueError:
        return None
