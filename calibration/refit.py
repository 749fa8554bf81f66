"""Refit the shipped efficiency factors from benchmarks_data/*.csv.

Writes diffperf/presets/efficiency.json (factors, per-GPU overrides, metadata, Laplace
covariance), calibration/report.md (accuracy tables: in-sample, k-fold, leave-one-source-out and
IMEC leave-one-out MAPE per metric / source / GPU) and calibration/*.png (predicted vs measured,
residuals by GPU and source).

    /work/venv/bin/python calibration/refit.py            # full refit + all CVs
    /work/venv/bin/python calibration/refit.py --no-cv    # the fit only (< 60 s)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Rows kept out of the fit and reported separately (benchmarks_data/SOURCES.md).
HOLDOUT = ROOT / "benchmarks_data" / "train_moe_holdout.csv"
#: TensorRT-LLM 1.0's maximum-throughput table (dense Llama 3), also never fitted.
INFER_HOLDOUT = ROOT / "benchmarks_data" / "infer_trtllm10_holdout.csv"
#: Residuals the error model is fitted on (`calibration/fit_error_model.py`): the calibrated
#: rows' leave-one-source-out predictions and the held-out rows', one per measurement.
RESIDUALS = ROOT / "calibration" / "residuals_training_inference.csv"
sys.path.insert(0, str(ROOT))

#: Settings of the shipped fit (see report.md for why).
SETTINGS = {"balance": 1.0, "prior_weight": 1e-3, "group_prior_weight": 1e-2,
            "adam_steps": 50, "lbfgs_steps": 300}
CV_KINDS = ("source", "kfold", "loo")
#: Report tables: (section heading or None to continue the previous one, first-column title,
#: summary key, note printed above the table).
SECTIONS = (
    ("IMEC validation points", "subset", "imec", None),
    ("Per measured column", "column", "metric", None),
    ("Per source", "source", "source", None),
    ("Per GPU", "GPU", "gpu", None),
    ("Per kind", "kind", "kind", None),
    (None, "kind (rows)", "kind_rows",
     "One error per benchmark row (a row's errors averaged over the columns it measures; "
     "NeMo / Megatron-Bridge rows give tokens/s and model TFLOP/s, which are one measurement):"),
)


def _progress(stage, step, total, loss):
    if step == total or step % 50 == 1 or stage == "compile":
        print(f"  {stage} {step}/{total} loss {loss:.6g}", file=sys.stderr, flush=True)


def _table(title, ins, cvs, key):
    cols = [k for k in CV_KINDS if k in cvs]
    head = f"| {title} | n | in-sample | " + " | ".join(f"CV {k}" for k in cols) + " |"
    lines = [head, "|---|---:|---:|" + "---:|" * len(cols)]
    for name, s in ins[key].items():
        cells = []
        for k in cols:
            c = cvs[k][key].get(name)
            cells.append(f"{c['mape']:.1f} %" if c else "")
        lines.append(f"| {name} | {s['n']} | {s['mape']:.1f} % | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plots(preds, cv_preds, outdir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    files = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, (title, pp) in zip(axes, (("in-sample", preds), ("leave-one-source-out", cv_preds))):
        for metric in sorted({p["metric"] for p in pp}):
            sel = [p for p in pp if p["metric"] == metric]
            m = np.array([p["measured"] for p in sel])
            y = np.array([p["predicted"] for p in sel])
            ax.scatter(range(len(sel)), y / m, s=10, label=metric)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("predicted / measured")
        ax.set_xlabel("cell (per metric)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    f = outdir / "pred_vs_measured.png"
    fig.savefig(f, dpi=110)
    plt.close(fig)
    files.append(f)
    for key in ("gpu", "source"):
        fig, ax = plt.subplots(figsize=(11, 4.5))
        names = sorted({p[key] for p in preds})
        data_in = [[np.log(p["predicted"] / p["measured"]) * 100 for p in preds if p[key] == n]
                   for n in names]
        data_cv = [[np.log(p["predicted"] / p["measured"]) * 100 for p in cv_preds
                    if p[key] == n] or [np.nan] for n in names]
        pos = np.arange(len(names))
        ax.boxplot(data_in, positions=pos - 0.18, widths=0.3, patch_artist=True,
                   boxprops={"facecolor": "#9ecae1"})
        ax.boxplot(data_cv, positions=pos + 0.18, widths=0.3, patch_artist=True,
                   boxprops={"facecolor": "#fdae6b"})
        ax.set_xticks(pos)
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_ylabel("100 * log(predicted / measured)")
        ax.set_title(f"residuals by {key}: in-sample (blue) vs leave-one-source-out (orange)")
        fig.tight_layout()
        f = outdir / f"residuals_by_{key}.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(f)
    return files


def _parameter_sd(fit, cells) -> list[float]:
    """The parameter part of each cell's interval (log sd, delta method)."""
    from diffperf.internal import INFER_COLUMNS, TRAIN_COLUMNS, cell_parameter_sd
    sd_t, sd_i = cell_parameter_sd(fit.problem, fit.theta, fit.covariance)
    par_sd = {}
    for rows, cols, sd in ((fit.problem.ds.train_rows, TRAIN_COLUMNS, sd_t),
                           (fit.problem.ds.infer_rows, INFER_COLUMNS, sd_i)):
        for i, r in enumerate(rows):
            for j, c in enumerate(cols):
                par_sd[(r.id, c)] = float(sd[i, j])
    return [par_sd[(p["id"], p["metric"])] for p in cells]


