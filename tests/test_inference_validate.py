"""The inference model against the published inference rows of benchmarks_data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from diffperf.specs import Efficiency
from diffperf.validation import predict_infer_rows, read_benchmarks

CSV = Path(__file__).resolve().parents[1] / "benchmarks_data" / "infer_calibration.csv"
#: Measured MAPE on the 22 imec-inf-* rows with the physical defaults `Efficiency()`: 8.4 %.
IMEC_MAPE_BOUND = 12.0


@pytest.fixture(scope="module")
def predictions():
    if not CSV.exists():
        pytest.skip("benchmarks_data/infer_calibration.csv not present")
    rows = [r for r in read_benchmarks(CSV) if r.kind == "infer"]
    preds, failed = predict_infer_rows(rows, Efficiency())
    return rows, preds, failed


def test_every_infer_row_is_evaluated(predictions):
    rows, preds, failed = predictions
    assert not failed, failed
    assert len(preds) == len(rows)
    for row, pred, _ in preds:
        for metric in row.measured:
            assert np.isfinite(pred[metric]) and pred[metric] > 0, (row.id, metric)


def test_imec_llama2_latency_mape(predictions):
    _, preds, _ = predictions
    apes = [abs(p["e2e_latency_s"] - r.measured["e2e_latency_s"]) / r.measured["e2e_latency_s"]
            for r, p, _ in preds if r.id.startswith("imec-inf-")]
    assert len(apes) == 22
    assert 100 * np.mean(apes) < IMEC_MAPE_BOUND


def test_invalid_rows_fail_cleanly(predictions):
    rows, _, _ = predictions
    row = rows[0]
    bad = type(row)(row.id + "-bad", row.kind, row.source, row.measured,
                    dict(row.values, num_gpus=row.values["num_gpus"] + 1))
    tp3 = type(row)(row.id + "-tp3", row.kind, row.source, row.measured,
                    dict(row.values, tp=3, num_gpus=3))
    preds, failed = predict_infer_rows([bad, tp3, row], Efficiency())
    assert [p[0].id for p in preds] == [row.id]
    errors = {f["id"]: f["error"] for f in failed}
    assert "num_gpus" in errors[bad.id] and "heads" in errors[tp3.id]
