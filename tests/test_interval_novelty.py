"""Intervals away from the calibration data (`diffperf.calibrate._error_model`): the shipped
error model widens an inference interval on a GPU or at a precision no calibrated inference run
had, for a MoE model with more experts than calibrated, and for what-if hardware, and says
why; `diffperf calibrate` fits its own error model, held-out rows included."""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

import pandas as pd
import pytest

from diffperf.calibrate import load_uncertainty
from diffperf.cli import main
from diffperf.internal import default_data_paths

DATA = Path(__file__).resolve().parent.parent / "benchmarks_data"
HOLDOUT = DATA / "infer_trtllm10_holdout.csv"


def _shipped() -> dict:
    return json.loads(resources.files("diffperf.presets").joinpath("efficiency.json")
                      .read_text())


def test_shipped_support_is_what_the_calibration_data_spans():
    support = load_uncertainty().error_model.support
    table = pd.read_csv(default_data_paths()[1])
    classes = {"fp32": 0, "tf32": 0, "bf16": 1, "fp16": 1, "fp8": 2, "fp4": 3}
    assert support["infer"]["gpus"] == sorted(set(table["gpu"]))
    assert support["infer"]["precisions"] == sorted({classes[p] for p in table["precision"]})
    assert support["infer"]["max_experts"] == table["num_experts"].max()
    train = pd.concat([pd.read_csv(p) for p in default_data_paths()
                       if "infer" not in p.name])
    assert support["train"]["max_gpus"] == train["num_gpus"].max()
    assert support["train"]["max_experts"] == train["num_experts"].max()


def _width(iv: dict) -> float:
    return math.log(iv["high"] / iv["low"]) / 2


@pytest.mark.slow
def test_infer_cli_widens_and_says_why_for_an_unseen_gpu_precision_or_hardware(capsys):
    base = ["infer", "--model", "llama3-70b", "--batch", "64", "--input", "512",
            "--output", "256", "--interval", "--json"]
    h100 = base + ["--gpu", "h100-sxm5-80gb", "--tp", "2", "--precision", "fp8"]
    assert main(h100) == 0
    iv = json.loads(capsys.readouterr().out)["e2e_latency_interval_s"]
    assert "note" not in iv and iv["why"] == []
    narrow = _width(iv)
    assert main(base + ["--gpu", "dgx-b200", "--precision", "fp4"]) == 0
    iv = json.loads(capsys.readouterr().out)["e2e_latency_interval_s"]
    assert "no calibrated inference run on b200" in iv["note"]
    # FP4 widens it too, but at the 2026-11-29 fit by x1.03 only (the held-out FP4 rows are
    # predicted within 8-10 % since dense NVFP4 GEMMs run at their measured rate), below the
    # 5 % at which a reason is named; the GPU's x1.30 is
    assert _width(iv) > 1.3 * narrow
    # what-if hardware is outside every calibrated measurement: an unseen GPU
    assert main(h100 + ["--set", "hbm_bandwidth=x2"]) == 0
    iv = json.loads(capsys.readouterr().out)["e2e_latency_interval_s"]
    assert "what-if hardware (--set)" in iv["note"] and _width(iv) > narrow