def _validate_holdout(efficiency_path, path=HOLDOUT):
    """`validate` of the held-out rows of `path` with the fit saved at `efficiency_path` (None
    when the file is absent)."""
    if not path.exists():
        return None
    from diffperf.presets import efficiency_from_json
    from diffperf.validation import validate
    return validate([path], efficiency_from_json(efficiency_path))


def _write_residuals(records, path=RESIDUALS):
    """The error model's residuals (`fit.error_records`), one line per measurement: `id,
    source, kind, quantity, r` (mean log predicted / measured) and `fitted` (1: a calibrated
    row, predicted by the fit without its source; 0: a held-out row, never fitted)."""
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "source", "kind", "quantity", "r", "fitted"])
        for m in records:
            w.writerow([m["id"], m["source"], m["kind"], m["quantity"], f"{m['r']:.6f}",
                        int(m["fitted"])])
    return path


def _interval_lines(fit, parameter_sd) -> list[str]:
    """The report's pointer to the interval error model and its coverage."""
    import numpy as np
    return [
        "## Prediction intervals", "",
        "`--interval` (train, infer, serve, predict) gives 90 % intervals: prediction x "
        "exp(-+ half-width), the half-width from the parameter covariance (Laplace, delta "
        f"method: median {np.median(parameter_sd) * 100:.2f} %, max "
        f"{np.max(parameter_sd) * 100:.2f} % log sd over the cells) and the error model of the "
        "configuration (`diffperf/calibrate/_error_model.py`). This fit's error model is fitted "
        f"on {fit.metadata.get('error_model_basis', 'its residuals')}; "
        "`python calibration/fit_error_model.py` refits it with the serving simulator's errors "
        "too, and writes its coverage (leave-one-source-out, by source, regime and covariate) "
        "in place of this section.", ""]


def _implausible_lines(fit):
    from diffperf.validation import implausible_measurements
    found = implausible_measurements(fit.problem.ds.train_rows + fit.problem.ds.infer_rows)
    lines = ["## Implausible measurements", "",
             "Measured values faster than ideal hardware (100 % of every datasheet peak, no "
             "overheads, perfect overlap) could run the configuration their row records "
             "(`diffperf.validation.implausible_measurements`; also flagged by `diffperf "
             "validate`). No efficiency factor can explain them; they are kept in the fit and "
             "in the tables above.", ""]
    if not found:
        return lines + ["None.", ""]
    lines += ["| row | column | measured | ideal bound | times beyond |",
              "|---|---|---:|---:|---:|"]
    lines += [f"| {f['id']} | {f['metric']} | {f['measured']:.4g} | {f['bound']:.4g} | "
              f"{f['factor']:.2f}x |" for f in found]
    return lines + [""]


