"""Prediction intervals: model error per predicted quantity, coverage of held-out values, and
the intervals `diffperf train / infer --interval` print."""

from __future__ import annotations

import json
import math
from importlib import resources
from statistics import NormalDist

import numpy as np
import pytest

from diffperf.calibrate import FitUncertainty, Parameterisation, prediction_interval
from diffperf.cli import main
from diffperf.internal import (
    MOE_STEP_TIME,
    decode_quantity,
    interval_coverage,
    model_error_sd,
    quantity_of,
    residual_sds,
    training_quantity,
)

Z90 = NormalDist().inv_cdf(0.95)


def cell(metric, kind, ratio, source="s1", id_="r"):
    return {"id": id_, "kind": kind, "gpu": "g", "source": source, "metric": metric,
            "measured": 10.0, "predicted": 10.0 * ratio, "ape": abs(ratio - 1) * 100}


def test_quantities_group_columns_that_measure_the_same_thing():
    assert quantity_of("tokens_per_s_per_gpu") == quantity_of("step_time_s") == "step_time"
    assert quantity_of("e2e_latency_s") == quantity_of("tpot_s", batch=1) == "latency"
    # A batched run's latency measures the same regime as its throughput.
    assert quantity_of("output_tok_s_per_gpu") == quantity_of("e2e_latency_s", 64) == "throughput"
    assert decode_quantity(1) == "latency" and decode_quantity(2) == "throughput"
    # one output token: no decode step, the end-to-end latency is the first-token latency
    assert decode_quantity(1, 1) == decode_quantity(64, 1) == "ttft"
    assert decode_quantity(1, 2) == "latency" and decode_quantity(8, 200) == "throughput"
    assert quantity_of("ttft_s") == "ttft"
    with pytest.raises(ValueError, match="peak_memory_gb"):
        quantity_of("peak_memory_gb")


def test_residual_sds_are_rms_log_ratios_per_quantity_kind_and_overall():
    e = math.e
    preds = [cell("step_time_s", "train", e ** 0.1, id_="a"),
             cell("model_tflops_per_gpu", "train", e ** -0.3, id_="b"),
             cell("ttft_s", "infer", e ** 0.2, id_="c"),
             cell("e2e_latency_s", "infer", 1.0, id_="c")]
    sd = residual_sds(preds)
    assert sd["step_time"] == pytest.approx(math.sqrt((0.01 + 0.09) / 2))
    assert sd["train"] == sd["step_time"]
    assert sd["ttft"] == pytest.approx(0.2)
    assert sd["latency"] == pytest.approx(0.0, abs=1e-12)
    assert sd["infer"] == pytest.approx(math.sqrt(0.04 / 2))
    assert sd["all"] == pytest.approx(math.sqrt((0.01 + 0.09 + 0.04) / 4))
    # Two columns of one row that measure the same quantity (tokens/s and model TFLOP/s are the
    # step time in other units) are one measurement: their mean residual counts once.
    twice = residual_sds([cell("tokens_per_s_per_gpu", "train", e ** -0.2, id_="n"),
                          cell("model_tflops_per_gpu", "train", e ** -0.4, id_="n"),
                          cell("step_time_s", "train", e ** 0.6, id_="m")])
    assert twice["step_time"] == pytest.approx(math.sqrt((0.3 ** 2 + 0.6 ** 2) / 2))
    # Lookup falls back from the quantity to the kind to everything.
    assert model_error_sd({"infer": 0.3, "all": 0.1}, "ttft", "infer") == 0.3
    assert model_error_sd({"all": 0.1}, "ttft", "infer") == 0.1
    assert model_error_sd({}, "ttft") == 0.0


def test_batched_latency_counts_as_throughput_error():
    # A row's batch decides the regime: the latency of a batch-64 run joins the throughput
    # residuals, a batch-1 latency stays apart.
    e = math.e
    preds = [dict(cell("e2e_latency_s", "infer", e ** 0.02, id_="b1"), batch=1.0),
             dict(cell("e2e_latency_s", "infer", e ** 0.3, id_="b64"), batch=64.0),
             dict(cell("output_tok_s_per_gpu", "infer", e ** -0.4, id_="t"), batch=32.0)]
    sd = residual_sds(preds)
    assert sd["latency"] == pytest.approx(0.02)
    assert sd["throughput"] == pytest.approx(math.sqrt((0.09 + 0.16) / 2))


