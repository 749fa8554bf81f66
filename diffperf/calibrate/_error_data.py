"""The residuals an error model is fitted on: one per measurement of a benchmark row, with the
configuration it measured and the calibration support its prediction saw.

A record is `{"id", "source", "kind", "quantity", "r", "fitted"}`: r = mean log(predicted /
measured) over the row's columns of one quantity (`_uncertainty.measurements`), `fitted` True
for a calibrated row (its prediction in-sample, or from the fit without its source when
cross-validated) and False for a held-out row the fit never saw.
"""

from __future__ import annotations

import numpy as np

from ._error_model import Descriptor, covariates, descriptor, fit_error_model, support_of
from ._sources import source_of
from ._uncertainty import issues_from_host, measurements, residual_sds


def row_descriptor(row, quantity: str) -> Descriptor:
    """The `Descriptor` of a `BenchmarkRow` predicted as `quantity`."""
    runtime = row.values.get("runtime") if row.kind == "train" else None
    return descriptor(row.values, quantity, runtime,
                      host_issuing=row.kind == "train" and issues_from_host(runtime))


def residual_records(predictions: list[dict], fitted: bool) -> list[dict]:
    """One record per (row, quantity) of prediction cells (`_results.predictions_table`, or
    `validate`'s rows with a `kind`): a training step is one quantity whatever its runtime or
    experts (the error model's covariates tell those apart)."""
    cells = [{**p, "runtime": None} for p in predictions]
    return [{"id": m["id"], "source": m["source"], "kind": m["kind"], "quantity": m["quantity"],
             "r": m["r"], "fitted": fitted} for m in measurements(cells)]


def covariate_table(records: list[dict], rows_by_id: dict, calibrated_rows,
                    leave_source_out: bool) -> dict:
    """Covariates of `records` (rows looked up in `rows_by_id`): a fitted record's novelty is
    measured against the support of the calibrated rows of the *other* sources when
    `leave_source_out` (its prediction came from the fit without its source), else against
    all of them, like a held-out record's. **Returns** `{"C", "r", "groups", "descriptors",
    "support"}` (groups: the source, with " (held out)" for a held-out record)."""
    described = [(source_of(row), row_descriptor(
        row, "step_time" if row.kind == "train" else "throughput")) for row in calibrated_rows]
    support = support_of(d for _, d in described)
    without: dict = {}
    C, r, groups, descriptors = [], [], [], []
    for rec in records:
        d = row_descriptor(rows_by_id[rec["id"]], rec["quantity"])
        sup = support
        if rec["fitted"] and leave_source_out:
            if rec["source"] not in without:
                without[rec["source"]] = support_of(
                    x for s, x in described if s != rec["source"])
            sup = without[rec["source"]]
        C.append(covariates(d, sup))
        r.append(float(rec["r"]))
        groups.append(rec["source"] + ("" if rec["fitted"] else " (held out)"))
        descriptors.append(d)
    return {"C": np.array(C).reshape(len(r), -1), "r": np.array(r),
            "groups": np.array(groups), "descriptors": descriptors, "support": support}


def refit_error_model(fit, leave_source_out: bool) -> None:
    """Fit `fit.error_model` to `fit.error_records` (the fitted rows' residuals and any held-out
    rows' added since), the support being the fitted rows'."""
    ds = fit.problem.ds
    calibrated = ds.train_rows + ds.infer_rows
    rows_by_id = {r.id: r for r in calibrated} | fit.held_out_rows
    fitted_ids = {p["id"] for p in fit.predictions}
    calibrated = [r for r in calibrated if r.id in fitted_ids]
    t = covariate_table(fit.error_records, rows_by_id, calibrated, leave_source_out)
    held = sum(not rec["fitted"] for rec in fit.error_records)
    basis = (f"{len(fit.error_records) - held} fitted measurements "
             f"({fit.metadata.get('residual_sd_basis', 'in-sample')})"
             + (f" and {held} held-out ones" if held else ""))
    try:
        fit.error_model = fit_error_model(t["C"], t["r"], t["groups"], t["support"],
                                          basis=basis)
    except ValueError:  # too few residuals: no interval from this fit, said when asked
        fit.error_model, basis = None, f"none: {basis} are too few"
    fit.metadata["error_model_basis"] = basis


def add_held_out(fit, validated_rows: list[dict], rows) -> int:
    """Add the residuals of held-out rows (`rows`: `BenchmarkRow`s the fit was not fitted to;
    `validated_rows`: `validate(...)["rows"]` of them with this fit) to `fit.error_records`
    and refit its error model. **Returns** how many measurements were added."""
    fitted_ids = {p["id"] for p in fit.predictions}
    by_id = {r.id: r for r in rows if r.id not in fitted_ids}
    cells = [{**v, "kind": by_id[v["id"]].kind, "source": source_of(by_id[v["id"]]),
              **({"batch": float(by_id[v["id"]].values["batch"])}
                 if by_id[v["id"]].kind == "infer" else {})}
             for v in validated_rows if v["id"] in by_id]
    records = residual_records(cells, fitted=False)
    fit.error_records = [*fit.error_records, *records]
    fit.held_out_rows = {**fit.held_out_rows, **by_id}
    refit_error_model(fit, fit.metadata.get("residual_sd_basis") == "cross-validated (source)")
    return len(records)


def use_cross_validated_error(fit, cv_predictions: list[dict], cv_kind: str) -> None:
    """Make `fit`'s prediction intervals use the model error measured by cross-validation: its
    `residual_sd` summary and its error model from the held-out predictions instead of the
    in-sample ones (for "source", novelty measured against the other sources' rows). Only for
    CV kinds that hold out every row ("source", "kfold")."""
    if cv_kind not in ("source", "kfold"):
        raise ValueError(f"cross-validation {cv_kind!r} does not hold out every row")
    fit.residual_sd = residual_sds(cv_predictions)
    fit.metadata["residual_sd_basis"] = f"cross-validated ({cv_kind})"
    held = [r for r in fit.error_records if not r["fitted"]]
    fit.error_records = residual_records(cv_predictions, fitted=True) + held
    refit_error_model(fit, leave_source_out=cv_kind == "source")
