"""Prediction intervals: the parameter part, the error model's part of each configuration, and
the intervals `diffperf train / infer / serve --interval` print."""

from __future__ import annotations

import json
import math
from importlib import resources
from statistics import NormalDist

import numpy as np
import pytest

import diffperf as dp
from diffperf.calibrate import (
    ErrorModel,
    FitUncertainty,
    Parameterisation,
    descriptor,
    load_uncertainty,
    prediction_interval,
    spec_descriptor,
)
from diffperf.calibrate._error_model import COVARIATES, LEVELS, support_of
from diffperf.cli import main
from diffperf.internal import decode_quantity, quantity_of, residual_sds

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


#: A hand-made error model: log s = log 0.05 for a training step, log 0.1 for a batched
#: inference run, +0.5 per doubling of experts beyond the calibrated 8; q_0.9 = 1.645.
def _toy_model(support=None):
    coef = np.zeros(len(COVARIATES))
    coef[COVARIATES.index("q:step_time")] = math.log(0.05)
    coef[COVARIATES.index("q:throughput")] = math.log(0.1)
    coef[COVARIATES.index("experts_beyond")] = 0.5
    row = {"gpu": "h100-sxm5-80gb", "precision": "bf16", "hidden": 4096, "ffn_hidden": 14336,
           "num_experts": 8, "experts_per_token": 2, "num_gpus": 64, "tp": 2, "pp": 1}
    if support is None:
        support = support_of([descriptor(row, "step_time"), descriptor(row, "throughput")])
    return ErrorModel(coef, {"all": np.full(len(LEVELS), Z90)}, support), row


def _toy_fit(support=None):
    par = Parameterisation.build(groups=())
    theta = np.asarray(par.theta_from())
    model, row = _toy_model(support)
    return FitUncertainty(par, theta, np.zeros((theta.size, theta.size)), {}, model), row


def test_interval_width_is_the_error_model_of_its_configuration():
    u, row = _toy_fit()
    f = lambda e: 3.0 * e.hbm  # noqa: E731
    # Without a descriptor: a calibrated configuration of the quantity.
    for quantity, s in (("step_time", 0.05), ("throughput", 0.1)):
        iv = prediction_interval(f, u, 0.9, kind=QUANTITY_KIND[quantity], quantity=quantity)
        assert iv.high / iv.value == pytest.approx(math.exp(Z90 * s), rel=1e-9)
        assert iv.value / iv.low == pytest.approx(math.exp(Z90 * s), rel=1e-9)
        assert iv.reasons == ()
    # 128 experts, 4 doublings beyond the calibrated 8: the scale is e^(4 x 0.5) wider, and the
    # interval says why.
    wide = descriptor({**row, "num_experts": 128}, "step_time")
    iv = prediction_interval(f, u, 0.9, kind="train", descriptor=wide)
    assert math.log(iv.high / iv.value) == pytest.approx(Z90 * 0.05 * math.exp(2.0), rel=1e-9)
    assert len(iv.reasons) == 1 and "128 experts, calibrated runs had at most 8" in iv.reasons[0]
    assert f"x{math.exp(2.0):.2f} width" in iv.reasons[0]
    with pytest.raises(ValueError, match="'e2e_latency'"):
        prediction_interval(f, u, 0.9, quantity="e2e_latency")


QUANTITY_KIND = {"step_time": "train", "throughput": "infer"}


def test_no_interval_for_a_kind_the_fit_never_measured_or_without_an_error_model():
    """A training-only fit's error model has no inference support: an inference interval would
    borrow the training residuals, so there is none; a fit without an error model gives none."""
    import dataclasses
    model, row = _toy_model()
    u, _ = _toy_fit(support={"train": model.support["train"]})
    prediction_interval(lambda e: e.hbm, u, kind="train")
    with pytest.raises(ValueError, match="the fit has no infer measurements"):
        prediction_interval(lambda e: e.hbm, u, kind="infer", quantity="latency")
    with pytest.raises(ValueError, match="this fit has no error model"):
        prediction_interval(lambda e: e.hbm, dataclasses.replace(u, error_model=None),
                            kind="train")
    # A confidence interval of the model (no model error) needs none.
    assert prediction_interval(lambda e: e.hbm, dataclasses.replace(u, error_model=None),
                               kind="train", model_error=False).reasons == ()


