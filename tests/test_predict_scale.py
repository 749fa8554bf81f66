"""Benchmark rows at scale (issue 41, items 9 and 10): specs built a chunk of rows at a time,
rows evaluated in chunks of one compiled shape, progress on stderr for long runs, a validation
summary that counts its flags, and a calibration whose default command reproduces the shipped
fit."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from diffperf.validation import (
    _infer_rows as IR,
    _stack as S,
    _train_rows as TR,
    read_benchmark_files,
)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks_data"
SHIPPED = [DATA / f for f in ("train_calibration.csv", "infer_calibration.csv",
                              "train_moe_holdout.csv", "infer_trtllm10_holdout.csv")]


def _with_invalid_rows(rows):
    """The rows and, after every ninth, a copy broken in a way only a spec class or a check of
    `train_specs` / `infer_specs` sees (so that the batched build must find it)."""
    breaks = (lambda v: {"kv_heads": 7.0}, lambda v: {"heads": 3.0},
              lambda v: {"gpus_per_node": 0.0}, lambda v: {"num_gpus": v["num_gpus"] + 1},
              lambda v: {"recompute_layers": 1000.0})
    out = []
    for i, r in enumerate(rows):
        out.append(r)
        if i % 9 == 4:
            change = breaks[(i // 9) % len(breaks)](r.values)
            out.append(dataclasses.replace(r, id=f"{r.id}~bad", values={**r.values, **change}))
    return out


@pytest.mark.parametrize("kind", ["train", "infer"])
def test_specs_built_in_batches_equal_the_single_rows(kind, monkeypatch):
    """`stacked_*_specs` build a batch of rows per call (row by row, 100,000 rows took
    minutes); the result is the row-by-row stack leaf for leaf (values, dtypes), and every
    invalid row fails with the message of its own `train_specs` / `infer_specs`."""
    monkeypatch.setattr(S, "STACK_ROWS", 64)  # several batches, some with invalid rows
    rows = _with_invalid_rows([r for r in read_benchmark_files(SHIPPED) if r.kind == kind])
    one, stacked = ((TR.train_specs, TR.stacked_train_specs) if kind == "train"
                    else (IR.infer_specs, IR.stacked_infer_specs))
    calls = []
    batched = TR.batched_train_specs if kind == "train" else IR.batched_infer_specs
    monkeypatch.setattr(TR if kind == "train" else IR, f"batched_{kind}_specs",
                        lambda rs: calls.append(len(rs)) or batched(rs))
    got = stacked(rows)
    ok, specs, failed = [], [], []
    for r in rows:
        try:
            specs.append(one(r))
            ok.append(r.id)
        except ValueError as e:
            failed.append({"id": r.id, "error": str(e)})
    assert len(failed) >= 10 and [r.id for r in got.rows] == ok and got.failed == failed
    want = tuple(S.stack([s[i] for s in specs]) for i in range(3))
    leaves, tree = jax.tree.flatten((got.models, got.systems, got.plans))
    leaves_want, tree_want = jax.tree.flatten(want)
    assert tree == tree_want
    for a, b in zip(leaves, leaves_want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(calls) < len(rows) / 2  # a batch per run of valid rows, halved where invalid
    calls.clear()
    valid = [r for r in rows if not r.id.endswith("~bad")]
    stacked(valid)
    n = len(valid)
    assert calls == [64] * (n // 64) + ([n % 64] if n % 64 else [])  # one call per batch


def test_chunks_have_one_shape_and_cover_every_row_once():
    seen = []
    for start, stop, index in S.chunks(21, 8):
        assert index.shape == (8,) and list(index[:stop - start]) == list(range(start, stop))
        assert set(index[stop - start:]) <= {stop - 1}  # padding repeats the last row
        seen += list(range(start, stop))
    assert seen == list(range(21))
    assert S.chunk_rows(3, 4096) == 8 and S.chunk_rows(130, 4096) == 256
    assert S.chunk_rows(100_000, 4096) == 4096


def test_progress_reports_long_runs_and_stays_quiet_for_short_ones():
    out = io.StringIO()
    bar = S.Progress(min_rows=100, every=0.0, stream=out)
    bar.start(1000, "training rows", "compiling the model first")
    for done in (250, 500, 1000):
        bar.update(done)
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("training rows: 1,000 rows (compiling the model first)...")
    assert "500/1,000 rows (50%)" in lines[2] and "rows/s" in lines[2] and "s left" in lines[2]
    assert "1,000/1,000 rows (100%)" in lines[-1] and "left" not in lines[-1]
    quiet = io.StringIO()
    small = S.Progress(min_rows=100, every=0.0, stream=quiet)
    small.start(99, "training rows")
    small.update(99)
    assert quiet.getvalue() == ""


@pytest.mark.slow
def test_rows_evaluated_in_chunks_of_one_shape_equal_one_evaluation(monkeypatch, tmp_path):
    """`predict_csv` evaluates each kind in chunks of `CHUNK_ROWS` rows, every call with the
    same shape (the last chunk padded), and gets exactly what one call over all rows gives;
    training notes are found in every chunk, and a long run reports its stages."""
    from diffperf.calibrate import predict_csv
    rows = read_benchmark_files(SHIPPED[:2])
    ids = [r.id for r in rows if r.kind == "train"][:23] + [
        r.id for r in rows if r.kind == "infer"][:21]
    import pandas as pd
    table = pd.concat([pd.read_csv(p, dtype=str, keep_default_na=False) for p in SHIPPED[:2]])
    table = table[table["id"].isin(ids)]
    uneven = table[table["pp"].astype(float) > 1].iloc[-1:].copy()  # in the last chunk:
    uneven["id"] = "uneven"  # one layer more than pp * vp divides, a training note
    uneven["layers"] = str(int(uneven["layers"].iloc[0]) + 1)
    path = tmp_path / "rows.csv"
    pd.concat([table, uneven]).to_csv(path, index=False)
    whole = predict_csv(path)
    shapes = {"train": [], "infer": []}
    for mod, name, kind in ((TR, "_train_batch", "train"), (IR, "_infer_batch", "infer")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, fn=fn, kind=kind: (
            shapes[kind].append(jax.tree.leaves(a[0])[0].shape[0]) or fn(*a)))
    monkeypatch.setattr(S, "CHUNK_ROWS", 8)
    out = io.StringIO()
    chunked = predict_csv(path, progress=S.Progress(min_rows=1, every=0.0, stream=out))
    assert shapes == {"train": [8, 8, 8], "infer": [8, 8, 8]}  # 24 and 21 rows
    pd.testing.assert_frame_equal(chunked, whole, check_exact=False, rtol=1e-12)
    assert "note: uneven layout" in chunked.set_index("id").loc["uneven", "status"]
    text = out.getvalue()
    assert "train rows: building specs: 24 rows" in text and "inference rows: 21/21 rows" in text


@pytest.mark.slow
def test_chunked_intervals_equal_the_one_jacobian_intervals(monkeypatch, tmp_path):
    """Prediction intervals are evaluated `INTERVAL_CHUNK_ROWS` rows at a time (one Jacobian of
    all rows would hold ~60 tangents of every row at once); each row's interval is the one
    `row_intervals` gives from a single Jacobian of all rows (float32: to rounding)."""
    from diffperf.calibrate import _batch_predict as BP
    from diffperf.calibrate._error_data import row_descriptor
    from diffperf.calibrate._uncertainty import decode_quantity, row_intervals
    from diffperf.inference import infer
    rows = [r for r in read_benchmark_files([SHIPPED[1]]) if r.kind == "infer"][:19]
    st = IR.stacked_infer_specs(rows)
    monkeypatch.setattr(BP, "INTERVAL_CHUNK_ROWS", 8)
    got = BP._intervals("infer", st, None)
    ms, ss, ps = st.models, st.systems, st.plans
    _, low, high, keys = row_intervals(
        lambda e: jax.vmap(infer)(ms, ss, ps, e).e2e_latency, [r.values["gpu"] for r in rows],
        [row_descriptor(r, decode_quantity(r.values["batch"], r.values["output_len"]))
         for r in rows], "infer")
    for r, lo, hi, k in zip(rows, low, high, keys):
        assert got[r.id][2] == k
        assert got[r.id][0] == pytest.approx(lo, rel=2e-6)
        assert got[r.id][1] == pytest.approx(hi, rel=2e-6)


def _flags(n: int, kind: str) -> list[dict]:
    if kind == "implausible":
        return [{"id": f"fast{i}", "metric": "step_time_s", "measured": 1.0, "bound": 2.0,
                 "factor": 1.4 + i / 100, "warning": f"step_time_s is {1.4 + i / 100:.3g}x "
                                                     f"beyond the ideal-hardware bound"}
                for i in range(n)]
    return [{"id": f"unit{i}", "metric": "ttft_s", "ratio": 20.0 + i,
             "warning": f"ttft_s is {20 + i}x off the prediction: a unit mix-up (ms for s?)"}
            for i in range(n)]


def test_validate_summary_counts_flags_instead_of_a_line_per_row(capsys):
    """40 implausible and 30 suspect measurements, 15 kinds of failure: the summary counts
    each kind of flag and shows the most extreme few, not one line per row (a 100,000-row
    file printed 38,384 lines); a handful is still listed in full."""
    from diffperf.cli._main import FAILURE_KINDS, FLAG_EXAMPLES, print_validation_summary
    failed = [{"id": f"r{i}", "error": f"tp*pp*dp*cp = {8 + i} does not equal num_gpus = 8"}
              for i in range(15)] + [{"id": "r99", "error": "tp*pp*dp*cp = 8 does not equal "
                                                           "num_gpus = 8"}]
    result = {"summary": {"step_time_s": {"n": 70, "mape": 10.0, "max_ape": 90.0}},
              "failed": failed, "warnings": [], "defaults": [], "rows": [],
              "implausible": _flags(40, "implausible"), "suspect_units": _flags(30, "suspect")}
    print_validation_summary(result, ["big.csv"])
    out = capsys.readouterr().out.splitlines()
    assert len(out) <= 2 + 1 + FAILURE_KINDS + 1 + 2 * (1 + FLAG_EXAMPLES)
    assert any(line.startswith("  implausible measurements: 40 (") for line in out)
    assert any(line.startswith("  suspect measurements: 30 (") for line in out)
    examples = [line.strip().split(":")[0] for line in out if line.startswith("    fast")]
    assert examples == ["fast39", "fast38", "fast37"]  # the most extreme first
    assert "    ... 5 more kinds (5 rows): see --json failed" in out
    assert out[out.index("  failed rows: 16") + 1].startswith("      2 x tp*pp*dp*cp = 8 ")
    result.update(implausible=_flags(2, "implausible"), suspect_units=[], failed=[])
    print_validation_summary(result, ["small.csv"])
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[1].strip() for line in out if "implausible" in line] == [
        "fast0", "fast1"]


def test_calibrate_says_what_it_does_before_compiling(monkeypatch, capsys):
    """The first progress lines come before the dataset is built and compiled (a 100,000-row
    file ran 523 s before its first line): reading, then building the specs of N rows."""
    from diffperf.calibrate import _fit
    from diffperf.cli._calibrate import _Progress
    stages = []

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(_fit, "build_dataset", stop)
    with pytest.raises(Stop):
        _fit.calibrate(SHIPPED[:2], progress=lambda *a: stages.append(a[:3]))
    n = len(read_benchmark_files(SHIPPED[:2]))
    assert stages == [("read", 0, 1), ("specs", 0, n)]
    bar = _Progress(quiet=False)
    bar("read", 0, 1, math.nan)
    bar("specs", 0, 100_000, math.nan)
    err = capsys.readouterr().err
    assert "reading the benchmark rows" in err and "building the specs of 100,000 rows" in err


def _refit_settings() -> dict:
    """`SETTINGS` of calibration/refit.py: how the shipped fit was made."""
    spec = importlib.util.spec_from_file_location("refit", ROOT / "calibration" / "refit.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SETTINGS


def test_calibrate_defaults_are_the_shipped_fits_settings():
    """`diffperf calibrate --out F` fits as calibration/refit.py fitted the shipped file: the
    same source balance, steps and priors, and leave-one-source-out model errors."""
    import argparse
    import inspect

    from diffperf.calibrate._fit import calibrate
    from diffperf.cli._calibrate import add_calibrate_parser
    parser = argparse.ArgumentParser()
    add_calibrate_parser(parser.add_subparsers())
    args = parser.parse_args(["calibrate", "--out", "x.json"])
    settings = _refit_settings()
    api = inspect.signature(calibrate).parameters
    assert args.balance == settings["balance"]
    assert (args.steps, args.lbfgs_steps) == (settings["adam_steps"], settings["lbfgs_steps"])
    assert args.prior_weight is None and api["prior_weight"].default == settings["prior_weight"]
    assert api["group_prior_weight"].default == settings["group_prior_weight"]
    assert args.cv == "auto"  # source: the shipped data has more than one source


@pytest.mark.slow
def test_the_documented_calibrate_command_reproduces_the_shipped_fit(tmp_path):
    """docs/accuracy.md's `diffperf calibrate --out fitted.json` writes the shipped
    presets/efficiency.json: its factors and its uncertainty section (leave-one-source-out
    model errors; the error model's residuals are those `calibration/refit.py` writes, to which
    `calibration/fit_error_model.py` adds the serving simulator's before fitting the shipped
    error model). Fails when the model changed since the shipped fit: refit it (`python
    calibration/refit.py`, then `calibration/fit_error_model.py`)."""
    out = tmp_path / "fitted.json"  # in its own process: the fit switches on float64, and
    # optax's Adam mixes a Python float with an int32 count (refused by the tests' strict
    # promotion)
    run = subprocess.run([sys.executable, "-m", "diffperf.cli", "calibrate", "--out", str(out),
                          "--quiet"], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(out.read_text())
    shipped = json.loads((ROOT / "diffperf" / "presets" / "efficiency.json").read_text())

    def close(a, b, where, rel):
        if isinstance(a, dict):
            assert set(a) == set(b), where
            for k in a:
                close(a[k], b[k], f"{where}.{k}", rel)
        elif isinstance(a, list):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                close(x, y, f"{where}[{i}]", rel)
        elif isinstance(a, float):
            assert a == pytest.approx(b, rel=rel, abs=1e-300), (
                f"{where}: the command's fit differs from the shipped one; if the model changed "
                f"on purpose, refit the shipped file: python calibration/refit.py")
        else:
            assert a == b, where

    # The optimum to 1e-12 (a refit on the same code is bit-identical; 1e-14 is the drift of
    # float64 rounding between commits that leave the model alone).
    close(got["factors"], shipped["factors"], "factors", 1e-12)
    close(got["per_gpu"], shipped["per_gpu"], "per_gpu", 1e-12)
    unc, want = got["uncertainty"], shipped["uncertainty"]
    assert set(unc) == set(want)
    for key in set(want) - {"theta", "covariance", "residual_sd", "error_model"}:
        close(unc[key], want[key], key, 1e-12)
    residuals = ROOT / "calibration" / "residuals_training_inference.csv"
    assert unc["error_model"]["n"] == len(residuals.read_text().splitlines()) - 1
    close(unc["error_model"]["support"], want["error_model"]["support"], "support", 1e-12)
    np.testing.assert_allclose(unc["theta"], want["theta"], rtol=0, atol=1e-12)
    cov, cov_want = np.array(unc["covariance"]), np.array(want["covariance"])
    scale = np.sqrt(np.outer(np.diag(cov_want), np.diag(cov_want)))  # sd_i sd_j
    assert np.max(np.abs(cov - cov_want) / scale) < 1e-8  # finite-difference Hessian
    close(unc["residual_sd"], want["residual_sd"], "residual_sd", 1e-10)
    assert got["metadata"]["residual_sd_basis"] == "cross-validated (source)"
