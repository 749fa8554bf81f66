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


def _coverage(fit, held_out):
    """Switch the fit's model error to the leave-one-source-out one and measure how often the
    90 % interval of a held-out prediction contains the measured value."""
    import numpy as np

    from diffperf.internal import (
        INFER_COLUMNS,
        TRAIN_COLUMNS,
        cell_parameter_sd,
        interval_coverage,
        use_cross_validated_error,
    )
    use_cross_validated_error(fit, held_out, "source")
    sd_t, sd_i = cell_parameter_sd(fit.problem, fit.theta, fit.covariance)
    par_sd = {}
    for rows, cols, sd in ((fit.problem.ds.train_rows, TRAIN_COLUMNS, sd_t),
                           (fit.problem.ds.infer_rows, INFER_COLUMNS, sd_i)):
        for i, r in enumerate(rows):
            for j, c in enumerate(cols):
                par_sd[(r.id, c)] = float(sd[i, j])
    cov = interval_coverage(held_out, fit.residual_sd, 0.9, par_sd)
    held = [par_sd[(p["id"], p["metric"])] for p in held_out]
    fit.metadata["interval_coverage_source_cv"] = {
        k: {"own_scale": round(v["inside"], 4),
            "other_sources_scale": (None if v["inside_other_sources"] is None
                                    else round(v["inside_other_sources"], 4))}
        for k, v in cov.items()}
    return {"table": cov, "parameter_sd_median": float(np.median(held)),
            "parameter_sd_max": float(np.max(held))}


def _validate_holdout(efficiency_path, path=HOLDOUT):
    """`validate` of the held-out rows of `path` with the fit saved at `efficiency_path` (None
    when the file is absent)."""
    if not path.exists():
        return None
    from diffperf.presets import efficiency_from_json
    from diffperf.validation import validate
    return validate([path], efficiency_from_json(efficiency_path))


def _moe_error_lines(fit, moe):
    """The MoE model error's row of the interval table, and how the dense error would cover."""
    from statistics import NormalDist

    import numpy as np

    from diffperf.internal import MOE_STEP_TIME
    r = moe["residuals"]
    if not r.size:
        return []
    z = NormalDist().inv_cdf(0.95)
    sd, dense = fit.residual_sd[MOE_STEP_TIME], fit.residual_sd["step_time"]
    half = (np.exp(z * sd) - np.exp(-z * sd)) / 2 * 100
    return [
        f"MoE models' training steps get their own model error, `{MOE_STEP_TIME}`: the RMS "
        f"log residual of {moe['fitted']} fitted MoE rows (leave-one-source-out) and "
        f"{moe['held_out']} held-out MoE rows (`{HOLDOUT.relative_to(ROOT)}`, never fitted): "
        f"{sd * 100:.1f} % against {dense * 100:.1f} % for all training steps, a mean "
        f"half-width of {half:.0f} %. With the all-training error only "
        f"{np.mean(np.abs(r) <= z * dense) * 100:.0f} % of these {r.size} MoE measurements "
        f"would fall inside their 90 % interval; with their own, "
        f"{np.mean(np.abs(r) <= z * sd) * 100:.0f} % (own scale, parameter part left out).",
        ""]


def _floor_error_lines(fit, key, result, what):
    """The report paragraph of a floor error (`infer_unseen`, `infer_moe`): what it covers
    (`what`), its size, its bias and how the throughput error would have covered its rows."""
    from statistics import NormalDist

    import numpy as np

    from diffperf.internal import bias_text
    if result is None or not result["residuals"].size:
        return []
    r, z = result["residuals"], NormalDist().inv_cdf(0.95)
    sd, seen = fit.residual_sd[key], fit.residual_sd["throughput"]
    factor = np.exp(z * sd)
    return [
        f"{what} gets its own model error, `{key}`, applied as the larger of it and the "
        f"quantity's own: the RMS log residual of the {r.size} held-out rows of that kind in "
        f"the table above, {sd * 100:.1f} % against {seen * 100:.1f} % for batched throughput "
        f"(a 90 % interval from 1/{factor:.2f} to {factor:.2f} times the prediction). Most of it "
        f"is bias: those rows are predicted {bias_text(float(r.mean()))} on average (geometric "
        f"mean; {int((r > 0).sum())} of {r.size} too fast). With the "
        f"throughput error only {np.mean(np.abs(r) <= z * seen) * 100:.0f} % of them would fall "
        f"inside their 90 % interval; with their own, {np.mean(np.abs(r) <= z * sd) * 100:.0f} % "
        f"(in-sample: these rows set the error; parameter part left out).",
        ""]


