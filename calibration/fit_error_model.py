"""Fit the error model of the prediction intervals and measure its coverage.

Reads the residuals that `calibration/refit.py` (calibrated rows, leave-one-source-out, and
the held-out training / inference rows) and `calibration/serving_validation.py` (the serving
simulator against published measurements under load) wrote, describes each residual's
configuration (`diffperf.calibrate._error_model.descriptor`), measures its novelty against the
calibration data its prediction saw, fits the error model, writes it into
`diffperf/presets/efficiency.json` (`uncertainty.error_model`) and its coverage into the
"Prediction intervals" section of `calibration/report.md`, with `calibration/coverage.png`.

    python calibration/fit_error_model.py [--json]

Run it after `refit.py` and `serving_validation.py` (it takes seconds).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffperf.calibrate._error_data import covariate_table  # noqa: E402
from diffperf.calibrate._error_model import (  # noqa: E402
    COVARIATES,
    NOVELTY,
    covariates,
    coverage_by_source,
    descriptor,
    fit_error_model,
)
from diffperf.calibrate._fit import default_data_paths  # noqa: E402
from diffperf.validation import read_benchmark_files  # noqa: E402
from diffperf.validation._serving_rows import read_serving_rows, regime_of  # noqa: E402

HERE = ROOT / "calibration"
TRAIN_INFER = HERE / "residuals_training_inference.csv"
SERVING = HERE / "residuals_serving.csv"
HOLDOUTS = [ROOT / "benchmarks_data" / n
            for n in ("train_moe_holdout.csv", "infer_trtllm10_holdout.csv")]
EFFICIENCY = ROOT / "diffperf" / "presets" / "efficiency.json"
#: Levels of the nominal-vs-empirical coverage table and plot.
REPORT_LEVELS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)


def _read(path: Path) -> list[dict]:
    if not path.exists():
        raise SystemExit(f"{path} is missing: run "
                         + ("calibration/refit.py" if path == TRAIN_INFER
                            else "calibration/serving_validation.py") + " first")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def residual_table() -> dict:
    """Every residual with its descriptor, source and the support its novelty is measured
    against: `{"r", "C", "source", "regime", "descriptors", "support"}`."""
    calibrated = read_benchmark_files(default_data_paths())
    by_id = {r.id: r for r in calibrated} | {r.id: r for r in read_benchmark_files(HOLDOUTS)}
    records = [{**rec, "r": float(rec["r"]), "fitted": rec["fitted"] == "1"}
               for rec in _read(TRAIN_INFER)]
    t = covariate_table(records, by_id, calibrated, leave_source_out=True)
    regime = [f"{d.kind}: " + ("calibrated (leave-one-source-out)" if rec["fitted"]
                               else "held-out tables")
              for rec, d in zip(records, t["descriptors"])]
    serving = {r["id"]: r for r in read_serving_rows()}
    loads = {"offline saturation": "offline", "closed loop": "closed",
             "online at a rate": "online"}
    C, r, groups, descriptors = [t["C"]], [t["r"]], [t["groups"]], t["descriptors"]
    for rec in _read(SERVING):
        row = serving[rec["id"]]
        d = descriptor(row, rec["quantity"], rec["engine_preset"],
                       load=loads[regime_of(row)])
        regime.append("serving (simulated, never fitted)")
        groups.append(np.array(["serving: " + rec["source"]]))
        r.append(np.array([float(rec["r"])]))
        C.append(covariates(d, t["support"])[None])
        descriptors.append(d)
    return {"C": np.concatenate(C), "r": np.concatenate(r), "source": np.concatenate(groups),
            "regime": regime, "descriptors": descriptors, "support": t["support"]}


def _binomial_p(k: int, n: int, p: float) -> float:
    """Two-sided exact binomial test of k successes in n at rate p: the probability of an
    outcome no more likely than k."""
    pmf = [math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
                    + i * math.log(p) + (n - i) * math.log1p(-p)) for i in range(n + 1)]
    return float(min(1.0, sum(x for x in pmf if x <= pmf[k] * (1 + 1e-9))))


def _pct(half_log: np.ndarray) -> np.ndarray:
    """A log half-width as the mean of the interval's two relative half-widths, percent."""
    return (np.exp(half_log) - np.exp(-half_log)) / 2.0 * 100.0


