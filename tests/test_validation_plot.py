"""`diffperf validate --plot`: the picture shows the validation numbers, not others."""

from __future__ import annotations

import numpy as np
import pytest

from diffperf.cli import main
from diffperf.internal import CLIP_PCT
from diffperf.plots import validation_plot  # needs matplotlib ([dev] has it)

ROWS = [
    {"id": "imec-inf-a100-x", "metric": "e2e_latency_s", "measured": 2.0, "predicted": 2.2},
    {"id": "imec-inf-h100-y", "metric": "e2e_latency_s", "measured": 1.0, "predicted": 0.9},
    {"id": "nemo24.07-z", "metric": "tokens_per_s_per_gpu", "measured": 100.0, "predicted": 500.0},
]


def test_points_are_the_rows_measured_predicted_and_signed_errors(tmp_path):
    fig = validation_plot(ROWS, tmp_path / "v.png")
    parity, errors = fig.axes
    xy = np.concatenate([c.get_offsets() for c in parity.collections])
    assert sorted(map(tuple, xy)) == [(1.0, 0.9), (2.0, 2.2), (100.0, 500.0)]
    assert [t.get_text() for t in errors.get_xticklabels()] == ["imec-inf", "nemo24.07"]
    pts = np.concatenate([c.get_offsets() for c in errors.collections if len(c.get_offsets())])
    # +10 %, -10 % and +400 %, the last drawn at the clip as a triangle
    assert sorted(np.round(pts[:, 1], 9)) == [-10.0, 10.0, CLIP_PCT]
    assert np.all(np.abs(pts[pts[:, 1] < CLIP_PCT, 0] - 0) <= 0.25)  # imec-inf column at x = 0
    assert (tmp_path / "v.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_usable_row_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no row has a positive measured and predicted"):
        validation_plot([dict(ROWS[0], measured=0.0)], tmp_path / "v.png")


@pytest.mark.slow
def test_cli_validate_writes_the_plot(tmp_path, capsys):
    out = tmp_path / "validation.png"
    assert main(["validate", "--summary", "--data", "benchmarks_data/infer_calibration.csv",
                 "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out}" in capsys.readouterr().err