def test_coverage_counts_values_inside_the_interval():
    # Model error s with z*s = 0.25: log residuals 0, 0.1, -0.2 are inside, 0.3 is not.
    s = 0.25 / Z90
    preds = [cell("step_time_s", "train", math.exp(r), source=src, id_=f"r{i}")
             for i, (r, src) in enumerate([(0.0, "a"), (0.1, "a"), (-0.2, "b"), (0.3, "b")])]
    cov = interval_coverage(preds, {"step_time": s}, 0.9)
    assert cov["all"]["n"] == 4 and cov["all"]["inside"] == pytest.approx(0.75)
    assert cov["source:a"]["inside"] == 1.0 and cov["source:b"]["inside"] == 0.5
    # With the other source's scale: a's RMS 0.0707 gives b a half-width of 0.116 (both b
    # residuals outside); b's RMS 0.255 gives a 0.419 (both inside).
    assert cov["source:a"]["inside_other_sources"] == 1.0
    assert cov["source:b"]["inside_other_sources"] == 0.0
    assert cov["all"]["inside_other_sources"] == pytest.approx(0.5)
    single = interval_coverage(preds[:2], {"step_time": s}, 0.9)  # one source: nothing to test
    assert single["all"]["inside_other_sources"] is None and single["all"]["n_other_sources"] == 0
    assert cov["step_time"]["half_width_pct"] == pytest.approx(
        (math.exp(0.25) - math.exp(-0.25)) / 2 * 100)
    # Parameter uncertainty widens the interval: with it the 0.3 residual is covered.
    wide = interval_coverage(preds, {"step_time": s}, 0.9, {("r3", "step_time_s"): 0.2})
    assert wide["all"]["inside"] == 1.0


def test_interval_uses_the_model_error_of_its_quantity():
    par = Parameterisation.build(groups=())
    theta = np.asarray(par.theta_from())
    u = FitUncertainty(par, theta, np.zeros((theta.size, theta.size)),
                       {"ttft": 0.2, "latency": 0.05, "throughput": 0.15, "infer": 0.1,
                        "all": 0.1})
    f = lambda e: 3.0 * e.hbm
    for quantity, sd in (("ttft", 0.2), ("latency", 0.05), ("throughput", 0.15), (None, 0.1)):
        iv = prediction_interval(f, u, 0.9, kind="infer", quantity=quantity)
        assert iv.high / iv.value == pytest.approx(math.exp(Z90 * sd), rel=1e-9)
        assert iv.value / iv.low == pytest.approx(math.exp(Z90 * sd), rel=1e-9)
    with pytest.raises(ValueError, match="'e2e_latency'"):
        prediction_interval(f, u, 0.9, quantity="e2e_latency")


def test_moe_training_steps_use_their_own_model_error():
    import diffperf as dp
    assert training_quantity(dp.model("mixtral-8x7b").num_experts) == MOE_STEP_TIME
    assert training_quantity(dp.model("deepseek-v3").num_experts) == MOE_STEP_TIME
    assert training_quantity(dp.model("gpt3-175b").num_experts) == "step_time"
    # A fit without a MoE error (e.g. `diffperf calibrate` output) falls back to the training
    # step's, not to the kind's.
    assert model_error_sd({"step_time": 0.1, "train": 0.2}, MOE_STEP_TIME, "train") == 0.1
    assert model_error_sd({"step_time": 0.1, MOE_STEP_TIME: 0.4}, MOE_STEP_TIME, "train") == 0.4
    assert model_error_sd({"step_time": 0.1, MOE_STEP_TIME: 0.4}, "step_time", "train") == 0.1
    par = Parameterisation.build(groups=())
    theta = np.asarray(par.theta_from())
    u = FitUncertainty(par, theta, np.zeros((theta.size, theta.size)),
                       {"step_time": 0.1, MOE_STEP_TIME: 0.4})
    iv = prediction_interval(lambda e: 2.0 * e.hbm, u, 0.9, kind="train", quantity=MOE_STEP_TIME)
    assert iv.high / iv.value == pytest.approx(math.exp(Z90 * 0.4), rel=1e-9)


