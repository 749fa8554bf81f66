"""The model errors of inference outside the fit's inference data, measured on held-out
inference rows of that kind (`benchmarks_data/infer_trtllm10_holdout.csv`): a GPU no fitted
inference row ran on, or a GEMM precision none used (`diffperf.internal.UNSEEN_INFERENCE`),
and a MoE model with more experts than any fitted inference row (`MOE_INFERENCE`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import NormalDist
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from diffperf.calibrate import (
    FitUncertainty,
    Parameterisation,
    load_uncertainty,
    prediction_interval,
)
from diffperf.cli import main
from diffperf.internal import (
    MOE_INFERENCE,
    UNSEEN_INFERENCE,
    default_data_paths,
    inference_floors,
    inference_support,
    is_unseen_inference,
    model_error_sd,
    moe_inference_error,
    unseen_inference_error,
)

Z90 = NormalDist().inv_cdf(0.95)
DATA = Path(__file__).resolve().parent.parent / "benchmarks_data"
HOLDOUT = DATA / "infer_trtllm10_holdout.csv"


def _row(id_, gpu, precision, kind="infer", experts=1):
    return SimpleNamespace(id=id_, kind=kind, values={"gpu": gpu, "precision": precision,
                                                      "num_experts": experts})


def test_support_and_unseen_configurations():
    support = inference_support([_row("a", "a100-sxm4-80gb", "fp16"),
                                 _row("b", "h100-sxm5-80gb", "bf16", experts=8),
                                 _row("c", "h100-sxm5-80gb", "fp8")])
    assert support == {"gpus": ["a100-sxm4-80gb", "h100-sxm5-80gb"], "precisions": [1, 2],
                       "max_experts": 8}
    assert not is_unseen_inference(support, "h100-sxm5-80gb", "fp8")
    assert not is_unseen_inference(support, "a100-sxm4-80gb", "bf16")  # 16-bit is one class
    assert not is_unseen_inference(support, "a100-sxm4-80gb", 1)  # a precision code
    assert not is_unseen_inference(support, "dgx-h100", "fp8")  # a system stands for its GPU
    assert not is_unseen_inference(support, "h800-sxm5-80gb", "fp8")  # H100 silicon
    # and the other way round: a fit of H800 rows covers the H100 (the support names chips)
    assert inference_support([_row("x", "h800-sxm5-80gb", "fp8")])["gpus"] == ["h100-sxm5-80gb"]
    assert is_unseen_inference(support, "b200", "fp8")  # a GPU no inference row ran on
    assert is_unseen_inference(support, "dgx-b200", "fp8")
    assert is_unseen_inference(support, "h100-sxm5-80gb", "fp4")  # a precision none used
    assert is_unseen_inference(support, "h100-sxm5-80gb", "fp32")
    assert is_unseen_inference(support, None, "fp4")  # no GPU given: the precision decides
    assert not is_unseen_inference(support, "h100-sxm5-80gb", None)
    with pytest.raises(ValueError, match="int8 / int4 weights run their GEMMs"):
        is_unseen_inference(support, "h100-sxm5-80gb", "int8")
    # no recorded support (a training-only fit, an older file): nothing is unseen
    assert not is_unseen_inference(None, "b200", "fp4")
    # the floors an interval takes: unseen GPU / precision, more experts than fitted
    assert inference_floors(support, "h100-sxm5-80gb", "fp8", 8) == ()
    assert inference_floors(support, "b200", "fp8", 1) == (UNSEEN_INFERENCE,)
    assert inference_floors(support, "h100-sxm5-80gb", "fp8", 128) == (MOE_INFERENCE,)
    assert inference_floors(support, "b200", "fp4", 16) == (UNSEEN_INFERENCE, MOE_INFERENCE)
    assert inference_floors({"gpus": ["b200"], "precisions": [3]}, "b200", "fp4", 8) == (
        MOE_INFERENCE,)  # a support without max_experts: every MoE model is beyond it
    assert inference_floors(None, "b200", "fp4", 256) == ()  # no support, no floors


def test_floor_errors_are_at_least_the_quantity_error():
    sd = {"latency": 0.05, "ttft": 0.25, "throughput": 0.12, UNSEEN_INFERENCE: 0.2,
          MOE_INFERENCE: 0.6}
    assert model_error_sd(sd, "latency", "infer", (UNSEEN_INFERENCE,)) == 0.2
    assert model_error_sd(sd, "ttft", "infer", (UNSEEN_INFERENCE,)) == 0.25  # the larger
    assert model_error_sd(sd, "ttft", "infer", (UNSEEN_INFERENCE, MOE_INFERENCE)) == 0.6
    assert model_error_sd(sd, "throughput", "infer") == 0.12
    assert model_error_sd({"throughput": 0.12}, "throughput", "infer", (MOE_INFERENCE,)) == 0.12
    par = Parameterisation.build(groups=())
    theta = np.asarray(par.theta_from())
    u = FitUncertainty(par, theta, np.zeros((theta.size, theta.size)), sd,
                       {"gpus": ["h100-sxm5-80gb"], "precisions": [2], "max_experts": 8})
    for floors, error in (((), 0.12), ((UNSEEN_INFERENCE,), 0.2), ((MOE_INFERENCE,), 0.6)):
        iv = prediction_interval(lambda e: 2.0 * e.hbm, u, 0.9, kind="infer",
                                 quantity="throughput", floors=floors)
        assert iv.high / iv.value == pytest.approx(math.exp(Z90 * error), rel=1e-9)


def test_floor_errors_are_rms_log_residuals_of_their_held_out_rows():
    support = {"gpus": ["h100-sxm5-80gb"], "precisions": [2], "max_experts": 8}
    fit = SimpleNamespace(inference_support=support, residual_sd={"throughput": 0.1},
                          metadata={})
    data = [_row("seen", "h100-sxm5-80gb", "fp8"), _row("gpu", "b200", "fp8"),
            _row("prec", "h100-sxm5-80gb", "fp4"), _row("train", "b200", "fp8", kind="train"),
            _row("moe", "b200", "fp4", experts=128), _row("moe8", "b200", "fp4", experts=8)]
    rows = [{"id": "seen", "predicted": 3.0, "measured": 1.0},
            {"id": "gpu", "predicted": 1.2, "measured": 1.0},
            {"id": "gpu", "predicted": 1.0, "measured": 1.2},  # two columns: mean log 0
            {"id": "prec", "predicted": 0.5, "measured": 1.0},
            {"id": "train", "predicted": 9.0, "measured": 1.0},
            {"id": "moe", "predicted": 4.0, "measured": 1.0},
            {"id": "moe8", "predicted": 1.0, "measured": 2.0}]
    out = unseen_inference_error(fit, rows, data)
    # "moe" (128 experts) is not an unseen-GPU residual; "moe8" (8, as fitted) is
    assert out["unseen"] == 3 and out["seen"] == 1
    assert fit.residual_sd[UNSEEN_INFERENCE] == pytest.approx(
        math.sqrt(2 * math.log(2) ** 2 / 3))
    # their mean log residual: (0 - log 2 - log 2) / 3, predicted too slow
    assert fit.metadata["floor_bias"][UNSEEN_INFERENCE] == pytest.approx(-2 * math.log(2) / 3)
    moe = moe_inference_error(fit, rows, data)
    assert moe["held_out"] == 1
    assert fit.residual_sd[MOE_INFERENCE] == pytest.approx(math.log(4))
    assert fit.metadata["floor_bias"][MOE_INFERENCE] == pytest.approx(math.log(4))
    # no held-out row outside the support: unchanged
    fit = SimpleNamespace(inference_support={"gpus": ["b200", "h100-sxm5-80gb"],
                                             "precisions": [2, 3], "max_experts": 128},
                          residual_sd={}, metadata={})
    assert unseen_inference_error(fit, rows, data)["unseen"] == 0
    assert moe_inference_error(fit, rows, data)["held_out"] == 0
    assert not fit.residual_sd


def test_shipped_fit_records_its_inference_data_and_a_wider_error_outside_it():
    u = load_uncertainty()
    table = pd.read_csv(default_data_paths()[1])
    classes = {"fp32": 0, "tf32": 0, "bf16": 1, "fp16": 1, "fp8": 2, "fp4": 3}
    assert u.inference_support == {"gpus": sorted(set(table["gpu"])),
                                   "precisions": sorted({classes[p] for p in table["precision"]}),
                                   "max_experts": int(table["num_experts"].max())}
    # held-out Blackwell FP4 rows miss by more than the fitted throughput rows, and the
    # fine-grained MoE rows by far more (report.md)
    assert u.residual_sd[UNSEEN_INFERENCE] > 1.2 * u.residual_sd["throughput"]
    assert u.residual_sd[MOE_INFERENCE] > 2 * u.residual_sd[UNSEEN_INFERENCE]


@pytest.mark.slow
def test_held_out_intervals_widen_outside_the_fit_and_cover_the_table(capsys):
    """`predict --interval` on the held-out TensorRT-LLM 1.0 table: the Qwen3-30B-A3B rows
    (128 experts) get the MoE error, the other Blackwell FP4 rows (outside the fit's
    inference data) the unseen error, the Hopper FP8 rows their throughput error; most
    measured values fall inside (113 of 120 with the shipped fit; of the 60 Hopper rows, which
    set no error, 57)."""
    assert main(["predict", "--data", str(HOLDOUT), "--interval", "--json"]) == 0
    preds = {r["id"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    u = load_uncertainty()
    inside = hopper_inside = 0
    for _, r in pd.read_csv(HOLDOUT).iterrows():
        p = preds[r["id"]]
        half = math.log(p["interval_high_s"] / p["interval_low_s"]) / 2.0
        expected = ("infer_moe" if r["num_experts"] > 8 else
                    "infer_unseen" if r["precision"] == "fp4" else "throughput")
        assert p["interval_model_error"] == expected, r["id"]  # which error set the width
        if r["num_experts"] > 8:
            assert half >= Z90 * u.residual_sd[MOE_INFERENCE] - 1e-9, r["id"]
        elif r["precision"] == "fp4":
            assert Z90 * u.residual_sd[UNSEEN_INFERENCE] - 1e-9 <= half, r["id"]
            assert half < Z90 * u.residual_sd[MOE_INFERENCE], r["id"]
        else:
            assert Z90 * u.residual_sd["throughput"] - 1e-9 <= half, r["id"]
            assert half < Z90 * u.residual_sd[UNSEEN_INFERENCE], r["id"]
        # throughput = batch * output / latency: its interval is the latency's, inverted
        scale = p["output_tok_s_per_gpu"] * p["e2e_latency_s"]
        hit = scale / p["interval_high_s"] <= r["output_tok_s_per_gpu"] <= (
            scale / p["interval_low_s"])
        inside += hit
        hopper_inside += hit and r["precision"] == "fp8"
    assert inside >= 100
    assert hopper_inside >= 54  # out of sample: 90 % of 60


@pytest.mark.slow
def test_infer_cli_notes_an_unseen_gpu_or_precision(capsys):
    base = ["infer", "--model", "llama3-70b", "--batch", "64", "--input", "512",
            "--output", "256", "--interval", "--json"]
    u = load_uncertainty()
    assert main(base + ["--gpu", "dgx-b200", "--precision", "fp4"]) == 0
    iv = json.loads(capsys.readouterr().out)["e2e_latency_interval_s"]
    assert "no inference measurement on b200 or at fp4 GEMM precision" in iv["note"]
    assert "too fast on average" in iv["note"]  # the held-out rows' bias is named
    assert math.log(iv["high"] / iv["low"]) / 2 >= Z90 * u.residual_sd[UNSEEN_INFERENCE] - 1e-9
    h100 = base + ["--gpu", "h100-sxm5-80gb", "--tp", "2", "--precision", "fp8"]
    assert main(h100) == 0
    iv = json.loads(capsys.readouterr().out)["e2e_latency_interval_s"]
    assert "note" not in iv
    narrow = math.log(iv["high"] / iv["low"]) / 2
    # what-if hardware is outside every fitted measurement: the unseen floor and a note
    assert main(h100 + ["--set", "hbm_bandwidth=x2"]) == 0
    iv = json.loads(capsys.readouterr().out)["e2e_latency_interval_s"]
    assert "what-if hardware (--set)" in iv["note"]
    assert math.log(iv["high"] / iv["low"]) / 2 >= Z90 * u.residual_sd[UNSEEN_INFERENCE] > narrow


@pytest.mark.slow
def test_moe_notes_name_the_floor_that_applies_and_old_fits_still_warn(capsys, tmp_path):
    args = ["infer", "--model", "deepseek-v3", "--gpu", "b200", "--tp", "8", "--precision",
            "fp8", "--interval", "--json"]
    assert main(args) == 0
    note = json.loads(capsys.readouterr().out)["e2e_latency_interval_s"]["note"]
    # both floors hold; only the larger (MoE) one sets the interval and is named
    assert "held-out fine-grained MoE inference runs" in note
    assert "outside the fit's data" not in note
    # a fit saved without the inference support or its floor errors still warns
    from importlib import resources
    data = json.loads(resources.files("diffperf.presets").joinpath("efficiency.json").read_text())
    del data["uncertainty"]["inference_support"]
    for key in (UNSEEN_INFERENCE, MOE_INFERENCE):
        del data["uncertainty"]["residual_sd"][key]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert main(args + ["--efficiency", str(old)]) == 0
    note = json.loads(capsys.readouterr().out)["e2e_latency_interval_s"]["note"]
    assert "no inference measurement of a MoE model with this many experts" in note
    # the text output prints a note once, not under both intervals
    assert main(args[:-1]) == 0
    out = capsys.readouterr().out
    assert out.count("held-out fine-grained MoE inference runs") == 1


def _calibrate(capsys, tmp_path, data, *extra):
    fitted = tmp_path / "fitted.json"
    argv = ["calibrate", "--out", str(fitted), "--steps", "0", "--lbfgs-steps", "0", "--quiet",
            "--moe-holdout", "none", "--json", *extra, "--data", str(data)]
    code = main(argv)
    cap = capsys.readouterr()
    return code, json.loads(fitted.read_text()) if code == 0 else None, cap.err


@pytest.mark.slow
def test_calibrate_measures_the_unseen_error_on_held_out_rows(capsys, tmp_path):
    """`diffperf calibrate` records its inference data and measures the unseen error on the
    held-out rows outside it, predicted with its own saved fit; `--infer-holdout none` and a
    training-only fit record none."""
    from diffperf.presets import efficiency_from_json
    from diffperf.validation import validate
    table = pd.read_csv(default_data_paths()[1])
    latency = tmp_path / "latency.csv"
    table[table["id"].str.startswith("imec-inf")].to_csv(latency, index=False)
    code, saved, err = _calibrate(capsys, tmp_path, latency)
    assert code == 0, err
    unc = saved["uncertainty"]
    assert unc["inference_support"] == {"gpus": ["a100-sxm4-80gb", "h100-sxm5-80gb"],
                                        "precisions": [1], "max_experts": 1}
    # every dense held-out row is outside (fp8 / fp4, or H200 / B200 / GB200): all 100 count;
    # the 20 MoE rows (dense fit: any MoE model is beyond it) set the MoE error
    rows = validate([HOLDOUT], efficiency_from_json(tmp_path / "fitted.json"))["rows"]
    moe = set(pd.read_csv(HOLDOUT).query("num_experts > 1")["id"])
    rms = lambda rs: math.sqrt(np.mean([math.log(r["predicted"] / r["measured"]) ** 2  # noqa
                                        for r in rs]))
    dense = [r for r in rows if r["id"] not in moe]
    assert len(dense) == 100 and len(rows) == 120
    assert unc["residual_sd"][UNSEEN_INFERENCE] == pytest.approx(rms(dense), rel=1e-9)
    assert unc["residual_sd"][MOE_INFERENCE] == pytest.approx(
        rms([r for r in rows if r["id"] in moe]), rel=1e-9)
    assert saved["metadata"]["unseen_inference_error_basis"].startswith("100 held-out")
    assert saved["metadata"]["moe_inference_error_basis"].startswith("20 held-out")

    code, saved, _ = _calibrate(capsys, tmp_path, latency, "--infer-holdout", "none")
    assert code == 0 and UNSEEN_INFERENCE not in saved["uncertainty"]["residual_sd"]
    assert MOE_INFERENCE not in saved["uncertainty"]["residual_sd"]

    train = tmp_path / "train.csv"
    pd.read_csv(default_data_paths()[0]).head(3).to_csv(train, index=False)
    code, saved, _ = _calibrate(capsys, tmp_path, train)
    assert code == 0 and "inference_support" not in saved["uncertainty"]
    assert UNSEEN_INFERENCE not in saved["uncertainty"]["residual_sd"]


def test_calibrate_rejects_a_missing_infer_holdout_before_fitting(capsys, tmp_path):
    code, saved, err = _calibrate(capsys, tmp_path, default_data_paths()[1],
                                  "--infer-holdout", str(tmp_path / "absent.csv"))
    assert code == 2 and saved is None
    assert "--infer-holdout" in err and "absent.csv: file not found" in err


def test_integral_floats_in_the_support_are_accepted(tmp_path):
    from importlib import resources
    data = json.loads(resources.files("diffperf.presets").joinpath("efficiency.json").read_text())
    data["uncertainty"]["inference_support"] = {"gpus": ["b200"], "precisions": [3.0],
                                                "max_experts": 8.0}
    path = tmp_path / "eff.json"
    path.write_text(json.dumps(data))
    assert load_uncertainty(str(path)).inference_support == {"gpus": ["b200"],
                                                             "precisions": [3], "max_experts": 8}


@pytest.mark.parametrize("bad", [["b200"], {"gpus": "b200", "precisions": [3]},
                                 {"gpus": ["b200"], "precisions": [7]},
                                 {"gpus": ["b200"], "precisions": [True]},
                                 {"gpus": ["b200"], "precisions": [2.5]},
                                 {"gpus": ["b200"], "precisions": [3], "max_experts": 0}])
def test_malformed_inference_support_is_named(tmp_path, bad):
    from importlib import resources
    data = json.loads(resources.files("diffperf.presets").joinpath("efficiency.json").read_text())
    data["uncertainty"]["inference_support"] = bad
    path = tmp_path / "eff.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"eff\.json: 'uncertainty\.inference_support'"):
        load_uncertainty(str(path))
