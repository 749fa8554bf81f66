"""What a calibration produces: the `Fit` record (saved as `presets/efficiency.json`), the
per-cell prediction table and its MAPE summaries."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..specs._efficiency import Efficiency
from ..validation._data import INFER_METRICS, TRAIN_TIME_METRICS
from ._parameterisation import Parameterisation
from ._sources import source_of

#: The measured columns a calibration fits (every timing metric of the benchmark format).
TRAIN_COLUMNS, INFER_COLUMNS = TRAIN_TIME_METRICS, INFER_METRICS


@dataclass
class Fit:
    """A calibration: parameterisation, optimum, in-sample predictions and metadata."""

    par: Parameterisation
    theta: np.ndarray
    loss: float
    shared: dict
    per_gpu: dict
    predictions: list  # [{"id", "kind", "gpu", "source", "metric", "measured", "predicted", "ape"}]
    excluded: list
    metadata: dict
    covariance: np.ndarray | None = None
    residual_sd: dict = field(default_factory=dict)
    cv: dict = field(default_factory=dict)
    #: The error model of its prediction intervals (`_error_model.ErrorModel`).
    error_model: object = None
    #: The residuals it was fitted on (`_error_data.residual_records`; not saved) and the
    #: held-out rows among them by id.
    error_records: list = field(default_factory=list, repr=False, compare=False)
    held_out_rows: dict = field(default_factory=dict, repr=False, compare=False)
    #: The compiled `Problem` (reuse it for cross-validation; not saved).
    problem: object = field(default=None, repr=False, compare=False)

    def efficiency(self, gpu: str | None = None) -> Efficiency:
        """The fitted factors of GPU `gpu` (None: shared)."""
        return self.par.efficiency(np.asarray(self.theta), gpu)

    def to_json(self) -> dict:
        out = {"factors": self.shared, "per_gpu": self.per_gpu, "metadata": self.metadata}
        unc = {"parameterisation": self.par.to_json(), "theta": [float(x) for x in self.theta],
               "residual_sd": self.residual_sd,
               "convention": "Laplace: cov = 2 s^2 / N * H^-1 of the loss in theta; s^2 = "
                             "sum of squared log residuals / (N - P); residual_sd = RMS log "
                             "residual per quantity, kind and overall, from the residuals named "
                             "by metadata.residual_sd_basis (a summary); error_model = the model "
                             "error of a configuration (diffperf.calibrate._error_model), "
                             "fitted on the residuals named by metadata.error_model_basis"}
        if self.covariance is not None:
            unc["covariance"] = np.asarray(self.covariance).tolist()
        if self.error_model is not None:
            unc["error_model"] = self.error_model.to_json()
        out["uncertainty"] = unc
        if self.cv:
            out["crossval"] = self.cv
        return out

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def predictions_table(ds, lp_t, lp_i, w_t, w_i) -> list[dict]:
    """Per-cell predictions (exp of log predictions) for cells with weight > 0."""
    out = []
    for kind, rows, cols, lp, w in (("train", ds.train_rows, TRAIN_COLUMNS, lp_t, w_t),
                                    ("infer", ds.infer_rows, INFER_COLUMNS, lp_i, w_i)):
        lp, w = np.asarray(lp), np.asarray(w)
        for i, r in enumerate(rows):
            for j, c in enumerate(cols):
                if w[i, j] > 0:
                    meas = r.measured[c]
                    pred = float(np.exp(lp[i, j]))
                    cell = {"id": r.id, "kind": kind, "gpu": r.values["gpu"],
                            "source": source_of(r), "metric": c, "measured": meas,
                            "predicted": pred, "ape": abs(pred - meas) / meas * 100.0}
                    if kind == "infer":
                        cell["batch"] = float(r.values["batch"])
                    else:
                        cell["runtime"] = r.values.get("runtime")
                    out.append(cell)
    return out


def mape_summary(preds: list[dict], key: str | None = None) -> dict:
    """MAPE (percent) per metric, or per `key` value (e.g. 'gpu', 'source') and metric."""
    out: dict = {}
    for p in preds:
        k = p["metric"] if key is None else p[key]
        out.setdefault(k, []).append(p["ape"])
    return {k: {"n": len(v), "mape": float(np.mean(v)), "max_ape": float(np.max(v))}
            for k, v in sorted(out.items())}