@pytest.mark.slow
def test_train_cli_interval_of_a_moe_model_uses_the_moe_error(capsys):
    shipped = _shipped()["uncertainty"]["residual_sd"]
    # Held-out MoE runs miss by far more than the fitted (mostly dense) tables
    # (calibration/report.md): their error is the wider one.
    assert shipped[MOE_STEP_TIME] > 2 * shipped["step_time"]
    args = ["train", "--model", "mixtral-8x7b", "--gpu", "h100-sxm5-80gb", "--gpus", "64",
            "--tp", "2", "--pp", "1", "--vp", "1", "--ep", "8", "--global-batch", "256",
            "--recompute", "none", "--interval"]
    assert main(args + ["--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    iv = s["step_time_interval_s"]
    assert iv["quantity"] == MOE_STEP_TIME
    # log half-width = z sqrt(parameter sd^2 + MoE error^2); the parameter part is a few %
    half = math.log(iv["high"] / iv["low"]) / 2.0
    assert Z90 * shipped[MOE_STEP_TIME] <= half <= Z90 * math.hypot(shipped[MOE_STEP_TIME], 0.05)
    assert iv["low"] < s["step_time_s"] < iv["high"]
    assert main(args) == 0
    assert "(MoE runs' model error)" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("batch, output, e2e_quantity",
                         [(1, 64, "latency"), (8, 64, "throughput"), (1, 1, "ttft")])
def test_infer_cli_prints_ttft_and_e2e_intervals(capsys, batch, output, e2e_quantity):
    shipped = json.loads(resources.files("diffperf.presets").joinpath("efficiency.json")
                         .read_text())["uncertainty"]["residual_sd"]
    code = main(["infer", "--model", "llama2-7b", "--gpu", "h100-sxm5-80gb", "--tp", "1",
                 "--batch", str(batch), "--input", "128", "--output", str(output),
                 "--interval", "--json"])
    s = json.loads(capsys.readouterr().out)
    assert code == 0
    import diffperf as dp
    from diffperf.inference import infer
    model, system = dp.model("llama2-7b"), dp.system("h100-sxm5-80gb")
    plan = dp.InferencePlan(tp=1, batch=batch, input_len=128, output_len=output)
    for field, q in (("ttft", "ttft"), ("e2e_latency", e2e_quantity)):
        iv, value = s[f"{field}_interval_s"], s[f"{field}_s"]
        assert iv["low"] < value < iv["high"], field
        assert iv["quantity"] == q
        # log half-width = z sqrt(parameter sd^2 + the model error of *this* quantity^2).
        par = prediction_interval(lambda e, f=field: getattr(infer(model, system, plan, e), f),
                                  None, 0.9, "h100-sxm5-80gb", "infer", model_error=False,
                                  quantity=q)
        expected = Z90 * math.hypot(par.log_sd, shipped[q])
        assert math.log(iv["high"] / value) == pytest.approx(expected, rel=1e-4), field
    assert len({shipped["ttft"], shipped["latency"], shipped["throughput"], shipped["infer"]}) == 4
    assert "ms (90% interval" in s["ttft_interval_s"]["text"]


def _shipped():
    return json.loads(resources.files("diffperf.presets").joinpath("efficiency.json").read_text())


def _corrupt(unc, how):
    n = len(unc["theta"])
    if how == "not an object":
        return ["covariance"]
    if how == "theta too short":
        unc["theta"] = unc["theta"][:-1]
    elif how == "covariance not square":
        unc["covariance"] = [row[:-1] for row in unc["covariance"]]
    elif how == "nan covariance":
        unc["covariance"][0][0] = float("nan")
    elif how == "negative variance":
        unc["covariance"][2][2] = -1e-4
    elif how == "parameterisation not an object":
        unc["parameterisation"] = 5
    elif how == "unknown fitted factor":
        unc["parameterisation"]["fields"][0] = "bogus"
    elif how == "factor name not a string":
        unc["parameterisation"]["fields"][0] = 5
    elif how == "center empty":
        unc["parameterisation"]["center"] = {}
    elif how == "residual sd negative":
        unc["residual_sd"]["step_time"] = -0.1
    elif how == "degenerate covariance":  # an unconverged fit: parameter sd of order 1e5
        unc["covariance"] = (np.eye(n) * 1e11).tolist()
    elif how == "huge model error":
        unc["residual_sd"]["step_time"] = 1e300
    return unc


@pytest.mark.parametrize("how, message", [
    ("not an object", "'uncertainty' must be an object"),
    ("theta too short", "'uncertainty.theta' has shape"),
    ("covariance not square", "'uncertainty.covariance' has shape"),
    ("nan covariance", "'uncertainty.covariance' contains NaN"),
    ("negative variance", "negative variance"),
    ("parameterisation not an object", "'uncertainty.parameterisation' is malformed"),
    ("unknown fitted factor", "'fields' names unknown factors ['bogus']"),
    ("factor name not a string", "'fields' must hold names, got 5"),
    ("center empty", "'center'.matmul_peak must be a finite number, got None"),
    ("residual sd negative", "'uncertainty.residual_sd.step_time'"),
    ("degenerate covariance", "too wide for a meaningful interval"),
    ("huge model error", "too wide for a meaningful interval"),
])
def test_interval_from_a_corrupt_fitted_file_is_a_clear_message(tmp_path, capsys, how, message):
    data = _shipped()
    data["uncertainty"] = _corrupt(data["uncertainty"], how)
    path = tmp_path / "fitted.json"
    path.write_text(json.dumps(data))
    code = main(["train", "--model", "gpt3-175b", "--gpu", "a100-sxm4-80gb", "--gpus", "64",
                 "--tp", "8", "--pp", "8", "--global-batch", "64", "--interval",
                 "--efficiency", str(path), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err  # the prediction itself stands; only the interval is refused
    s = json.loads(out.out)
    assert math.isfinite(s["step_time_s"])
    err = s["step_time_interval_s"]["error"]
    assert message in err
    if how not in ("degenerate covariance", "huge model error"):
        assert str(path) in err


def test_interval_caveats_say_what_the_fit_did_not_see():
    """An interval for a GPU without calibration rows, or for a quantity the fit recorded no
    model error of, says so; a calibrated GPU (or one sharing its chip, H800 -> H100) and a
    recorded quantity get no caveat."""
    import dataclasses

    from diffperf.calibrate import load_uncertainty
    from diffperf.internal import interval_caveats
    u = load_uncertainty(None)
    assert interval_caveats(u, "a100-sxm4-80gb", "train", "step_time") == []
    assert interval_caveats(u, "h800-sxm5-80gb", "train", "step_time") == []
    (note,) = interval_caveats(u, "v100-sxm2-32gb", "train", "step_time")
    assert note.startswith("no calibration data for v100-sxm2-32gb")
    latency_only = dataclasses.replace(u, residual_sd={"all": 0.05, "infer": 0.05,
                                                       "latency": 0.05})
    (note,) = interval_caveats(latency_only, "a100-sxm4-80gb", "infer", "ttft")
    assert "no model error for ttft" in note and "the infer one" in note


def test_no_interval_for_a_kind_the_fit_never_measured():
    """A training-only fit has no model error for inference: an inference interval would borrow
    the training residual (about 1 % from a few in-sample points), so there is none."""
    import dataclasses

    from diffperf.calibrate import load_uncertainty, prediction_interval
    from diffperf.internal import require_measured_kind
    u = load_uncertainty(None)
    trained_only = {"all": 0.01, "train": 0.01, "step_time": 0.01}
    require_measured_kind(trained_only, "train")
    require_measured_kind({}, "infer")  # no model error recorded at all: nothing to borrow
    with pytest.raises(ValueError, match="the fit has no infer measurements"):
        require_measured_kind(trained_only, "infer")
    # ... and the other way: an inference-only fit still records the MoE step error, which is
    # measured on held-out training rows, not on fitted ones
    inferred_only = {"all": 0.03, "infer": 0.03, "latency": 0.03, "step_time_moe": 0.3}
    with pytest.raises(ValueError, match="the fit has no train measurements"):
        require_measured_kind(inferred_only, "train")
    fit = dataclasses.replace(u, residual_sd=trained_only)
    with pytest.raises(ValueError, match="the fit has no infer measurements"):
        prediction_interval(lambda e: e.hbm, fit, kind="infer", quantity="latency")


def test_a_gpu_sharing_a_fitted_chip_gets_its_factors_in_intervals_too():
    """The H800 has no rows of its own; its point prediction uses the H100's fitted factors
    (`efficiency_of`), and so must its interval: same centre and width as the H100's for the
    same workload, not the shared factors'."""
    import diffperf as dp
    from diffperf.calibrate import prediction_interval
    m, s = dp.model("llama2-70b"), dp.system("h100-sxm5-80gb")
    plan = dp.InferencePlan(tp=8, batch=1, input_len=128, output_len=64)
    fn = lambda e: dp.infer(m, s, plan, e).e2e_latency  # noqa: E731
    h800, h100, shared = (prediction_interval(fn, None, 0.9, g, "infer", quantity="latency")
                          for g in ("h800-sxm5-80gb", "h100-sxm5-80gb", None))
    assert h800.value == pytest.approx(h100.value, rel=1e-9)
    assert h800.low == pytest.approx(h100.low, rel=1e-9)
    assert h800.value != pytest.approx(shared.value, rel=1e-6)
    point = float(fn(dp.presets.default_efficiency("h800-sxm5-80gb")))
    assert h800.value == pytest.approx(point, rel=1e-6)


def test_large_interval_bounds_print_as_whole_numbers():
    from diffperf.calibrate import PredictionInterval
    text = PredictionInterval(812.0, 638.0, 1051.2, 0.9, 0.1).format("ms")
    assert text == "812 ms (90% interval 638 to 1051 ms)"
    assert PredictionInterval(900.0, 800.0, 999.7, 0.9, 0.1).format("ms").endswith("1000 ms)")
    assert str(PredictionInterval(12.93, 12.1, 13.8, 0.9, 0.1)) == \
        "12.9 s (90% interval 12.1 to 13.8 s)"