def _holdout_lines(result) -> list[str]:
    """The held-out rows (`benchmarks_data/train_moe_holdout.csv`) predicted with the new fit
    (`result`: `_validate_holdout`), by model and by source: they are never fitted, so this is
    how far the fit carries to them."""
    if result is None:
        return []
    import numpy as np
    import pandas as pd
    table = pd.read_csv(HOLDOUT)
    model = dict(zip(table["id"], table["model"]))
    lines = ["## Held-out rows (not fitted)", "",
             f"`{HOLDOUT.relative_to(ROOT)}` predicted with this fit (`diffperf validate --data` "
             "that file): fine-grained MoE runs whose costs the model does not fully represent "
             "(`benchmarks_data/SOURCES.md`).", "",
             "| model / source | values | MAPE | median APE | predicted too fast |",
             "|---|---:|---:|---:|---:|"]
    by_model: dict[str, list[dict]] = {}
    by_source: dict[str, list[dict]] = {}
    for r in result["rows"]:
        by_model.setdefault(model[r["id"]], []).append(r)
        source = ("deepseek-v3-report" if r["id"].startswith("deepseek-v3-report")
                  else r["id"].split("-")[0])
        by_source.setdefault(f"`{source}`", []).append(r)
    for name, rows in [*by_model.items(), *by_source.items(), ("all", result["rows"])]:
        ape = np.array([r["ape"] for r in rows])
        fast = sum(r["predicted"] > r["measured"] for r in rows)
        lines.append(f"| {name} | {ape.size} | {ape.mean():.1f} % | {np.median(ape):.1f} % | "
                     f"{fast} of {ape.size} |")
    return lines + [""]


