"""Calibration: synthetic recovery, loss gradient vs finite differences, determinism, CV folds,
malformed-CSV errors, prediction intervals, the CLI.

Everything that needs float64 runs in ONE subprocess (the library default stays float32 in the
test process) that compiles the loss once and reports JSON; the tests assert on that report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRAIN_CSV = ROOT / "benchmarks_data" / "train_calibration.csv"
INFER_CSV = ROOT / "benchmarks_data" / "infer_calibration.csv"

#: The factors the synthetic data is generated from (perturbed from the physical defaults).
TRUE = {"matmul_peak": 0.72, "attention": 0.45, "tp_overlap": 0.55, "kernel_overhead": 4e-6}
START = {"matmul_peak": 0.85, "attention": 0.60, "tp_overlap": 0.2, "kernel_overhead": 2e-6}

SCRIPT = textwrap.dedent(r'''
    import json, sys
    import numpy as np
    import pandas as pd
    from pathlib import Path
    from diffperf.internal import calibration as C
    from diffperf.internal import folds, twin_key
    from diffperf.validation import BenchmarkError
    from diffperf.specs import Efficiency
    tmp, train_csv = Path(sys.argv[1]), sys.argv[2]
    true, start = json.loads(sys.argv[3]), json.loads(sys.argv[4])
    out = {}

    # Malformed CSV: the error names the file, the row and the column (before x64 is enabled).
    df = pd.read_csv(train_csv, dtype=str, keep_default_na=False)
    bad = df.head(5).copy(); bad.loc[2, "hidden"] = "wide"
    bad_path = tmp / "bad.csv"; bad.to_csv(bad_path, index=False)
    try:
        C.calibrate(bad_path)
        out["malformed"] = None
    except BenchmarkError as e:
        out["malformed"] = str(e)
    import jax
    out["x64_after_error"] = bool(jax.config.jax_enable_x64)

    # Synthetic data: the model itself with the TRUE factors (float64) on 16 real train plans
    C.enable_x64()
    from diffperf.validation import predict_train_rows, read_benchmarks
    # Megatron 2022 rows (TP communication not overlapped) and NeMo rows (overlapped), so that
    # tp_overlap is identifiable.
    sel = df[df["id"].str.startswith(("imec-korthi", "nemo24.07"))].copy()
    sel = sel[~sel["id"].str.endswith("-paper")].head(16).reset_index(drop=True)
    src = tmp / "plans.csv"; sel.to_csv(src, index=False)
    eff_true = Efficiency(**true)
    preds, failed = predict_train_rows(read_benchmarks(src), eff_true)
    step = {r.id: p["step_time_s"] for r, p, _ in preds}
    for c in ("step_time_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu", "peak_memory_gb"):
        sel[c] = ""
    sel["step_time_s"] = [repr(step[i]) for i in sel["id"]]
    syn = tmp / "synthetic.csv"; sel.to_csv(syn, index=False)
    fields = sorted(true)
    fit = C.calibrate(syn, fields=fields, grouping={}, start=start, prior_weight=1e-12,
                      group_prior_weight=1e-12, adam_steps=30, lbfgs_steps=200)
    out["recovered"] = {f: fit.shared[f] for f in fields}
    out["synthetic_loss"] = fit.loss
    out["fit_seconds"] = fit.metadata["fit_seconds"]

    # Refit with the same compiled problem and from scratch data: identical.
    fit2 = C.calibrate(problem=fit.problem, fields=fields, start=start, adam_steps=30,
                       lbfgs_steps=200)
    out["refit_identical"] = bool(np.array_equal(fit.theta, fit2.theta)) and fit.loss == fit2.loss

    # Gradient of the loss vs central finite differences (float64), at a non-optimal point.
    pb = fit.problem
    w_t, w_i = pb.base_weights()
    theta = pb.par.theta_from(start)
    (v, _), g = pb.vg(theta[None], w_t[None], w_i[None])
    g = np.asarray(g[0])
    fd = []
    for j in range(theta.size):
        h = 1e-6 * max(1.0, abs(theta[j]))
        tp, tm = theta.copy(), theta.copy(); tp[j] += h; tm[j] -= h
        (vp, _), _ = pb.vg(tp[None], w_t[None], w_i[None])
        (vm, _), _ = pb.vg(tm[None], w_t[None], w_i[None])
        fd.append((float(vp[0]) - float(vm[0])) / (2 * h))
    out["grad"] = g.tolist(); out["grad_fd"] = fd

    # Prediction interval from this fit (Laplace covariance + model error).
    from diffperf.calibrate import prediction_interval
    from diffperf.validation import train_specs
    m, s, p = train_specs(read_benchmarks(syn)[0])
    from diffperf.training import train_step
    pi = prediction_interval(lambda e: train_step(m, s, p, e).step_time, fit, 0.9)
    out["interval"] = [pi.low, pi.value, pi.high, pi.format("s")]

    # CV folds on the full shipped data never split a row from its -paper twin.
    ds = C.build_dataset([train_csv, sys.argv[5]])
    twins_ok, n_folds = True, {}
    for kind in ("kfold", "source", "loo"):
        fl = folds(ds, kind)
        n_folds[kind] = len(fl)
        ids = [r.id for r in ds.train_rows]
        where = {}
        for name, tt, _ in fl:
            for i, flag in zip(ids, tt):
                if flag:
                    where.setdefault(twin_key(i), set()).add(name)
        twins_ok &= all(len(v) == 1 for v in where.values())
        twins_ok &= all(twin_key(i) in where for i in ids if i.endswith("-paper")) or kind == "loo"
    out["twins_ok"] = twins_ok; out["n_folds"] = n_folds

    # The CLI on the synthetic file, with k-fold CV.
    from diffperf.internal import add_calibrate_parser, run_calibrate
    import argparse
    ap = argparse.ArgumentParser(); sub = ap.add_subparsers()
    add_calibrate_parser(sub)
    fitted = tmp / "fitted.json"
    args = ap.parse_args(["calibrate", "--data", str(syn), "--out", str(fitted), "--cv", "kfold",
                          "--folds", "2", "--groups", "none", "--quiet",
                          "--fields", ",".join(fields), "--steps", "10",
                          "--prior-weight", "1e-12"])
    run_calibrate(args)
    out["cli_json"] = json.loads(fitted.read_text())
    print("@@" + json.dumps(out))
''')


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("calib")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp), str(TRAIN_CSV), json.dumps(TRUE),
         json.dumps(START), str(INFER_CSV)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")][-1]
    out = json.loads(line[2:])
    out["tmp"] = str(tmp)
    return out


@pytest.mark.slow
def test_malformed_csv_names_file_row_column(report):
    msg = report["malformed"]
    assert msg is not None
    assert "bad.csv" in msg and "row 3" in msg and "'hidden'" in msg
    assert report["x64_after_error"] is False  # failed before switching to float64


@pytest.mark.slow
def test_synthetic_recovery_within_one_percent(report):
    for f, v in TRUE.items():
        got = report["recovered"][f]
        assert abs(got - v) / v < 0.01, (f, got, v)
    assert report["synthetic_loss"] < 1e-8


@pytest.mark.slow
def test_refit_is_identical(report):
    assert report["refit_identical"]


@pytest.mark.slow
def test_loss_gradient_matches_finite_differences(report):
    import numpy as np
    g, fd = np.array(report["grad"]), np.array(report["grad_fd"])
    assert np.all(np.isfinite(g))
    assert np.allclose(g, fd, rtol=1e-4, atol=1e-8 * max(1.0, np.abs(g).max())), (g, fd)


@pytest.mark.slow
def test_prediction_interval_brackets_the_prediction(report):
    low, value, high, text = report["interval"]
    assert 0 < low < value < high
    assert "90% interval" in text and text.endswith(" s)")


@pytest.mark.slow
def test_cv_keeps_paper_twins_together(report):
    assert report["twins_ok"]
    assert report["n_folds"]["kfold"] == 5
    assert report["n_folds"]["loo"] == 11 + 22
    assert report["n_folds"]["source"] >= 12


@pytest.mark.slow
def test_cli_writes_loadable_fit(report):
    data = report["cli_json"]
    assert set(data) >= {"factors", "per_gpu", "metadata", "uncertainty", "crossval"}
    meta = data["metadata"]
    assert len(meta["data_sha256"]) == 64 and "kfold" in meta["cv_mape"]
    # With a CV that holds out every row, intervals carry the held-out (not in-sample) error.
    assert meta["residual_sd_basis"] == "cross-validated (kfold)"
    assert data["uncertainty"]["residual_sd"]["step_time"] > 0
    from diffperf.presets import efficiency_from_json
    eff = efficiency_from_json(Path(report["tmp"]) / "fitted.json")
    assert abs(float(eff.matmul_peak) - TRUE["matmul_peak"]) / TRUE["matmul_peak"] < 0.01


@pytest.mark.slow
def test_per_gpu_file_loads_and_validate_uses_row_gpu(tmp_path):
    from diffperf.presets import GpuEfficiency, efficiency_from_json
    from diffperf.validation import validate
    f = tmp_path / "fit.json"
    f.write_text(json.dumps({"factors": {"matmul_peak": 0.8},
                             "per_gpu": {"h100-sxm5-80gb": {"matmul_peak": 0.4}}}))
    eff = efficiency_from_json(f)
    assert isinstance(eff, GpuEfficiency)
    assert float(eff.matmul_peak) == pytest.approx(0.8)
    assert float(eff.for_gpu("h100-sxm5-80gb").matmul_peak) == pytest.approx(0.4)
    assert float(eff.for_gpu("a100-sxm4-80gb").matmul_peak) == pytest.approx(0.8)
    # A much slower H100 only changes the H100 rows.
    from diffperf.specs import Efficiency
    base = validate(str(TRAIN_CSV), Efficiency(matmul_peak=0.8))
    per = validate(str(TRAIN_CSV), eff)
    b = {(r["id"], r["metric"]): r["predicted"] for r in base["rows"]}
    gpu = {}
    import pandas as pd
    df = pd.read_csv(TRAIN_CSV)
    gpu = dict(zip(df["id"], df["gpu"]))
    for r in per["rows"]:
        same = r["predicted"] == pytest.approx(b[(r["id"], r["metric"])], rel=1e-6)
        assert same != (gpu[r["id"]] == "h100-sxm5-80gb"), r["id"]


def test_bad_per_gpu_file_is_a_clear_error(tmp_path):
    from diffperf.presets import efficiency_from_json
    f = tmp_path / "fit.json"
    f.write_text(json.dumps({"factors": {}, "per_gpu": {"tpu-v9": {"hbm": 0.5}}}))
    with pytest.raises(ValueError, match="unknown gpu 'tpu-v9'"):
        efficiency_from_json(f)
    f.write_text(json.dumps({"factors": {}, "per_gpu": {"b200": {"hbm": 1.5}}}))
    with pytest.raises(ValueError, match="hbm"):
        efficiency_from_json(f)


def test_a_gpu_without_fitted_factors_borrows_its_chips():
    """The H800 (an H100 with less NVLink) has no measured rows of its own: it takes the H100's
    fitted factors (`efficiency_of`); a GPU with neither gets the shared ones."""
    from diffperf.presets import default_efficiency
    h800, h100 = default_efficiency("h800-sxm5-80gb"), default_efficiency("h100-sxm5-80gb")
    shared = default_efficiency()
    for f in ("matmul_lowp", "hbm", "kernel_overhead"):
        assert float(getattr(h800, f)) == float(getattr(h100, f))
    assert float(h100.matmul_lowp) != float(shared.matmul_lowp)  # the H100 has its own
    v100 = default_efficiency("v100-sxm2-32gb")
    assert float(v100.matmul_lowp) == float(shared.matmul_lowp)


def test_default_efficiency_per_gpu():
    import diffperf as dp
    from diffperf.presets import default_efficiency
    shared = default_efficiency()
    assert isinstance(shared, dp.Efficiency)
    for g in dp.gpu_names():
        e = default_efficiency(g)
        assert type(e) is dp.Efficiency
        for f in ("matmul_peak", "hbm", "tp_overlap"):
            assert 0 < float(getattr(e, f)) <= 1


def test_source_groups_follow_the_source_column_for_user_rows():
    """Rows outside the shipped tables are grouped by their `source` column (an empty one: the
    id up to its first '-'), so leave-one-source-out on a user's file holds out whole sources;
    the shipped rows keep their table groups whatever their `source` cell says."""
    from types import SimpleNamespace

    from diffperf.internal import folds, source_group
    from diffperf.validation import BenchmarkRow
    row = lambda i, src: BenchmarkRow(i, "train", src, {}, {})  # noqa: E731
    ds = SimpleNamespace(train_rows=[row("gpt175", "cluster logs 2025"),
                                     row("llama8b", "cluster logs 2025"),
                                     row("run-a", ""), row("run-b", "")], infer_rows=[])
    groups = {name: list(mask) for name, mask, _ in folds(ds, "source")}
    assert groups == {"cluster logs 2025": [True, True, False, False],
                      "run": [False, False, True, True]}
    assert source_group("imec-korthi-22b-full", "Korthikanti 2022 Table 5") == "imec-korthi"


def test_a_system_id_gets_its_gpus_fitted_factors_and_a_typo_is_refused():
    """`--gpu dgx-h100` (a system id) used the shared factors while `--gpu h100-sxm5-80gb` used
    the H100's; a misspelt GPU silently fell back to the shared factors too."""
    from diffperf import presets
    table = presets.default_efficiency()
    for system_id, gpu in (("dgx-h100", "h100-sxm5-80gb"), ("gb200-nvl72", "gb200")):
        assert table.for_gpu(system_id) == table.for_gpu(gpu)
        assert presets.default_efficiency(system_id) == presets.default_efficiency(gpu)
    assert table.for_gpu("h100-sxm5-80gb") != table.for_gpu(None)
    with pytest.raises(ValueError, match="unknown gpu or system 'h100'"):
        presets.default_efficiency("h100")


@pytest.mark.slow
def test_calibrate_warns_about_impossible_rows_and_too_few_values(tmp_path):
    """A measurement 30x faster than the shipped Korthikanti 22B run cannot be real (it beats
    the ideal-hardware bound), and one value cannot determine two factors: the fit still runs
    (in its own process: calibrate switches on float64) but says both."""
    import pandas as pd
    df = pd.read_csv(TRAIN_CSV, dtype=str, keep_default_na=False)
    row = df[df["id"] == "imec-korthi-22b-full-paper"].copy()
    row["id"] = "too-fast"
    row["step_time_s"] = str(float(row["step_time_s"].iloc[0]) / 30.0)
    path = tmp_path / "too_fast.csv"
    row.to_csv(path, index=False)
    out = subprocess.run([sys.executable, "-m", "diffperf.cli", "calibrate", "--data", str(path),
                          "--fields", "matmul_peak", "--moe-holdout", "none", "--quiet",
                          "--no-uncertainty", "--out", str(tmp_path / "fit.json")],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "1 measured values for 2 parameters" in out.stderr
    assert "warning: row too-fast: step_time_s" in out.stderr and "fitted anyway" in out.stderr