def _rows(groups: dict, inside90, half90) -> list[str]:
    """A coverage table: per group its measurements, share inside the 90 % interval, the
    p-value of that share against 90 % (exact binomial) and the median half-width."""
    lines = ["| group | measurements | inside 90 % interval | binomial p vs 90 % | "
             "median half-width |", "|---|---:|---:|---:|---:|"]
    for name, sel in groups.items():
        if not sel.any():
            continue
        k, n = int(inside90[sel].sum()), int(sel.sum())
        lines.append(f"| {name} | {n} | {k / n * 100:.0f} % | {_binomial_p(k, n, 0.9):.2g} | "
                     f"{np.median(_pct(half90[sel])):.0f} % |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--no-write", action="store_true",
                    help="do not write efficiency.json / report.md")
    a = ap.parse_args(argv)
    t = residual_table()
    C, r, src = t["C"], t["r"], t["source"]
    model = fit_error_model(
        C, r, src, t["support"],
        basis=f"{r.size} residuals: calibrated rows leave-one-source-out, held-out training / "
              f"inference rows, serving simulations (calibration/fit_error_model.py)")
    cov = coverage_by_source(C, r, src, REPORT_LEVELS)
    j90 = REPORT_LEVELS.index(0.9)
    inside, half = cov["inside"][:, j90], cov["half_width"][:, j90]
    novelty = C[:, [COVARIATES.index(n) for n in NOVELTY]]
    in_support = ~(novelty > 0).any(axis=1)
    sources = sorted(set(src))
    per_source = {s: float(inside[src == s].mean()) for s in sources}
    summary = {
        "n": int(r.size), "coverage_90": float(inside.mean()),
        "coverage_90_mean_over_sources": float(np.mean(list(per_source.values()))),
        "sources_within_80_97": int(sum(0.8 <= v <= 0.97 for v in per_source.values())),
        "sources_consistent_with_90": int(sum(
            _binomial_p(int(inside[src == s].sum()), int((src == s).sum()), 0.9) >= 0.05
            for s in sources)),
        "sources": len(sources),
        "median_half_width_in_support_pct": float(np.median(_pct(half[in_support]))),
        "median_half_width_all_pct": float(np.median(_pct(half))),
        "per_source": per_source,
        "nominal_vs_empirical": {str(a_): float(cov["inside"][:, j].mean())
                                 for j, a_ in enumerate(REPORT_LEVELS)},
        "coef": dict(zip(COVARIATES, (round(float(x), 4) for x in model.coef))),
        "q90": model.quantile(0.9),
    }
    if a.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"{r.size} residuals, {len(sources)} sources; LOSO coverage of 90 % intervals "
              f"{summary['coverage_90']:.1%} (mean over sources "
              f"{summary['coverage_90_mean_over_sources']:.1%}); sources within 80-97 %: "
              f"{summary['sources_within_80_97']} of {len(sources)}; median half-width in "
              f"support {summary['median_half_width_in_support_pct']:.1f} %")
        for s, v in per_source.items():
            print(f"  {v:6.1%}  {int((src == s).sum()):5d}  {s}")
        print("  coef: " + ", ".join(f"{k}={v:+.3f}" for k, v in summary["coef"].items()
                                       if v))
    if a.no_write:
        return 0
    data = json.loads(EFFICIENCY.read_text())
    data.setdefault("uncertainty", {})["error_model"] = model.to_json()
    EFFICIENCY.write_text(json.dumps(data, indent=1) + "\n")
    _report(t, model, cov, summary, in_support)
    return 0


def _buckets(t: dict, in_support: np.ndarray) -> dict:
    C, names = t["C"], list(COVARIATES)
    col = lambda n: C[:, names.index(n)]  # noqa: E731
    out = {"inside the calibrated support (every novelty covariate 0)": in_support,
           "outside it (any novelty covariate > 0)": ~in_support}
    for n in NOVELTY:
        out[f"{n} > 0"] = col(n) > 0
    out["dense models"] = col("moe") == 0
    out["MoE models"] = col("moe") > 0
    out["host-issuing runtime (eager)"] = col("host_issuing") > 0
    out["small training GEMMs (< 100 GFLOP)"] = col("small_kernel") > 0
    served = np.array([d.quantity.startswith("serve") for d in t["descriptors"]])
    out["served by vLLM / SGLang (Python scheduler)"] = col("python_engine") > 0
    out["served by TensorRT-LLM / LMDeploy"] = served & (col("python_engine") == 0)
    train = np.array([d.kind == "train" for d in t["descriptors"]])
    out["multi-node training runs"] = (col("nodes") > 0) & train
    out["multi-node inference / serving"] = (col("nodes") > 0) & ~train
    return out