def _infer_holdout_lines(result) -> list[str]:
    """The held-out TensorRT-LLM 1.0 rows predicted with the new fit, by GPU and model."""
    if result is None:
        return []
    import numpy as np
    import pandas as pd
    table = pd.read_csv(INFER_HOLDOUT)
    key = {i: f"{g} {m} TP {t} {p.upper()}" for i, g, m, t, p in zip(
        table["id"], table["gpu"], table["model"], table["tp"], table["precision"])}
    groups: dict[str, list[dict]] = {}
    for r in result["rows"]:
        groups.setdefault(key[r["id"]], []).append(r)
    lines = [f"`{INFER_HOLDOUT.relative_to(ROOT)}` predicted with this fit: TensorRT-LLM 1.0's "
             "maximum-throughput tables for the dense Llama 3 models and for Qwen3-30B-A3B "
             "(MoE, 128 experts, top 8) on one GPU (output tokens/s per GPU, in-flight "
             "batching, 10 prompt / output lengths each; batch = the requests trtllm-bench's "
             "KV-cache estimate lets in flight; `benchmarks_data/SOURCES.md`). Its software "
             "release, in-flight batching and FP4 inference are not in the fit (B200 / GB200 "
             "are, through training rows).", "",
             "| GPU, model, plan | values | MAPE | mean error | predicted too fast |",
             "|---|---:|---:|---:|---:|"]
    moe = set(table["id"][table["num_experts"] > 1])
    dense_rows = [r for r in result["rows"] if r["id"] not in moe]
    moe_rows = [r for r in result["rows"] if r["id"] in moe]
    for name, rows in [*groups.items(), ("dense models", dense_rows), ("MoE", moe_rows),
                       ("all", result["rows"])]:
        if not rows:
            continue
        err = np.array([100 * (r["predicted"] / r["measured"] - 1) for r in rows])
        lines.append(f"| {name} | {err.size} | {np.abs(err).mean():.1f} % | {err.mean():+.1f} % "
                     f"| {int((err > 0).sum())} of {err.size} |")
    return lines + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-cv", action="store_true", help="skip cross-validation")
    ap.add_argument("--out", default=str(ROOT / "diffperf" / "presets" / "efficiency.json"))
    ap.add_argument("--report", default=str(ROOT / "calibration" / "report.md"))
    args = ap.parse_args(argv)
    from diffperf.calibrate import cross_validate
    from diffperf.internal import calibration as C, summaries
    C.enable_x64()
    paths = C.default_data_paths()
    t0 = time.perf_counter()
    print("fitting ...", file=sys.stderr)
    fit = C.calibrate(paths, progress=_progress, command="python calibration/refit.py",
                      **SETTINGS)
    t_fit = time.perf_counter() - t0
    print(f"fit: loss {fit.loss:.6g} in {t_fit:.1f} s", file=sys.stderr)
    ins = summaries(fit.predictions)
    cvs, cv_preds, t_cv, parameter_sd = {}, {}, {}, None
    if not args.no_cv:
        for kind in CV_KINDS:
            t1 = time.perf_counter()
            print(f"cross-validation: {kind} ...", file=sys.stderr)
            cv = cross_validate(fit.problem, kind, adam_steps=SETTINGS["adam_steps"],
                                lbfgs_steps=SETTINGS["lbfgs_steps"], progress=_progress)
            cvs[kind] = cv["summary"]
            cv_preds[kind] = cv["predictions"]
            t_cv[kind] = time.perf_counter() - t1
        fit.cv = cvs
        fit.metadata["cv_mape"] = {k: {m: round(v["mape"], 2) for m, v in s["metric"].items()}
                                   for k, s in cvs.items()}
        fit.metadata["cv_imec_mape"] = {k: {m: round(v["mape"], 2) for m, v in s["imec"].items()}
                                        for k, s in cvs.items()}
        from diffperf.internal import use_cross_validated_error
        use_cross_validated_error(fit, cv_preds["source"], "source")
        parameter_sd = _parameter_sd(fit, cv_preds["source"])
    fit.metadata["fit_wall_seconds"] = round(t_fit, 1)
    fit.metadata["settings"] = SETTINGS
    fit.save(args.out)
    holdout = _validate_holdout(args.out)  # the held-out rows predicted with the saved fit
    infer_holdout = _validate_holdout(args.out, INFER_HOLDOUT)
    from diffperf.internal import measure_held_out
    from diffperf.validation import read_benchmark_files
    for path, result in ((HOLDOUT, holdout), (INFER_HOLDOUT, infer_holdout)):
        if result is not None:
            print(measure_held_out(fit, path, read_benchmark_files([path]), args.out,
                                   validated=result["rows"]), file=sys.stderr)
    fit.save(args.out)  # with the held-out rows' residuals in the error model
    if parameter_sd is not None:
        print(f"wrote {_write_residuals(fit.error_records)}", file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    report = Path(args.report)
    lines = [
        "# Calibration report",
        "",
        f"Generated by `python calibration/refit.py` on {fit.metadata['date']} "
        f"(jax {fit.metadata['jax_version']}); data sha256 `{fit.metadata['data_sha256'][:16]}...` "
        f"({', '.join(fit.metadata['data_files'])}).",
        "",
        f"- Loss (mean squared log ratio + prior): {fit.loss:.5f}; {fit.metadata['n_cells']} "
        f"measured values; {fit.par.size} parameters ({len(fit.par.fields)} shared factors, "
        f"per-GPU offsets of {', '.join(fit.par.grouped)} for {len(fit.par.groups)} GPUs).",
        f"- Settings: {json.dumps(SETTINGS)}. `balance = 1`: every source table weighs the "
        "same in the loss (a 72-row TRT-LLM table would otherwise dominate the 11 IMEC runs).",
        f"- Full fit wall time: {t_fit:.1f} s (read + compile + Adam + L-BFGS + Laplace "
        "Hessian) on this machine" + (
            "; CV wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in t_cv.items())
            if t_cv else "") + ".",
        f"- Rows left out (structurally infeasible): "
        f"{', '.join(e['id'] for e in fit.excluded) or 'none'}.",
        "",
        "CV columns: `source` = leave-one-source-out (whole tables held out), `kfold` = 5-fold "
        "over experiments (a row and its `-paper` twin always together), `loo` = leave-one-out "
        "over the IMEC experiments (each fold holds out one run and its paper twin; trained on "
        "everything else). MAPE in percent.",
        "",
    ]
    for heading, title, key, note in SECTIONS:
        lines += [f"## {heading}", ""] if heading else []
        lines += ([note, ""] if note else []) + [_table(title, ins, cvs, key), ""]
    if parameter_sd is not None:
        lines += _interval_lines(fit, parameter_sd)
    lines += _implausible_lines(fit)
    lines += _holdout_lines(holdout)
    lines += _infer_holdout_lines(infer_holdout)
    lines += [
        "## Fitted factors",
        "",
        "| factor | shared | " + " | ".join(fit.per_gpu) + " |",
        "|---|---:|" + "---:|" * len(fit.per_gpu),
    ]
    for f in fit.par.fields:
        row = f"| {f} | {fit.shared[f]:.4g} | " + " | ".join(
            f"{fit.per_gpu[g][f]:.4g}" if f in fit.per_gpu[g] else "" for g in fit.per_gpu)
        lines.append(row + " |")
    if cv_preds:
        files = _plots(fit.predictions, cv_preds["source"], report.parent)
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in files]
    report.write_text("\n".join(lines) + "\n")
    print(f"wrote {report}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
