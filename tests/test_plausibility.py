"""The ideal-hardware bound of a benchmark row and the measurements that beat it."""

from __future__ import annotations

import dataclasses

import pytest

from diffperf.internal import SLACK
from diffperf.validation import (
    ideal_bounds,
    implausible_measurements,
    predict_train_rows,
    read_benchmarks,
)

TRAIN = "benchmarks_data/train_calibration.csv"
INFER = "benchmarks_data/infer_calibration.csv"
MIXTRAL = "trtllm090-tput-a100-mixtral-8x7b-tp2-b32-2048x2048"


@pytest.fixture(scope="module")
def rows():
    return read_benchmarks(TRAIN) + read_benchmarks(INFER)


@pytest.fixture(scope="module")
def bounds(rows):
    return ideal_bounds(rows)


@pytest.mark.slow
def test_ideal_hardware_is_never_slower_than_the_calibrated_model(rows, bounds):
    train = [r for r in rows if r.kind == "train"]
    predicted, failed = predict_train_rows(train)
    assert not failed
    for row, pred, _ in predicted:
        b = bounds[row.id]
        assert b["step_time_s"] <= pred["step_time_s"], row.id
        assert b["tokens_per_s_per_gpu"] >= pred["tokens_per_s_per_gpu"], row.id


@pytest.mark.slow
def test_ideal_inference_is_never_slower_than_the_calibrated_model(rows, bounds):
    from diffperf.validation import predict_infer_rows
    predicted, failed = predict_infer_rows([r for r in rows if r.kind == "infer"])
    assert not failed
    for row, pred, _ in predicted:
        b = bounds[row.id]
        for col in ("e2e_latency_s", "ttft_s", "tpot_s"):
            assert b[col] <= pred[col], (row.id, col)
        assert b["output_tok_s_per_gpu"] >= pred["output_tok_s_per_gpu"], row.id


def test_slack_is_the_largest_overshoot_of_the_nested_smooth_maximum():
    """A GEMM's time smooth_max(smooth_max(compute, HBM, 0.3), L2, 0.1) exceeds the largest of
    the three by at most 1.339x (scanned); SLACK adds the overlap smoothing's 0.05 on top."""
    import numpy as np

    from diffperf.costs import GEMM_SHARPNESS, SHARPNESS, smooth_max
    b = np.linspace(0.0, 1.5, 151)[:, None]
    c = np.linspace(0.0, 2.0, 201)[None, :]
    ratio = np.asarray(smooth_max(smooth_max(1.0, b, GEMM_SHARPNESS), c, SHARPNESS)) / np.maximum(
        np.maximum(1.0, b), c)
    assert ratio.max() == pytest.approx(SLACK - SHARPNESS / 2, rel=1e-3)


@pytest.mark.slow
def test_a_measurement_faster_than_ideal_hardware_is_flagged(rows, bounds):
    row = next(r for r in rows if r.id == "imec-korthi-175b-selsp-paper")
    bound = bounds[row.id]["step_time_s"]
    fast = dataclasses.replace(row, measured={"step_time_s": bound / 2})
    found = implausible_measurements([fast])
    assert [(f["id"], f["metric"]) for f in found] == [(row.id, "step_time_s")]
    assert found[0]["factor"] == pytest.approx(2.0, rel=1e-6)
    assert "ideal-hardware bound" in found[0]["warning"]
    # At the bound itself (within the smooth maximum's slack) nothing is flagged.
    at_bound = dataclasses.replace(row, measured={"step_time_s": bound})
    assert implausible_measurements([at_bound]) == []


@pytest.mark.slow
def test_no_shipped_measurement_beats_its_ideal_bound(rows, bounds):
    """TensorRT-LLM 0.9's Mixtral 8x7B on two A100s, batch 32, 2048 in / 2048 out, at 801
    output tokens/s per GPU: every decode step must stream all eight experts' weights (32
    sequences x top-2 routing touch all of them). At fp16 that is 46.7 GB per GPU, so even the
    HBM peak (2.039 TB/s) allows at most 32 / (46.7e9 / 2.039e12) / 2 = 699 tokens/s per GPU
    before counting the KV cache or the prefill: the row cannot have run 16-bit weights, and is
    recorded as int8 weight-only (benchmarks_data/SOURCES.md). With that, no published value
    beats its row's ideal bound; as fp16 weights this one would, by the model's bound too."""
    hand = 32 / (46.7e9 / 2.039e12) / 2
    assert hand < 801
    assert implausible_measurements(rows) == []
    row = next(r for r in rows if r.id == MIXTRAL)
    assert row.values["weight_precision"] == "fp8"  # int8: the width of fp8
    fp16 = dataclasses.replace(row, values={**row.values, "weight_precision": "fp16"})
    assert ideal_bounds([fp16])[MIXTRAL]["output_tok_s_per_gpu"] < hand
    found = implausible_measurements([fp16])
    assert [(f["id"], f["metric"]) for f in found] == [(MIXTRAL, "output_tok_s_per_gpu")]
    assert found[0]["factor"] > SLACK


@pytest.mark.slow
def test_ideal_bound_ignores_the_rows_gemm_peak_fraction(rows, bounds):
    """The bound is datasheet peak: a row's `gemm_peak_fraction` (an annotation about its
    software's kernels) does not make it slower, so it cannot make a measurement implausible."""
    row = next(r for r in rows if r.id == "trtllm090-ttft-h100-mixtral-8x7b-tp2-in2048")
    assert row.values["gemm_peak_fraction"] == 0.667
    full = dataclasses.replace(row, values={**row.values, "gemm_peak_fraction": 1.0})
    assert ideal_bounds([full])[row.id]["ttft_s"] == pytest.approx(bounds[row.id]["ttft_s"],
                                                                    rel=1e-6)