def _report(t, model, cov, summary, in_support) -> None:
    r, src = t["r"], t["source"]
    j90 = REPORT_LEVELS.index(0.9)
    inside, half = cov["inside"][:, j90], cov["half_width"][:, j90]
    q = lambda name: np.array([d.quantity == name for d in t["descriptors"]])  # noqa: E731
    lines = [
        "## Prediction intervals", "",
        "Generated by `python calibration/fit_error_model.py` from "
        "`calibration/residuals_training_inference.csv` (written by `calibration/refit.py`) "
        "and `calibration/residuals_serving.csv` (written by "
        "`calibration/serving_validation.py`). Method: `diffperf/calibrate/_error_model.py` "
        "(docstring) and `docs/accuracy.md`.", "",
        f"- {r.size} residuals log(predicted / measured), one per measurement, from "
        f"{len(set(src))} sources: calibrated rows predicted by the fit without their source, "
        "held-out training and inference tables (never fitted), and the serving simulator "
        "on published measurements under load (nothing fitted).",
        "- Coverage is **leave-one-source-out for the whole procedure**: for each source the "
        "error model (scales and conformal quantiles) is refitted without that source's "
        "residuals, and its residuals are scored against the intervals it then gives.",
        f"- Overall: {summary['coverage_90']:.1%} of measurements inside their 90 % interval "
        f"(mean over sources {summary['coverage_90_mean_over_sources']:.1%}); "
        f"{summary['sources_within_80_97']} of {summary['sources']} sources within 80-97 %; "
        f"{summary['sources_consistent_with_90']} of {summary['sources']} consistent with 90 % "
        "(two-sided exact binomial test, p >= 0.05: a 7-measurement source covered 7 times is). "
        f"Median half-width {summary['median_half_width_in_support_pct']:.1f} % inside the "
        f"calibrated support, {summary['median_half_width_all_pct']:.1f} % over all.", "",
        "### Nominal vs empirical coverage", "",
        "| nominal | " + " | ".join(f"{a:.0%}" for a in REPORT_LEVELS) + " |",
        "|---|" + "---:|" * len(REPORT_LEVELS),
        "| empirical (leave-one-source-out) | " + " | ".join(
            f"{cov['inside'][:, j].mean():.1%}" for j in range(len(REPORT_LEVELS))) + " |",
        "", "![coverage](coverage.png)", "", "### By source", ""]
    lines += _rows({s: src == s for s in sorted(set(src))}, inside, half)
    lines += ["", "### By regime and quantity", ""]
    regime = np.array(t["regime"])
    groups = {g: regime == g for g in sorted(set(regime))}
    groups.update({f"quantity {n}": q(n) for n in sorted({d.quantity
                                                           for d in t["descriptors"]})})
    lines += _rows(groups, inside, half)
    lines += ["", "### By covariate bucket", ""]
    lines += _rows(_buckets(t, in_support), inside, half)
    lines += ["", "### The shipped model", "",
              f"Fitted on all {r.size} residuals; conformal quantile of |r| / s at 90 %: "
              f"{model.quantile(0.9):.3f}. A coefficient is the change of log s per unit of "
              "its covariate; exp(coef) the factor on the width.", "",
              "| covariate | coefficient | width factor per unit |", "|---|---:|---:|"]
    lines += [f"| {n} | {b:+.3f} | {math.exp(b):.2f} |" for n, b in zip(COVARIATES, model.coef)]
    _replace_section(HERE / "report.md", "## Prediction intervals", lines)
    _plot(cov, t)


def _replace_section(path: Path, heading: str, lines: list[str]) -> None:
    """Put `lines` in place of the section of `path` that starts with `heading` (up to the
    next "## " heading), or at the end when there is none."""
    text = path.read_text().splitlines()
    start = next((i for i, t in enumerate(text) if t.strip() == heading), None)
    if start is None:
        text += [""] + lines
    else:
        end = next((i for i in range(start + 1, len(text)) if text[i].startswith("## ")),
                   len(text))
        text = text[:start] + lines + [""] + text[end:]
    path.write_text("\n".join(text).rstrip("\n") + "\n")


def _plot(cov, t) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kinds = np.array([("serving" if d.quantity.startswith("serve") else d.kind)
                      for d in t["descriptors"]])
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.plot([0.45, 1.0], [0.45, 1.0], "k--", lw=0.8, label="ideal")
    for name, sel in (("all", np.ones(kinds.size, bool)), ("training", kinds == "train"),
                      ("inference", kinds == "infer"), ("serving", kinds == "serving")):
        ax.plot(REPORT_LEVELS, cov["inside"][sel].mean(axis=0), "o-", label=name)
    ax.set_xlabel("nominal coverage")
    ax.set_ylabel("empirical coverage (leave-one-source-out)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(HERE / "coverage.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
