"""What-if hardware (`--set FIELD=VALUE|xFACTOR`): the override changes exactly the named
parameter, the prediction is the model's on the changed system, and bad items are named."""

from __future__ import annotations

import json

import equinox as eqx
import jax
import numpy as np
import pytest

import diffperf as dp
from diffperf.cli import main
from diffperf.explore import apply_overrides, parse_overrides


def _leaves(tree):
    return [float(x) for x in jax.tree.leaves(tree)]


def test_a_factor_scales_one_field_and_leaves_the_rest():
    base = dp.system("h100-sxm5-80gb")
    changed = apply_overrides(base, parse_overrides(["hbm_bandwidth=x2", "nvlink_domain=72"]))
    assert float(changed.accelerator.hbm_bandwidth) == 2 * float(base.accelerator.hbm_bandwidth)
    assert float(changed.network.nvlink_domain) == 72.0
    expect = eqx.tree_at(lambda s: (s.accelerator.hbm_bandwidth, s.network.nvlink_domain), base,
                         (2 * base.accelerator.hbm_bandwidth, 72.0))
    assert _leaves(changed) == _leaves(expect)
    qualified = apply_overrides(base, parse_overrides(["accelerator.hbm_bandwidth=6.7e12"]))
    # (float32 leaves, or float64 once a calibration test has enabled x64)
    assert float(qualified.accelerator.hbm_bandwidth) == pytest.approx(6.7e12, rel=1e-7)


@pytest.mark.parametrize("items, needle", [
    (["hbm_bandwidth"], "expected FIELD=VALUE or FIELD=xFACTOR"),
    (["hbm_bw=x2"], "unknown hardware field 'hbm_bw'"),
    (["network.hbm_bandwidth=1"], "unknown hardware field 'network.hbm_bandwidth'"),
    (["hbm_bandwidth=fast"], "'fast' is not a number"),
    (["hbm_bandwidth=-1"], "must be a finite non-negative number"),
    (["hbm_bandwidth=x0"], "factor must be a finite positive number"),
    (["hbm_bandwidth=x2", "hbm_bandwidth=1e12"], "--set hbm_bandwidth is given twice"),
    (["hbm_bandwidth=0"], "--set hbm_bandwidth=0: Accelerator.hbm_bandwidth must be"),
    (["num_sms=x1.1"], "--set num_sms=x1.1: Accelerator.num_sms must be a whole number"),
    (["nvlink_sharp=2"], "Network.nvlink_sharp must be 0 or 1"),
    (["flops_fp4=x2"], "flops_fp4 is 0 in the preset, and a multiple of 0 stays 0"),
])
def test_bad_overrides_are_named(items, needle):
    with pytest.raises(ValueError) as e:
        apply_overrides(dp.system("h100-sxm5-80gb"), parse_overrides(items))
    assert needle in str(e.value)


def test_more_hbm_bandwidth_speeds_up_memory_bound_decode_and_never_slows_anything():
    model, base = dp.model("llama2-70b"), dp.system("h100-sxm5-80gb")
    plan = dp.InferencePlan(tp=4, batch=1, input_len=128, output_len=128)
    r0 = dp.infer(model, base, plan)
    r1 = dp.infer(model, apply_overrides(base, parse_overrides(["hbm_bandwidth=x2"])), plan)
    assert float(r1.tpot) < 0.9 * float(r0.tpot)  # batch-1 decode streams the weights
    assert float(r1.ttft) <= float(r0.ttft) and float(r1.e2e_latency) < float(r0.e2e_latency)