@pytest.mark.slow
def test_train_cli_interval_of_a_fine_grained_moe_model_is_wider_and_says_why(capsys):
    args = ["train", "--model", "deepseek-v3", "--gpu", "h100-sxm5-80gb", "--gpus", "1024",
            "--tp", "1", "--pp", "16", "--vp", "1", "--ep", "64", "--interval"]
    assert main(args + ["--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    iv = s["step_time_interval_s"]
    assert iv["low"] < s["step_time_s"] < iv["high"]
    # the expert count among the reasons, by the novelty or the MoE regime covariate
    assert any("256 experts" in w for w in iv["why"])
    # log half-width = hypot(z x parameter sd, the error model's half-width for this run)
    model, system = dp.model("deepseek-v3"), dp.system("h100-sxm5-80gb")
    plan = dp.TrainingPlan(tp=1, pp=16, dp=64, ep=64, micro_batch=1, global_batch=1024)
    em = load_uncertainty(None).error_model
    d = spec_descriptor(model, system, plan, "step_time", "h100-sxm5-80gb", "megatron-core")
    half = math.log(iv["high"] / iv["low"]) / 2.0
    assert em.for_descriptor(d) <= half <= math.hypot(em.for_descriptor(d), Z90 * 0.05)
    dense = em.log_half_width(np.eye(len(COVARIATES))[COVARIATES.index("q:step_time")])
    # far wider than a calibrated dense run's: at least 1.5x for a run with 32x the calibrated
    # expert count (1.9x with the error model fitted on 2026-11-28)
    assert half > 1.5 * dense
    assert main(args) == 0
    note = capsys.readouterr().out
    # the text names the expert count among the reasons (in the order of their widths)
    assert "the interval is wider than a calibrated configuration's: " in note
    assert "256 experts" in note


@pytest.mark.slow
@pytest.mark.parametrize("batch, output, e2e_quantity",
                         [(1, 64, "latency"), (8, 64, "throughput"), (1, 1, "ttft")])
def test_infer_cli_prints_ttft_and_e2e_intervals(capsys, batch, output, e2e_quantity):
    em = load_uncertainty(None).error_model
    code = main(["infer", "--model", "llama2-7b", "--gpu", "h100-sxm5-80gb", "--tp", "1",
                 "--batch", str(batch), "--input", "128", "--output", str(output),
                 "--interval", "--json"])
    s = json.loads(capsys.readouterr().out)
    assert code == 0
    from diffperf.inference import infer
    model, system = dp.model("llama2-7b"), dp.system("h100-sxm5-80gb")
    plan = dp.InferencePlan(tp=1, batch=batch, input_len=128, output_len=output)
    for field, q in (("ttft", "ttft"), ("e2e_latency", e2e_quantity)):
        iv, value = s[f"{field}_interval_s"], s[f"{field}_s"]
        assert iv["low"] < value < iv["high"], field
        assert iv["quantity"] == q
        # log half-width = hypot(z x parameter sd, the error model's half-width of *this*
        # quantity and configuration).
        par = prediction_interval(lambda e, f=field: getattr(infer(model, system, plan, e), f),
                                  None, 0.9, "h100-sxm5-80gb", "infer", model_error=False)
        # the default runtime: the calibration set's own (TensorRT-LLM 0.x), never "unseen"
        d = spec_descriptor(model, system, plan, q, "h100-sxm5-80gb", "megatron-core")
        assert not any("runtime" in r for r in em.reasons(d))
        expected = math.hypot(Z90 * par.log_sd, em.for_descriptor(d))
        assert math.log(iv["high"] / value) == pytest.approx(expected, rel=1e-4), field
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
        coef = unc["error_model"]["coef"]
        coef[unc["error_model"]["covariates"].index("q:step_time")] = 10.0
    elif how == "error model malformed":
        unc["error_model"]["coef"] = "wide"
    elif how == "no error model":
        del unc["error_model"]
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
    ("error model malformed", "uncertainty.error_model.coef must be a list of numbers"),
    ("no error model", "this fit has no error model"),
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
    if how not in ("degenerate covariance", "huge model error", "no error model"):
        assert str(path) in err


def test_interval_notes_say_what_the_fit_did_not_see():
    """An interval for a GPU without calibration rows says so, and the error model widens it;
    a calibrated GPU (or one sharing its chip, H800 -> H100) gets no note."""
    from diffperf.calibrate._uncertainty import interval_summary
    m = dp.model("llama2-7b")
    plan = dp.TrainingPlan(tp=1, pp=1, dp=8, micro_batch=1, global_batch=8)
    out = {}
    for gpu in ("a100-sxm4-80gb", "h800-sxm5-80gb", "v100-sxm2-32gb"):
        d = spec_descriptor(m, dp.system(gpu), plan, "step_time", gpu, "megatron-core")
        out[gpu] = interval_summary(lambda e: 2.0 + 0.0 * e.hbm, None, gpu, "train", d)
    assert "note" not in out["a100-sxm4-80gb"] and "note" not in out["h800-sxm5-80gb"]
    assert "no calibration data for v100-sxm2-32gb" in out["v100-sxm2-32gb"]["note"]
    assert "no calibrated training run on v100-sxm2-32gb" in out["v100-sxm2-32gb"]["note"]
    width = lambda iv: iv["high"] / iv["low"]  # noqa: E731
    assert width(out["v100-sxm2-32gb"]) > width(out["a100-sxm4-80gb"])


def test_a_gpu_sharing_a_fitted_chip_gets_its_factors_in_intervals_too():
    """The H800 has no rows of its own; its point prediction uses the H100's fitted factors
    (`efficiency_of`), and so must its interval: same centre and width as the H100's for the
    same workload, not the shared factors'."""
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
