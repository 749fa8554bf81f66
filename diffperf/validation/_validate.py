"""`diffperf validate`: predict every row of benchmark CSVs and compare with the measurements."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..specs._efficiency import Efficiency
from ._data import read_benchmark_files
from ._infer_rows import predict_infer_rows, stacked_infer_specs
from ._plausibility import implausible_measurements
from ._stack import Progress, release_freed_memory
from ._train_rows import predict_train_rows, stacked_train_specs


def validate(paths, efficiency: Efficiency | None = None, progress: bool | Progress = False
             ) -> dict:
    """Predict every row of the CSV files in `paths` and compare with each measured column.

    `efficiency`: an `Efficiency` used for every row, a `GpuEfficiency` (e.g. from
    `efficiency_from_json` of a fitted file with `per_gpu` entries: each row uses its GPU's
    factors), or None: the shipped calibration, per GPU. `progress`: report the stages of a
    long run (>= 5,000 rows of a kind) on stderr (True, or a `_stack.Progress`). Rows are
    evaluated in chunks of one compiled shape (`_stack.CHUNK_ROWS`), so any number fits.

    **Returns:** `{"rows": [...], "summary": {metric: {"n", "mape", "max_ape"}}, "failed": [...],
    "defaults": [...], "warnings": [...], "suspect_units": [...], "implausible": [...]}` as in
    docs/benchmark-format.md (APE in percent); `suspect_units` lists measurements
    `UNIT_SUSPECT_RATIO` times or more off their prediction (`{"id", "metric", "ratio",
    "warning"}`, ratio >= 1 either way), `implausible` measurements faster than ideal hardware
    could run the row's recorded configuration (`diffperf.validation.implausible_measurements`).
    """
    eff = efficiency
    if isinstance(paths, (str, Path)):
        paths = [paths]
    rows = read_benchmark_files(paths)
    release_freed_memory()
    train = [r for r in rows if r.kind == "train"]
    infer = [r for r in rows if r.kind == "infer"]
    bar = progress if isinstance(progress, Progress) else Progress(enabled=bool(progress))
    st_train = stacked_train_specs(train, bar.start(len(train), "train rows: building specs"))
    st_infer = stacked_infer_specs(infer, bar.start(len(infer), "infer rows: building specs"))
    predictions, failed = predict_train_rows(train, eff, st_train, bar)
    if infer:
        more, more_failed = predict_infer_rows(infer, eff, st_infer, bar)
        predictions += more
        failed += more_failed
    bar.start(len(rows), "ideal-hardware bounds of the measurements")
    implausible = implausible_measurements(rows, (st_train, st_infer))
    bar.close()
    out_rows, warnings = [], []
    for row, pred, warning in predictions:
        if warning:
            warnings.append({"id": row.id, "warning": warning})
        for metric, measured in row.measured.items():
            p = pred.get(metric)
            if p is None or not np.isfinite(p):
                failed.append({"id": row.id, "error": f"no finite prediction for {metric}"})
                continue
            out_rows.append({"id": row.id, "source": row.source, "metric": metric,
                             "measured": measured,
                             "predicted": p, "ape": abs(p - measured) / measured * 100.0})
    summary = summarize(out_rows)
    suspect = [{"id": r["id"], "metric": r["metric"], "ratio": _ratio(r),
                "warning": f"{r['metric']} {r['measured']:.4g} is {_ratio(r):.3g}x off the "
                           f"prediction {r['predicted']:.4g}: a unit mix-up"
                           + (" (ms for s?)" if r["metric"].endswith("_s") else "?")}
               for r in out_rows if _ratio(r) > UNIT_SUSPECT_RATIO]
    defaults = [{"id": r.id, "defaults": r.defaults_used} for r in rows if r.defaults_used]
    return {"rows": out_rows, "summary": summary, "failed": failed, "defaults": defaults,
            "warnings": warnings, "suspect_units": suspect,
            "implausible": implausible}


#: A measurement this many times off its prediction (either way) is flagged as a likely unit
#: mix-up; the model's largest miss on the shipped data is below 3x.
UNIT_SUSPECT_RATIO = 20.0


def _ratio(row: dict) -> float:
    """How many times apart a validation row's measurement and prediction are (>= 1)."""
    q = row["predicted"] / row["measured"]
    return max(q, 1.0 / q)


def summarize(rows: list[dict]) -> dict:
    """Per-metric count, MAPE and max APE (percent) of validation rows."""
    summary: dict[str, dict] = {}
    for metric in dict.fromkeys(r["metric"] for r in rows):
        apes = np.array([r["ape"] for r in rows if r["metric"] == metric])
        summary[metric] = {"n": int(apes.size), "mape": float(apes.mean()),
                           "max_ape": float(apes.max())}
    return summary


def subset_summary(result: dict, prefix: str | tuple[str, ...], suffix: str | None = None,
                   exclude_suffix: str | None = None) -> dict:
    """Summary restricted to row ids starting with `prefix` (e.g. 'imec-'), optionally also
    ending with `suffix` or not ending with `exclude_suffix`."""
    rows = [r for r in result["rows"] if r["id"].startswith(prefix)
            and (suffix is None or r["id"].endswith(suffix))
            and (exclude_suffix is None or not r["id"].endswith(exclude_suffix))]
    return summarize(rows)


#: Named subsets reported by `diffperf validate` (Kundu et al.'s validation points).
IMEC_SUBSETS = {
    "IMEC training (11 Megatron runs, IMEC values)": (("imec-korthi-", "imec-selene-"), None,
                                                      "-paper"),
    "IMEC training (same 11 runs, paper values)": (("imec-korthi-", "imec-selene-"), "-paper",
                                                   None),
    "IMEC inference (22 NVIDIA Llama-2 latency points)": ("imec-inf-", None, None),
}


def imec_summaries(result: dict) -> dict:
    """Summaries of the IMEC subsets present in a validation result."""
    out = {}
    for name, (prefix, suffix, exclude) in IMEC_SUBSETS.items():
        s = subset_summary(result, prefix, suffix, exclude)
        if s:
            out[name] = s
    return out