def _cli_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_train_set_predicts_the_changed_system_and_compares_with_the_preset(capsys):
    argv = ("train", "--model", "gpt-7.5b", "--gpus", "32", "--tp", "4", "--pp", "2", "--vp", "1",
            "--global-batch", "64", "--json")
    plain = _cli_json(capsys, *argv)
    what_if = _cli_json(capsys, *argv, "--set", "nvlink_bandwidth=x0.25")
    assert what_if["what_if"]["preset"]["step_time_s"] == plain["step_time_s"]
    model, base = dp.model("gpt-7.5b"), dp.system("a100-sxm4-80gb")
    slow = eqx.tree_at(lambda s: s.network.nvlink_bandwidth, base,
                       base.network.nvlink_bandwidth * 0.25)
    plan = dp.TrainingPlan(tp=4, pp=2, dp=4, micro_batch=1, global_batch=64, vp=1,
                           sequence_parallel=1, recompute="selective", zero=1)
    eff = dp.default_efficiency().for_gpu("a100-sxm4-80gb")  # the CLI's: the GPU's factors
    expect = float(dp.predict_training(model, slow, plan, eff).step_time)
    np.testing.assert_allclose(what_if["step_time_s"], expect, rtol=1e-6)
    assert what_if["step_time_s"] > plain["step_time_s"]  # a quarter of the NVLink: TP slower
    assert what_if["what_if"]["changes"] == ["nvlink_bandwidth 3e+11 -> 7.5e+10 B/s (x0.25)"]


def test_infer_set_text_shows_the_comparison(capsys):
    assert main(["infer", "--model", "llama2-7b", "--gpu", "h100-sxm5-80gb",
                 "--set", "launch_overhead=0"]) == 0
    out = capsys.readouterr().out
    assert "[what-if launch_overhead=0]" in out.splitlines()[0]
    assert "what-if vs the preset (launch_overhead 3e-06 -> 0 s (x0))" in out
    tpot = [line for line in out.splitlines() if line.strip().startswith("TPOT") and "->" in line]
    assert len(tpot) == 1 and "(-" in tpot[0]  # no launch cost: each token is faster


def test_a_plan_only_the_changed_hardware_can_run_has_no_preset_numbers(capsys):
    """fp8 on an A100 with fp8 tensor cores added: the what-if runs, the preset is reported as
    unable to run the plan (not as absurd numbers, not as an error of the whole command)."""
    infer = _cli_json(capsys, "infer", "--model", "llama2-7b", "--gpu", "a100-sxm4-80gb",
                      "--precision", "fp8", "--set", "flops_fp8=6e14", "--json")
    assert infer["what_if"]["preset"] == {
        "feasible": False, "reason": "the GPU has no tensor cores for this precision (fp8)"}
    assert 0 < infer["ttft_s"] < 1
    train = _cli_json(capsys, "train", "--gpus", "64", "--tp", "8", "--pp", "8",
                      "--global-batch", "64", "--precision", "fp8", "--set", "flops_fp8=6e14",
                      "--json")
    assert train["what_if"]["preset"]["feasible"] is False
    assert "no tensor cores" in train["what_if"]["preset"]["reason"]
    assert train["feasible"] and train["step_time_s"] > 0


def test_values_beyond_float32_are_refused():
    base = dp.system("h100-sxm5-80gb")
    for item in ("hbm_bandwidth=1e300", "hbm_bandwidth=x1e-300"):
        with pytest.raises(ValueError, match="outside the range of the model's float32"):
            apply_overrides(base, parse_overrides([item]))


def test_system_alone_means_its_own_gpu(capsys):
    """`--system gb200-nvl72` without --gpu trains on GB200s (it used to put A100s into the
    NVL72 network), in train and search alike."""
    out = _cli_json(capsys, "train", "--system", "gb200-nvl72", "--gpus", "72", "--tp", "8",
                    "--pp", "1", "--vp", "1", "--global-batch", "72", "--json")
    assert out["memory_gb"]["capacity"] == pytest.approx(
        float(dp.system("gb200").accelerator.hbm_capacity) / 1e9)
    mixed = _cli_json(capsys, "train", "--system", "gb200-nvl72", "--gpu", "h100-sxm5-80gb",
                      "--gpus", "72", "--tp", "8", "--pp", "1", "--vp", "1",
                      "--global-batch", "72", "--json")
    assert mixed["memory_gb"]["capacity"] == pytest.approx(81559 * 2**20 / 1e9)  # H100's NVML total
