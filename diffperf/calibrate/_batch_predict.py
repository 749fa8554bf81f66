"""Predictions for every configuration listed in benchmark-format CSV files.

The rows need no measured column: this is `validate` without the comparison, for a list of
configurations a user wants predicted (`diffperf predict --data configs.csv`). The rows of a
kind are evaluated vmapped, `validation._stack.CHUNK_ROWS` at a time in one compiled program
(any number of rows: 100,000 take about a minute on a 2-core CPU), each with its GPU's fitted
factors.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..inference._infer import infer
from ..presets import fitted_gpu
from ..specs._efficiency import Efficiency
from ..training._notes import training_notes_batch
from ..training._step import train_step
from ..validation._data import INFER_METRICS, TRAIN_TIME_METRICS, read_benchmark_files
from ..validation._infer_rows import predict_infer_rows, stacked_infer_specs
from ..validation._stack import (
    FAST_COMPILE,
    Progress,
    chunks,
    release_freed_memory,
    take,
)
from ..validation._train_rows import predict_train_rows, stacked_train_specs
from ._error_data import row_descriptor
from ._uncertainty import (
    _bounds,
    decode_quantity,
    descriptor_errors,
    load_uncertainty,
    require_converged,
    require_error_model,
)

if TYPE_CHECKING:
    import pandas as pd

#: Output columns, in order: what every row says about itself, then the predictions (s, tokens,
#: TFLOP/s, GB), then whether the plan fits in HBM and a status text.
ROW_COLUMNS = ("id", "kind", "gpu", "num_gpus")
TRAIN_COLUMNS, INFER_COLUMNS = TRAIN_TIME_METRICS, INFER_METRICS
COLUMNS = ROW_COLUMNS + TRAIN_COLUMNS + INFER_COLUMNS + ("peak_memory_gb", "fits", "status")
#: With intervals: the 90 % prediction interval of the row's headline time (step_time_s of a
#: train row, e2e_latency_s of an infer row), s, and what set its width: what widens it beyond
#: a calibrated configuration (`ErrorModel.reasons`, "; "-joined), or its quantity (e.g.
#: "step_time", "throughput") when nothing does.
INTERVAL_COLUMNS = ("interval_low_s", "interval_high_s", "interval_why")
#: The values of a row still read once its specs are stacked (output columns, the GPU's
#: factors, the model error of its interval); 100,000 rows' other values take ~150 MB.
_STILL_READ = ("gpu", "num_gpus", "batch", "output_len", "precision", "num_experts",
               # ... and what the error model describes a row by (`_error_model.descriptor`)
               "hidden", "ffn_hidden", "experts_per_token", "kv_lora_rank", "sliding_window",
               "gpus_per_node", "tp", "pp", "micro_batch", "seq_len", "cp", "runtime")
#: Rows per compiled interval evaluation: the Jacobian carries one tangent per fitted
#: parameter (~60), so its intermediates are ~60x those of a prediction.
INTERVAL_CHUNK_ROWS = 512


def predict_csv(paths, efficiency: Efficiency | None = None, intervals: bool = False,
                fit=None, progress: bool | Progress = False) -> pd.DataFrame:
    """Predict every row of the CSV files in `paths` (docs/benchmark-format.md; measured
    columns optional and ignored).

    `efficiency`: as in `diffperf.validation.validate` (None: the shipped calibration, per GPU).
    `intervals`: add `INTERVAL_COLUMNS`, from the uncertainty of `fit` (a fitted JSON path, or
    None: the shipped calibration; see `_uncertainty.row_intervals`). Pass the file
    `efficiency` was loaded from, so that the intervals belong to the same fit. `progress`:
    report the stages of a long run (>= 5,000 rows) on stderr (True, or a
    `validation._stack.Progress`).

    **Returns:** a DataFrame with `COLUMNS` (then `INTERVAL_COLUMNS`), one row per input row in
    file order. Prediction columns of the other kind are empty (None). `status` is `ok`, the
    HBM (or host memory) overflow of a plan that does not fit (`fits` False, still predicted),
    or `invalid: <reason>` for a row that cannot be evaluated (no predictions); a predicted row
    without an interval says so in its status.
    """
    import pandas as pd
    if isinstance(paths, (str, Path)):
        paths = [paths]
    bar = progress if isinstance(progress, Progress) else Progress(enabled=bool(progress))
    rows = read_benchmark_files(paths, require_measured=False)
    release_freed_memory()
    train = [r for r in rows if r.kind == "train"]
    infer_rows = [r for r in rows if r.kind == "infer"]
    stacked_kinds = {kind: stack(kind_rows, bar.start(len(kind_rows),
                                                      f"{kind} rows: building specs"))
                     for stack, kind, kind_rows in ((stacked_train_specs, "train", train),
                                                    (stacked_infer_specs, "infer", infer_rows))
                     if kind_rows}
    for r in rows:  # these rows are this function's own: keep what is still read of them
        r.values = {k: r.values[k] for k in _STILL_READ if k in r.values}
    release_freed_memory()
    results, failed, bounds, notes = {}, {}, {}, {}
    no_interval = {"train": "too wide or not finite", "infer": "too wide or not finite"}
    # Inference first: its program is the smaller one to keep while the other compiles
    # (each compilation needs ~370 MB on top of the ~120 MB a compiled program keeps).
    for predict, kind, kind_rows in ((predict_infer_rows, "infer", infer_rows),
                                     (predict_train_rows, "train", train)):
        if kind_rows:
            stacked = stacked_kinds[kind]
            predicted, bad = predict(kind_rows, efficiency, stacked, bar)
            results.update({row.id: (pred, warning) for row, pred, warning in predicted})
            if kind == "train" and stacked.rows:
                notes.update(_training_notes(stacked))
            failed.update({f["id"]: f["error"] for f in bad})
            release_freed_memory()  # the compiler's working memory, before the next kind's
            if intervals and stacked.rows:
                try:
                    bounds.update(_intervals(kind, stacked, fit, bar))
                except ValueError as e:  # e.g. a fitted file without an uncertainty section
                    no_interval[kind] = str(e)
    bar.close()
    columns = COLUMNS + (INTERVAL_COLUMNS if intervals else ())
    table: dict[str, list] = {c: [None] * len(rows) for c in columns}  # not a dict per row
    for i, r in enumerate(rows):
        rec = {"id": r.id, "kind": r.kind, "gpu": r.values["gpu"],
               "num_gpus": int(round(r.values["num_gpus"]))}
        wanted = (TRAIN_COLUMNS if r.kind == "train" else INFER_COLUMNS) + ("peak_memory_gb",)
        not_finite = [c for c in wanted
                      if r.id in results and not np.isfinite(results[r.id][0][c])]
        if not_finite:  # never a silent NaN or inf in the output: the row says so instead
            rec["status"] = f"invalid: no finite prediction for {', '.join(not_finite)}"
        elif r.id in results:
            pred, warning = results[r.id]
            rec.update({c: pred[c] for c in wanted})
            rec["fits"] = warning is None
            rec["status"] = ("ok" if warning is None else warning) + "".join(
                f"; note: {n}" for n in notes.get(r.id, ()))
            if intervals:
                low, high, key = bounds.get(r.id, (np.nan, np.nan, None))
                if np.isfinite(low) and np.isfinite(high):
                    rec.update(interval_low_s=float(low), interval_high_s=float(high),
                               interval_why=key)
                else:
                    rec["status"] += f"; no interval ({no_interval[r.kind]})"
        else:
            rec["status"] = f"invalid: {failed.get(r.id, 'could not be evaluated')}"
        for c, x in rec.items():
            table[c][i] = x
    return pd.DataFrame(table, columns=list(columns))


def _training_notes(stacked) -> dict:
    """`{row id: [note, ...]}` of the rows with a training note (`training_notes_batch`), a
    chunk of rows at a time."""
    out = {}
    n = len(stacked.rows)
    for start, stop, index in chunks(n):
        models, plans = take((stacked.models, stacked.plans), index[:stop - start])
        for row, found in zip(stacked.rows[start:stop], training_notes_batch(models, plans)):
            if found:
                out[row.id] = found
    return out


@eqx.filter_jit(compiler_options=FAST_COMPILE)
def _log_and_jacobian(par, kind: str, theta, group, models, systems, plans, runtimes=None):
    """log of each row's headline time (train: step time, infer: end-to-end latency, s) and
    its Jacobian [rows, parameters] with respect to the fit's parameter vector `theta`, each
    row with the factors of its GPU group (`group`, -1: shared factors only)."""
    def log_time(th):
        eff = par.row_efficiency(th, group)
        if kind == "train":
            return jnp.log(jax.vmap(train_step)(models, systems, plans, eff, runtimes).step_time)
        return jnp.log(jax.vmap(infer)(models, systems, plans, eff, runtimes).e2e_latency)
    return log_time(theta), jax.jacfwd(log_time)(theta)


def _intervals(kind: str, stacked, fit, progress: Progress | None = None,
               level: float = 0.9) -> dict:
    """`{row id: (low, high, why)}`: 90 % intervals of the headline time of
    `stacked`'s rows, s (`_uncertainty.row_intervals`, evaluated `INTERVAL_CHUNK_ROWS` rows at
    a time in one compiled program)."""
    u = load_uncertainty(fit)
    require_converged(u)
    model = require_error_model(u, kind)
    par, rows = u.par, stacked.rows
    gpus = [r.values["gpu"] for r in rows]
    fitted = {g: fitted_gpu(g, par.groups) for g in dict.fromkeys(gpus)}  # H800: H100's
    group = np.asarray([-1 if fitted[g] is None else par.groups.index(fitted[g]) for g in gpus])
    theta = jnp.asarray(u.theta, dtype=jnp.result_type(float))
    if progress is not None:
        progress.start(len(rows), f"{kind} rows: prediction intervals")
    log_value, variance = [], []
    for start, stop, index in chunks(len(rows), INTERVAL_CHUNK_ROWS):
        specs = take((stacked.models, stacked.systems, stacked.plans, stacked.runtimes),
                     index)
        value, jac = jax.device_get(_log_and_jacobian(par, kind, theta, group[index], *specs))
        value, jac = np.asarray(value, np.float64), np.asarray(jac, np.float64)
        log_value.append(value[:stop - start])
        variance.append(np.einsum("rp,pq,rq->r", jac, u.covariance, jac)[:stop - start])
        if progress is not None:
            progress.update(stop)
    descriptors = []
    for r in rows:
        quantity = ("step_time" if kind == "train" else
                    decode_quantity(r.values["batch"], r.values["output_len"]))
        descriptors.append(row_descriptor(r, quantity))
    error, keys = descriptor_errors(model, descriptors, level)
    low, high, _ = _bounds(np.concatenate(log_value), np.concatenate(variance), error, level)
    return {r.id: (lo, hi, k) for r, lo, hi, k in zip(rows, low, high, keys)}