@pytest.mark.slow
def test_a_fine_grained_moe_model_is_widest_and_the_text_names_it_once(capsys):
    args = ["infer", "--model", "deepseek-v3", "--gpu", "b200", "--tp", "8", "--precision",
            "fp8", "--interval"]
    assert main(args + ["--json"]) == 0
    iv = json.loads(capsys.readouterr().out)["e2e_latency_interval_s"]
    # the expert count is named among the reasons, by the novelty covariate ("256 experts,
    # calibrated runs had at most 8") or the MoE regime's ("a MoE model (256 experts)"),
    # whichever the fitted slopes weigh more (the novelty slope was x1.46 at the 2026-11-28
    # fit, about 1 since the measured CUTLASS factors of 2026-11-29; the regime's x1.25)
    named = [w for w in iv["why"] if "256 experts" in w]
    assert len(named) == 1
    # far wider than a calibrated configuration's (Llama 3 70B FP8 on 8 H100: no reason)
    assert main(["infer", "--model", "llama3-70b", "--gpu", "h100-sxm5-80gb", "--tp", "8",
                 "--precision", "fp8", "--interval", "--json"]) == 0
    calibrated = json.loads(capsys.readouterr().out)["e2e_latency_interval_s"]
    assert calibrated["why"] == []
    # 2.5x at the 2026-11-29 fit (above 3x before the measured CUTLASS MoE factors shrank the
    # MoE serving rows' errors, and with them the MoE slopes)
    assert _width(iv) > 2 * _width(calibrated)
    assert main(args) == 0
    out = capsys.readouterr().out
    # the text output prints a note once, not under both intervals
    assert out.count(named[0].split(" (x")[0]) == 1


