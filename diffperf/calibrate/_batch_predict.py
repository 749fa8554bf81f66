"""Predictions for every configuration listed in benchmark-format CSV files.

The rows need no measured column: this is `validate` without the comparison, for a list of
configurations a user wants predicted (`diffperf predict --data configs.csv`). All rows of a
kind are evaluated in one vmapped call, each with its GPU's fitted factors.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pandas as pd

from ..inference._infer import infer
from ..specs._efficiency import Efficiency
from ..training._notes import training_notes_batch
from ..training._step import train_step
from ..validation._data import INFER_METRICS, TRAIN_TIME_METRICS, read_benchmark_files
from ..validation._infer_rows import predict_infer_rows, stacked_infer_specs
from ..validation._train_rows import predict_train_rows, stacked_train_specs
from ._uncertainty import decode_quantity, row_intervals, training_quantity

#: Output columns, in order: what every row says about itself, then the predictions (s, tokens,
#: TFLOP/s, GB), then whether the plan fits in HBM and a status text.
ROW_COLUMNS = ("id", "kind", "gpu", "num_gpus")
TRAIN_COLUMNS, INFER_COLUMNS = TRAIN_TIME_METRICS, INFER_METRICS
COLUMNS = ROW_COLUMNS + TRAIN_COLUMNS + INFER_COLUMNS + ("peak_memory_gb", "fits", "status")
#: With intervals: the 90 % prediction interval of the row's headline time (step_time_s of a
#: train row, e2e_latency_s of an infer row), s, and the model error that set its width (a
#: `residual_sd` key of the fit: the quantity's, e.g. "throughput", or a wider one that applies
#: to the row, e.g. "infer_unseen", "infer_moe", "step_time_moe").
INTERVAL_COLUMNS = ("interval_low_s", "interval_high_s", "interval_model_error")


def predict_csv(paths, efficiency: Efficiency | None = None, intervals: bool = False,
                fit=None) -> pd.DataFrame:
    """Predict every row of the CSV files in `paths` (docs/benchmark-format.md; measured
    columns optional and ignored).

    `efficiency`: as in `diffperf.validation.validate` (None: the shipped calibration, per GPU).
    `intervals`: add `INTERVAL_COLUMNS`, from the uncertainty of `fit` (a fitted JSON path, or
    None: the shipped calibration; see `_uncertainty.row_intervals`). Pass the file
    `efficiency` was loaded from, so that the intervals belong to the same fit.

    **Returns:** a DataFrame with `COLUMNS` (then `INTERVAL_COLUMNS`), one row per input row in
    file order. Prediction columns of the other kind are empty (None). `status` is `ok`, the
    HBM (or host memory) overflow of a plan that does not fit (`fits` False, still predicted),
    or `invalid: <reason>` for a row that cannot be evaluated (no predictions); a predicted row
    without an interval says so in its status.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    rows = read_benchmark_files(paths, require_measured=False)
    train = [r for r in rows if r.kind == "train"]
    infer = [r for r in rows if r.kind == "infer"]
    results, failed, bounds, notes = {}, {}, {}, {}
    no_interval = {"train": "too wide or not finite", "infer": "too wide or not finite"}
    for predict, stack, kind, kind_rows in (
            (predict_train_rows, stacked_train_specs, "train", train),
            (predict_infer_rows, stacked_infer_specs, "infer", infer)):
        if kind_rows:
            stacked = stack(kind_rows)
            predicted, bad = predict(kind_rows, efficiency, stacked)
            results.update({row.id: (pred, warning) for row, pred, warning in predicted})
            if kind == "train" and stacked.rows:  # train's notes, for all rows at once
                notes.update(zip((r.id for r in stacked.rows),
                                 training_notes_batch(stacked.models, stacked.plans)))
            failed.update({f["id"]: f["error"] for f in bad})
            if intervals and stacked.rows:
                try:
                    bounds.update(_intervals(kind, stacked, fit))
                except ValueError as e:  # e.g. a fitted file without an uncertainty section
                    no_interval[kind] = str(e)
    records = []
    for r in rows:
        rec = dict.fromkeys(COLUMNS)
        rec.update(id=r.id, kind=r.kind, gpu=r.values["gpu"],
                   num_gpus=int(round(r.values["num_gpus"])))
        wanted = (TRAIN_COLUMNS if r.kind == "train" else INFER_COLUMNS) + ("peak_memory_gb",)
        not_finite = [c for c in wanted
                      if r.id in results and not np.isfinite(results[r.id][0][c])]
        if not_finite:  # never a silent NaN or inf in the output: the row says so instead
            rec["status"] = f"invalid: no finite prediction for {', '.join(not_finite)}"
        elif r.id in results:
            pred, warning = results[r.id]
            for c in wanted:
                rec[c] = pred[c]
            rec["fits"] = warning is None
            rec["status"] = "ok" if warning is None else warning
            rec["status"] += "".join(f"; note: {n}" for n in notes.get(r.id, ()))
            if intervals:
                low, high, key = bounds.get(r.id, (np.nan, np.nan, None))
                if np.isfinite(low) and np.isfinite(high):
                    rec.update(interval_low_s=float(low), interval_high_s=float(high),
                               interval_model_error=key)
                else:
                    rec["status"] += f"; no interval ({no_interval[r.kind]})"
        else:
            rec["status"] = f"invalid: {failed.get(r.id, 'could not be evaluated')}"
        records.append(rec)
    columns = COLUMNS + (INTERVAL_COLUMNS if intervals else ())
    return pd.DataFrame.from_records(records, columns=list(columns))


def _intervals(kind: str, stacked, fit) -> dict:
    """`{row id: (low, high, model error key)}`: 90 % intervals of the headline time of
    `stacked`'s rows."""
    ms, ss, ps = stacked.models, stacked.systems, stacked.plans
    if kind == "train":
        predict = lambda e: jax.vmap(train_step)(ms, ss, ps, e).step_time  # noqa: E731
        quantities = [training_quantity(r.values["num_experts"]) for r in stacked.rows]
    else:
        predict = lambda e: jax.vmap(infer)(ms, ss, ps, e).e2e_latency  # noqa: E731
        quantities = [decode_quantity(r.values["batch"], r.values["output_len"])
                      for r in stacked.rows]
    gpus = [r.values["gpu"] for r in stacked.rows]
    precisions = None if kind == "train" else [r.values["precision"] for r in stacked.rows]
    experts = [r.values["num_experts"] for r in stacked.rows]
    _, low, high, keys = row_intervals(predict, gpus, quantities, kind, fit,
                                       precisions=precisions, num_experts=experts)
    return {r.id: (lo, hi, k) for r, lo, hi, k in zip(stacked.rows, low, high, keys)}
