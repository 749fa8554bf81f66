"""`diffperf predict` / `diffperf.calibrate.predict_csv`: every listed configuration predicted, as
`validate` would predict it, without needing measurements."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from diffperf.calibrate import predict_csv
from diffperf.cli import main
from diffperf.internal import COLUMNS
from diffperf.validation import validate

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = [ROOT / "benchmarks_data" / "train_calibration.csv",
           ROOT / "benchmarks_data" / "infer_calibration.csv"]
MEASURED = ("step_time_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu", "e2e_latency_s",
            "ttft_s", "tpot_s", "output_tok_s_per_gpu", "peak_memory_gb")


@pytest.mark.slow
def test_predictions_equal_validates_on_the_shipped_rows():
    """Same rows, same factors: every value `validate` compares is the value `predict` lists."""
    df = predict_csv(SHIPPED).set_index("id")
    result = validate(SHIPPED)
    assert len(result["rows"]) > 300
    for r in result["rows"]:
        assert df.loc[r["id"], r["metric"]] == pytest.approx(r["predicted"], rel=1e-9)
    assert (df["status"] == "ok").all() and df["fits"].all()


@pytest.fixture()
def configs(tmp_path):
    """The shipped Korthikanti 175B row and a Llama-2 latency row with their measurements
    removed, the 175B row with tp 5 (invalid) and on 8 GPUs (does not fit)."""
    rows = {}
    for path in SHIPPED:
        with open(path, newline="") as f:
            for rec in csv.DictReader(f):
                rows[rec["id"]] = rec
    train = dict(rows["imec-korthi-175b-selsp-paper"])
    infer = dict(rows["imec-inf-h100-llama-2-70b-tp4"])
    for rec in (train, infer):
        for c in MEASURED:
            if c in rec:
                rec[c] = ""
    invalid = dict(train, id="tp5", tp="5", num_gpus="40")
    squeezed = dict(train, id="on-8-gpus", num_gpus="8", pp="1", vp="1", global_batch="8")
    header = list(dict.fromkeys([*train, *infer]))
    path = tmp_path / "configs.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header, restval="")
        w.writeheader()
        for rec in (train, infer, invalid, squeezed):
            w.writerow(rec)
    return path


@pytest.mark.slow
def test_rows_without_measurements_are_predicted_and_explained(configs):
    df = predict_csv(configs).set_index("id")
    assert list(df.reset_index().columns) == list(COLUMNS)
    train, infer = df.loc["imec-korthi-175b-selsp-paper"], df.loc["imec-inf-h100-llama-2-70b-tp4"]
    assert train["status"] == "ok" and 10 < train["step_time_s"] < 20  # paper: 13.75 s
    assert pd.isna(train["ttft_s"]) and pd.isna(infer["step_time_s"])
    assert infer["status"] == "ok" and 1 < infer["e2e_latency_s"] < 10
    assert 0 < infer["ttft_s"] < infer["e2e_latency_s"]
    assert df.loc["tp5", "status"] == "invalid: tp does not divide heads (tp=5, heads=96)"
    assert pd.isna(df.loc["tp5", "step_time_s"]) and pd.isna(df.loc["tp5", "fits"])
    squeezed = df.loc["on-8-gpus"]
    assert not squeezed["fits"] and squeezed["status"].startswith("does not fit in HBM")
    assert squeezed["peak_memory_gb"] > 80 and np.isfinite(squeezed["step_time_s"])


@pytest.mark.slow
def test_cli_writes_csv_and_json_without_nan(configs, tmp_path, capsys):
    out = tmp_path / "pred.csv"
    assert main(["predict", "--data", str(configs), "--out", str(out)]) == 0
    written = pd.read_csv(out)
    assert list(written["id"]) == ["imec-korthi-175b-selsp-paper",
                                   "imec-inf-h100-llama-2-70b-tp4", "tp5", "on-8-gpus"]
    capsys.readouterr()
    assert main(["predict", "--data", str(configs), "--json"]) == 0
    text = capsys.readouterr().out
    assert "NaN" not in text and "Infinity" not in text
    rows = json.loads(text)["rows"]
    assert rows[2]["step_time_s"] is None and rows[2]["status"].startswith("invalid")
    assert main(["predict", "--data", str(configs)]) == 0
    table = capsys.readouterr().out
    assert "invalid: tp does not divide heads" in table and "does not fit in HBM" in table


@pytest.mark.slow
def test_cli_fails_when_no_row_can_be_evaluated_and_checks_the_output_name(configs, tmp_path,
                                                                            capsys):
    only_bad = tmp_path / "bad.csv"
    df = pd.read_csv(configs, dtype=str, keep_default_na=False)
    df[df["id"] == "tp5"].to_csv(only_bad, index=False)
    assert main(["predict", "--data", str(only_bad)]) == 2
    assert main(["predict", "--data", str(configs), "--out", str(tmp_path / "p.txt")]) == 2
    assert "--out: use a .csv file name" in capsys.readouterr().err


@pytest.mark.slow
def test_a_write_failure_names_the_output_option(configs, tmp_path, capsys, monkeypatch):
    """A full disk reports no file name; the error still says which option's file failed."""
    import errno

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pd.DataFrame, "to_csv", full_disk)
    out = tmp_path / "pred.csv"
    assert main(["predict", "--data", str(configs), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --out {out}: [Errno {errno.ENOSPC}] No space left on device")


@pytest.mark.slow
def test_row_intervals_equal_the_single_configuration_interval(configs, tmp_path):
    """The batched delta method (one Jacobian for all rows) gives each row the interval that
    `prediction_interval` (one gradient per configuration, what `train --interval` prints)
    gives it; an efficiency file without uncertainty leaves the rows predicted, with the reason
    in their status."""
    import diffperf as dp
    from diffperf.calibrate import prediction_interval
    from diffperf.validation import read_benchmarks, train_specs
    df = predict_csv(configs, intervals=True).set_index("id")
    row = df.loc["imec-korthi-175b-selsp-paper"]
    from diffperf.calibrate._error_data import row_descriptor
    first_row = read_benchmarks(configs, require_measured=False)[0]
    m, s, p = train_specs(first_row)
    single = prediction_interval(lambda e: dp.train_step(m, s, p, e).step_time, None, 0.9,
                                 "a100-sxm4-80gb", "train",
                                 descriptor=row_descriptor(first_row, "step_time"))
    assert row["interval_low_s"] == pytest.approx(single.low, rel=1e-4)
    assert row["interval_high_s"] == pytest.approx(single.high, rel=1e-4)
    infer = df.loc["imec-inf-h100-llama-2-70b-tp4"]
    assert infer["interval_low_s"] < infer["e2e_latency_s"] < infer["interval_high_s"]
    assert pd.isna(df.loc["tp5", "interval_low_s"])
    # the same row with one output token: its latency is a first-token latency, with that
    # quantity's (larger) model error
    from diffperf.inference import infer as infer_fn
    from diffperf.validation import infer_specs
    one = tmp_path / "one_token.csv"
    with open(configs, newline="") as f:
        recs = list(csv.DictReader(f))
    rec = dict(next(r for r in recs if r["id"] == "imec-inf-h100-llama-2-70b-tp4"), id="one",
               output_len="1")
    with open(one, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rec))
        w.writeheader()
        w.writerow(rec)
    first = predict_csv(one, intervals=True).set_index("id").loc["one"]
    one_row = read_benchmarks(one, require_measured=False)[0]
    m1, s1, p1 = infer_specs(one_row)
    single = prediction_interval(lambda e: infer_fn(m1, s1, p1, e).e2e_latency, None, 0.9,
                                 "h100-sxm5-80gb", "infer",
                                 descriptor=row_descriptor(one_row, "ttft"))
    assert first["interval_low_s"] == pytest.approx(single.low, rel=1e-4)
    assert first["interval_high_s"] == pytest.approx(single.high, rel=1e-4)

    bare = tmp_path / "factors_only.json"
    bare.write_text(json.dumps({"factors": {"hbm": 0.8}}))
    df = predict_csv(configs, dp.presets.efficiency_from_json(bare), intervals=True, fit=bare)
    ok = df[df["id"] == "imec-korthi-175b-selsp-paper"].iloc[0]
    assert np.isfinite(ok["step_time_s"]) and pd.isna(ok["interval_low_s"])
    assert "no interval (" in ok["status"] and "no uncertainty section" in ok["status"]


@pytest.mark.slow
def test_cli_interval_column(configs, capsys, tmp_path):
    out = tmp_path / "pred.csv"
    assert main(["predict", "--data", str(configs), "--interval", "--out", str(out)]) == 0
    df = pd.read_csv(out).set_index("id")
    row = df.loc["imec-korthi-175b-selsp-paper"]
    assert row["interval_low_s"] < row["step_time_s"] < row["interval_high_s"]
    capsys.readouterr()
    assert main(["predict", "--data", str(configs), "--interval"]) == 0
    table = capsys.readouterr().out
    assert "90% interval (s)" in table and " to " in table


def test_an_id_used_in_two_files_is_an_error(configs, tmp_path):
    """Results are reported by row id: the same id in two --data files would show one row's
    prediction for both, so it is refused, naming the file, row and the other file."""
    from diffperf.validation import BenchmarkError
    with pytest.raises(BenchmarkError) as info:
        predict_csv([configs, configs])
    assert "row 1, column 'id'" in str(info.value) and "is also an id in" in str(info.value)
    with pytest.raises(BenchmarkError, match="unique across the files"):
        validate([SHIPPED[0], SHIPPED[0]])


def test_a_row_without_a_finite_prediction_does_not_stop_the_others(configs, tmp_path):
    """A row whose sizes overflow the float32 model gets an `invalid` status; the other rows
    are still predicted (and no NaN or inf reaches the table)."""
    df = pd.read_csv(configs, dtype=str, keep_default_na=False)
    huge = df.iloc[1].copy()
    huge["id"] = "huge"
    for c in ("layers", "hidden", "ffn_hidden", "vocab", "batch"):
        huge[c] = "16777216"
    huge["heads"] = huge["kv_heads"] = huge["tp"] = huge["pp"] = huge["num_gpus"] = "1"
    huge["input_len"] = huge["output_len"] = "8000000"
    path = tmp_path / "huge.csv"
    pd.concat([df, huge.to_frame().T]).to_csv(path, index=False)
    import jax
    # float32, as a fresh process runs: a calibration earlier in this worker enables float64,
    # in which these sizes do not overflow
    x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        out = predict_csv(path).set_index("id")
    finally:
        jax.config.update("jax_enable_x64", x64)
    assert out.loc["huge", "status"].startswith("invalid: no finite prediction for")
    assert out.loc["huge", ["e2e_latency_s", "ttft_s"]].isna().all()
    assert out.loc["imec-korthi-175b-selsp-paper", "status"] == "ok"
    predicted = out[out["status"] == "ok"][["step_time_s", "e2e_latency_s"]].to_numpy(float)
    assert np.isfinite(predicted[~np.isnan(predicted)]).all()


def test_predict_notes_what_train_notes(configs, tmp_path):
    """A row with an uneven pipeline layout (96 layers over pp 8 x vp 5) or ZeRO-3 with pp 8 is
    predicted, and its status carries the caveat `diffperf train` prints for the same plan."""
    df = pd.read_csv(configs, dtype=str, keep_default_na=False).iloc[:1]
    uneven = df.assign(id="uneven", vp="5")
    zero3 = df.assign(id="zero3", zero="3", vp="1")
    path = tmp_path / "noted.csv"
    pd.concat([df, uneven, zero3]).to_csv(path, index=False)
    out = predict_csv(path).set_index("id")
    assert out.loc["imec-korthi-175b-selsp-paper", "status"] == "ok"
    assert "note: uneven layout: 96 layers over pp*vp = 40" in out.loc["uneven", "status"]
    assert "note: ZeRO-3 with pp > 1" in out.loc["zero3", "status"]