@pytest.mark.slow
def test_held_out_table_falls_inside_its_intervals(capsys):
    """`predict --interval` on the TensorRT-LLM 1.0 table (its rows are among the error
    model's residuals, so this checks the fit, not a new table: `calibration/report.md`
    scores it held out): most values inside, and the MoE rows' intervals say why."""
    assert main(["predict", "--data", str(HOLDOUT), "--interval", "--json"]) == 0
    preds = {r["id"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    inside = 0
    for _, r in pd.read_csv(HOLDOUT).iterrows():
        p = preds[r["id"]]
        # throughput = batch * output / latency: its interval is the latency's, inverted
        scale = p["output_tok_s_per_gpu"] * p["e2e_latency_s"]
        inside += (scale / p["interval_high_s"] <= r["output_tok_s_per_gpu"]
                   <= scale / p["interval_low_s"])
        if r["num_experts"] > 8:
            assert "128 experts" in p["interval_why"], r["id"]
    assert inside >= 0.85 * len(preds)


def _calibrate(capsys, tmp_path, data, *extra):
    fitted = tmp_path / "fitted.json"
    argv = ["calibrate", "--out", str(fitted), "--steps", "0", "--lbfgs-steps", "0", "--quiet",
            "--moe-holdout", "none", "--json", *extra, "--data", str(data)]
    code = main(argv)
    cap = capsys.readouterr()
    return code, json.loads(fitted.read_text()) if code == 0 else None, cap.err


@pytest.mark.slow
def test_calibrate_fits_its_error_model_with_the_held_out_rows(capsys, tmp_path):
    """`diffperf calibrate` fits an error model on its residuals and the held-out rows',
    predicted with its own saved fit: the held-out Blackwell FP4 and MoE rows (outside its
    data) widen what lies outside; `--infer-holdout none` leaves them out; a training-only fit
    gives no inference interval."""
    table = pd.read_csv(default_data_paths()[1])
    latency = tmp_path / "latency.csv"
    table[table["id"].str.startswith("imec-inf")].to_csv(latency, index=False)
    code, saved, err = _calibrate(capsys, tmp_path, latency)
    assert code == 0, err
    em = saved["uncertainty"]["error_model"]
    assert em["support"]["infer"]["gpus"] == ["a100-sxm4-80gb", "h100-sxm5-80gb"]
    assert em["n"] == 22 + 120 and "120 held-out" in saved["metadata"]["error_model_basis"]
    coef = dict(zip(em["covariates"], em["coef"]))
    assert coef["experts_beyond"] > 0 and coef["gpu_unseen"] + coef["precision_unseen"] > 0

    code, saved, _ = _calibrate(capsys, tmp_path, latency, "--infer-holdout", "none")
    assert code == 0 and saved["uncertainty"]["error_model"]["n"] == 22

    train = tmp_path / "train.csv"
    pd.read_csv(default_data_paths()[0]).head(3).to_csv(train, index=False)
    code, saved, _ = _calibrate(capsys, tmp_path, train, "--infer-holdout", "none")
    assert code == 0 and list(saved["uncertainty"]["error_model"]["support"]) == ["train"]
    from diffperf.calibrate._uncertainty import require_error_model
    u = load_uncertainty(str(tmp_path / "fitted.json"))
    require_error_model(u, "train")
    with pytest.raises(ValueError, match="the fit has no infer measurements"):
        require_error_model(u, "infer")


def test_calibrate_rejects_a_missing_infer_holdout_before_fitting(capsys, tmp_path):
    code, saved, err = _calibrate(capsys, tmp_path, default_data_paths()[1],
                                  "--infer-holdout", str(tmp_path / "absent.csv"))
    assert code == 2 and saved is None
    assert "--infer-holdout" in err and "absent.csv: file not found" in err


@pytest.mark.parametrize("key, bad, message", [
    ("support", ["b200"], "must map 'train' / 'infer'"),
    ("gpus", "b200", "infer.gpus must be a list of names"),
    ("precisions", [7], "infer.precisions must be precision classes 0-3"),
    ("precisions", [True], "infer.precisions must be precision classes 0-3"),
    ("max_experts", 0, "infer.max_experts must be a number >= 1"),
])
def test_malformed_error_model_support_is_named(tmp_path, key, bad, message):
    data = _shipped()
    em = data["uncertainty"]["error_model"]
    if key == "support":
        em["support"] = bad
    else:
        em["support"]["infer"][key] = bad
    path = tmp_path / "eff.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"eff\.json: uncertainty\.error_model\.support"):
        load_uncertainty(str(path))
    with pytest.raises(ValueError, match=message):
        load_uncertainty(str(path))


@pytest.mark.slow
def test_serve_interval_brackets_each_served_quantity_and_says_why(capsys):
    """`serve --interval`: TTFT / TPOT percentiles and tokens/s inside their error-model
    intervals, as wide as the error model says for a served configuration of that quantity;
    an unseen GPU never narrows them."""
    import numpy as np

    import diffperf as dp
    from diffperf.calibrate import spec_descriptor
    base = ["serve", "--model", "llama3-8b", "--rate", "4", "--num-requests", "40",
            "--input", "256", "--output", "32", "--interval", "--json"]
    em = load_uncertainty().error_model
    widths = {}
    for gpu in ("h100-sxm5-80gb", "b200"):
        assert main(base + ["--gpu", gpu]) == 0
        out = json.loads(capsys.readouterr().out)
        iv = out["intervals"]
        assert iv["level"] == 0.9
        for label, value, quantity in (
                ("TTFT p50", out["ttft_ms"]["p50"], "serve_ttft"),
                ("TPOT p90", out["tpot_ms"]["p90"], "serve_token_latency"),
                ("ITL p50", out["itl_ms"]["p50"], "serve_token_latency"),
                ("output tokens/s", out["output_tok_s"], "serve_throughput")):
            assert iv[label]["low"] < value < iv[label]["high"], label
            d = spec_descriptor(dp.model("llama3-8b"), dp.system(gpu), dp.InferencePlan(),
                                quantity, gpu, "trtllm", load="online")
            assert math.log(iv[label]["high"] / value) == pytest.approx(em.for_descriptor(d),
                                                                      rel=1e-6), label
        widths[gpu] = np.log(iv["TPOT p50"]["high"] / iv["TPOT p50"]["low"])
        # (the serving simulator's own unseen-GPU slope is fitted near 0: whether "no
        # calibrated inference run on b200" is listed depends on the fit, not asserted)
    # an unseen GPU never narrows a served interval, and widens it when its slope is fitted > 0
    slope = dict(zip(em.names, em.coef))["serve_gpu_unseen"]
    assert slope >= 0
    assert widths["b200"] >= widths["h100-sxm5-80gb"] * (1 - 1e-9)
    if slope > 1e-6:
        assert widths["b200"] > widths["h100-sxm5-80gb"]