def _inference_floor_lines(fit, unseen, moe):
    """Both floor errors of the held-out inference table."""
    from diffperf.internal import MOE_INFERENCE, PRECISION_CLASS_NAMES, UNSEEN_INFERENCE
    support = fit.inference_support
    if support is None:
        return []
    gpus = ", ".join(support["gpus"])
    precisions = ", ".join(PRECISION_CLASS_NAMES[p] for p in support["precisions"])
    lines = _floor_error_lines(
        fit, UNSEEN_INFERENCE, unseen,
        f"Inference outside the fit's inference data (on a GPU other than {gpus}, or with GEMMs "
        f"at another precision than {precisions}; all {0 if unseen is None else unseen['unseen']} "
        f"such held-out rows are both: a new GPU alone or a new precision alone is untested)")
    lines += _floor_error_lines(
        fit, MOE_INFERENCE, moe,
        f"Inference of MoE models with more experts per layer than any fitted inference row "
        f"({support['max_experts']}; the held-out ones: Qwen3-30B-A3B on B200 / GB200 FP4, so "
        f"the error also holds the Blackwell FP4 miss and the table's 40 % B200 / GB200 "
        f"disagreement)")
    return lines


def _coverage_lines(fit, cov):
    from diffperf.internal import QUANTITIES
    t = cov["table"]
    pct = lambda x: "n/a" if x is None else f"{x * 100:.0f} %"

    def other(v):  # says how many measurements the other-sources test could score
        n_o = v["n_other_sources"]
        return pct(v["inside_other_sources"]) + (f" ({n_o} of {v['n']})" if 0 < n_o < v["n"]
                                                 else "")
    lines = [
        "## Prediction intervals",
        "",
        "`diffperf train --interval` / `diffperf infer --interval` print 90 % intervals: "
        "prediction x exp(+-1.645 sd), sd^2 = parameter variance (Laplace covariance, delta "
        "method) + the model error of the quantity: the RMS log error of the "
        "leave-one-source-out predictions (the error on tables the fit never saw), one "
        "residual per measurement (a NeMo row's tokens/s and model TFLOP/s count once). "
        f"The parameter part is small: median {cov['parameter_sd_median'] * 100:.2f} %, "
        f"max {cov['parameter_sd_max'] * 100:.2f} % (log sd) over the cells.",
        "",
        "Coverage = share of the held-out (leave-one-source-out) measurements inside their "
        "90 % interval. *Own scale*: the model error as shipped, estimated from these same "
        "residuals, so it tests only the shape of the error distribution. *Other sources' "
        "scale*: each measurement's model error re-estimated from the other sources' residuals "
        "only, the honest test for a new table (n/a where a single source measures the "
        "quantity: each inference quantity has one). Inference is split by regime: `latency` "
        "is a batch-1 run's end-to-end latency, `throughput` a batched run's output tokens/s "
        "(or its latency).",
        "",
        "| quantity / source | measurements | model error (RMS log) | mean half-width | "
        "coverage, own scale | coverage, other sources' scale |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for q in list(QUANTITIES) + ["all"]:
        if q in t:
            lines.append(f"| {q} | {t[q]['n']} | {fit.residual_sd[q] * 100:.1f} % | "
                         f"{t[q]['half_width_pct']:.0f} % | {pct(t[q]['inside'])} | "
                         f"{other(t[q])} |")
    for k in sorted(k for k in t if k.startswith("source:")):
        lines.append(f"| {k[7:]} | {t[k]['n']} | | {t[k]['half_width_pct']:.0f} % | "
                     f"{pct(t[k]['inside'])} | {other(t[k])} |")
    return lines + [""]


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
    cvs, cv_preds, t_cv, coverage = {}, {}, {}, None
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
        coverage = _coverage(fit, cv_preds["source"])
    fit.metadata["fit_wall_seconds"] = round(t_fit, 1)
    fit.metadata["settings"] = SETTINGS
    fit.save(args.out)
    holdout = _validate_holdout(args.out)  # the held-out rows predicted with the saved fit
    infer_holdout = _validate_holdout(args.out, INFER_HOLDOUT)
    moe = unseen = moe_infer = None
    if coverage:
        from diffperf.internal import moe_step_error
        moe = moe_step_error(fit, cv_preds["source"], holdout["rows"] if holdout else [])
    if infer_holdout is not None:
        from diffperf.calibrate import measure_inference_errors
        from diffperf.validation import read_benchmark_files
        measured = measure_inference_errors(fit, INFER_HOLDOUT,
                                            read_benchmark_files([INFER_HOLDOUT]), args.out,
                                            validated=infer_holdout["rows"])
        unseen, moe_infer = measured["unseen"], measured["moe"]
    fit.save(args.out)  # with the MoE, unseen-inference and MoE-inference errors
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
    if coverage:
        lines += _coverage_lines(fit, coverage)
        lines += _moe_error_lines(fit, moe)
    lines += _implausible_lines(fit)
    lines += _holdout_lines(holdout)
    lines += _infer_holdout_lines(infer_holdout)
    lines += _inference_floor_lines(fit, unseen, moe_infer)
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
