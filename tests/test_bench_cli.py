"""`diffperf bench cli`: a few rows of the shipped CSVs, fresh processes, refusals."""

from __future__ import annotations

import csv

import pytest

from diffperf.cli import _bench as bench, main
from diffperf.cli._common import BENCHMARKS


def test_few_rows_keeps_the_header_and_the_first_rows(tmp_path):
    path = bench._few_rows(BENCHMARKS / "train_calibration.csv", tmp_path / "t.csv", rows=3)
    with open(BENCHMARKS / "train_calibration.csv", newline="") as fh:
        shipped = [r for r in csv.reader(fh) if r and not r[0].startswith("#")][:4]
    with open(path, newline="") as fh:
        assert list(csv.reader(fh)) == shipped


def test_refusals(capsys, tmp_path):
    assert main(["bench", "cli", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
    assert main(["bench", "cli", "--against", str(tmp_path)]) == 2
    assert "not a source tree" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_benchmark_times_fresh_processes(monkeypatch):
    monkeypatch.setattr(bench, "CLI_COMMANDS", {"import diffperf": ["-c", "import diffperf"]})
    r = bench.cli_benchmark(repeats=2, log=None)
    t = r["this"]["import diffperf"]
    assert len(t["runs_s"]) == 2 and 0 < t["min_s"] <= t["median_s"] <= t["max_s"]
    assert t["cpu_median_s"] > 0
