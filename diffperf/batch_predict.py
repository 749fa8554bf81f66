"""Predictions for every configuration listed in benchmark-format CSV files.

The rows need no measured column: this is `validate` without the comparison, for a list of
configurations a user wants predicted (`diffperf predict --data configs.csv`). All rows of a
kind are evaluated in one vmapped call, each with its GPU's fitted factors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .data import read_benchmarks
from .efficiency import Efficiency

#: Output columns, in order: what every row says about itself, then the predictions (s, tokens,
#: TFLOP/s, GB), then whether the plan fits in HBM and a status text.
ROW_COLUMNS = ("id", "kind", "gpu", "num_gpus")
TRAIN_COLUMNS = ("step_time_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu")
INFER_COLUMNS = ("e2e_latency_s", "ttft_s", "tpot_s", "output_tok_s_per_gpu")
COLUMNS = ROW_COLUMNS + TRAIN_COLUMNS + INFER_COLUMNS + ("peak_memory_gb", "fits", "status")


def predict_csv(paths, efficiency: Efficiency | None = None) -> pd.DataFrame:
    """Predict every row of the CSV files in `paths` (docs/benchmark-format.md; measured
    columns optional and ignored).

    `efficiency`: as in `validate.validate` (None: the shipped calibration, per GPU).

    **Returns:** a DataFrame with `COLUMNS`, one row per input row in file order. Prediction
    columns of the other kind are empty (None). `status` is `ok`, the HBM (or host memory)
    overflow of a plan that does not fit (`fits` False, still predicted), or `invalid: <reason>`
    for a row that cannot be evaluated (no predictions).
    """
    from .inference_validate import predict_infer_rows
    from .validate import predict_train_rows
    if isinstance(paths, (str, Path)):
        paths = [paths]
    rows = [r for p in paths for r in read_benchmarks(p, require_measured=False)]
    train = [r for r in rows if r.kind == "train"]
    infer = [r for r in rows if r.kind == "infer"]
    results, failed = {}, {}
    for predict, kind_rows in ((predict_train_rows, train), (predict_infer_rows, infer)):
        if kind_rows:
            predicted, bad = predict(kind_rows, efficiency)
            results.update({row.id: (pred, warning) for row, pred, warning in predicted})
            failed.update({f["id"]: f["error"] for f in bad})
    records = []
    for r in rows:
        rec = dict.fromkeys(COLUMNS)
        rec.update(id=r.id, kind=r.kind, gpu=r.values["gpu"],
                   num_gpus=int(round(r.values["num_gpus"])))
        if r.id in results:
            pred, warning = results[r.id]
            wanted = TRAIN_COLUMNS if r.kind == "train" else INFER_COLUMNS
            for c in wanted + ("peak_memory_gb",):
                value = pred[c]
                if not np.isfinite(value):  # never a silent NaN in the output
                    raise ValueError(f"row {r.id!r}: no finite prediction for {c}")
                rec[c] = value
            rec["fits"] = warning is None
            rec["status"] = "ok" if warning is None else warning
        else:
            rec["status"] = f"invalid: {failed.get(r.id, 'could not be evaluated')}"
        records.append(rec)
    return pd.DataFrame.from_records(records, columns=list(COLUMNS))
