"""The command line: readable and JSON output, clear one-line errors, no tracebacks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from diffperf.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_train_json_breakdown_adds_up(capsys):
    code, out, _ = run(capsys, "train", "--model", "gpt-7.5b", "--gpus", "32", "--tp", "4",
                       "--pp", "2", "--vp", "1", "--global-batch", "64", "--json")
    assert code == 0
    s = json.loads(out)
    assert s["num_gpus"] == 32 and s["feasible"]
    assert sum(s["breakdown_s"].values()) == pytest.approx(s["step_time_s"], rel=1e-5)
    assert 0 < s["mfu"] <= s["hfu"] < 1


def test_train_memory_recipe_flags(capsys):
    """NVIDIA's FSDP recipe for Llama-3 70B on GB200: without offloading it does not fit; 40
    offloaded layers fit and add an exposed-copy line; 16-bit gradients halve the gradients."""
    base = ("train", "--model", "llama3-70b", "--gpu", "gb200", "--gpus", "64", "--tp", "1",
            "--pp", "1", "--vp", "1", "--zero", "3", "--micro-batch", "2", "--global-batch",
            "256", "--recompute", "none", "--precision", "fp8")
    plain = json.loads(run(capsys, *base, "--json")[1])
    recipe = json.loads(run(capsys, *base, "--no-fp32-gradients", "--offload-layers", "40",
                            "--json")[1])
    assert not plain["fits"] and recipe["fits"]
    assert recipe["memory_gb"]["gradients"] == pytest.approx(plain["memory_gb"]["gradients"] / 2)
    assert plain["breakdown_s"]["offload_exposed"] == 0.0
    # The exposed copy time follows the host link: a quarter of its bandwidth exposes far more
    # (the copies outlast the layers they hide behind), a 1000x faster link hides them all.
    exposed = {bw: json.loads(run(capsys, *base, "--no-fp32-gradients", "--offload-layers", "40",
                                  "--set", f"host_bandwidth=x{bw}", "--json")[1])
               ["breakdown_s"]["offload_exposed"] for bw in (0.25, 1000)}
    assert recipe["breakdown_s"]["offload_exposed"] > 0.01
    assert exposed[0.25] > 10 * recipe["breakdown_s"]["offload_exposed"]
    assert exposed[1000] < 1e-6
    assert sum(recipe["breakdown_s"].values()) == pytest.approx(recipe["step_time_s"], rel=1e-5)
    code, out, _ = run(capsys, *base, "--offload-layers", "40")
    assert code == 0 and "offload_exposed" in out and "offload 40 layers/chunk" in out
    assert "offload_exposed" not in run(capsys, *base)[1]
    code, _, err = run(capsys, *base, "--offload-layers", "-1")
    assert code == 2 and err.strip() == "error: --offload-layers must be >= 0, got -1"
    code, _, err = run(capsys, *base, "--offload-layers", "81")
    assert code == 2 and "--offload-layers 81 exceeds the layers per pipeline chunk" in err
    code, _, err = run(capsys, *base, "--recompute-layers", "200")
    assert code == 2 and "--recompute-layers 200" in err
    code, _, err = run(capsys, *base[:-2], "--recompute", "full", "--offload-layers", "40")
    assert code == 2 and "no effect with --recompute full" in err
    # Megatron-LM's gradient default: 16-bit with fp16, fp32 with bf16.
    fp16 = json.loads(run(capsys, *base[:-2], "--precision", "fp16", "--json")[1])
    bf16 = json.loads(run(capsys, *base[:-2], "--precision", "bf16", "--json")[1])
    assert fp16["memory_gb"]["gradients"] == pytest.approx(bf16["memory_gb"]["gradients"] / 2)


def test_train_expert_parallel_flags(capsys):
    """NVIDIA's DeepSeek-V3 / Qwen3-235B H100 layout: TP 2 and PP 8 leave 32 ranks per stage on
    256 GPUs, so EP 32 needs expert TP 1 (Megatron-core's rule, named in the error);
    overlapping the all-to-alls never costs time."""
    def args(ep, *extra):
        return ("train", "--model", "deepseek-v3", "--gpu", "h100-sxm5-80gb", "--gpus", "256",
                "--tp", "2", "--pp", "8", "--vp", "1", "--ep", str(ep), "--global-batch",
                "1024", "--precision", "fp8", *extra)
    code, _, err = run(capsys, *args(32))
    assert code == 2 and "ep * expert_tp does not divide tp * cp * dp" in err
    assert "expert_tp=2" in err
    folded = json.loads(run(capsys, *args(32, "--expert-tp", "1", "--json"))[1])
    hidden = json.loads(run(capsys, *args(32, "--expert-tp", "1", "--overlap-ep", "--json"))[1])
    assert hidden["step_time_s"] < folded["step_time_s"]
    code, _, err = run(capsys, *args(8, "--expert-tp", "-1"))
    assert code == 2 and "--expert-tp must be >= 0" in err


def test_train_zero3_per_matrix_pays_more_gathers(capsys):
    """DeepSpeed-style ZeRO-3 (one gather per weight matrix) over 256 GPUs exposes more
    data-parallel communication than FSDP-style per-layer gathers; compute is unchanged."""
    base = ("train", "--model", "gpt-7.5b", "--gpus", "256", "--tp", "1", "--pp", "1", "--vp",
            "1", "--zero", "3", "--global-batch", "256", "--json")
    per_layer = json.loads(run(capsys, *base)[1])["breakdown_s"]
    per_matrix = json.loads(run(capsys, *base, "--zero3-per-matrix")[1])["breakdown_s"]
    assert per_matrix["compute"] == pytest.approx(per_layer["compute"], rel=1e-6)
    dp_key = next(k for k in per_layer if k.startswith("dp_comm"))
    assert per_matrix[dp_key] > per_layer[dp_key] > 0


def test_train_interval_brackets_the_prediction(capsys):
    code, out, _ = run(capsys, "train", "--model", "gpt-7.5b", "--gpus", "32", "--tp", "4",
                       "--pp", "2", "--vp", "1", "--global-batch", "64", "--interval", "--json")
    assert code == 0
    s = json.loads(out)
    iv = s["step_time_interval_s"]
    assert iv["low"] < s["step_time_s"] < iv["high"]
    assert "90% interval" in iv["text"]


def test_train_readable_output(capsys):
    code, out, _ = run(capsys, "train", "--model", "gpt-7.5b", "--gpus", "16", "--tp", "8",
                       "--pp", "1", "--vp", "1", "--global-batch", "32")
    assert code == 0
    assert "step time" in out and "MFU / HFU" in out and "memory per GPU" in out


@pytest.mark.parametrize("flash", ["--flash", "--no-flash"])
def test_train_explains_zero_selective_recompute_only_with_flash(capsys, flash):
    """Selective recompute with a flash kernel costs 0 s in the recompute row (the kernel's own
    backward recomputes the scores); the readable output says so, and without flash the row is
    a positive time with no such remark."""
    code, out, _ = run(capsys, "train", "--model", "gpt-7.5b", "--gpus", "16", "--tp", "8",
                       "--pp", "1", "--vp", "1", "--global-batch", "32",
                       "--recompute", "selective", flash)
    assert code == 0
    row = next(line for line in out.splitlines() if line.strip().startswith("recompute "))
    seconds = float(row.split()[1])
    if flash == "--flash":
        assert seconds == 0.0 and "inside its backward" in row
    else:
        assert seconds > 0.0 and "inside its backward" not in row


@pytest.mark.parametrize("argv, needle", [
    (["train", "--gpus", "1000", "--tp", "8", "--pp", "8"], "not divisible by tp*pp*cp"),
    (["train", "--gpu", "tpu-v9"], "unknown gpu or system 'tpu-v9'"),
    (["train", "--gpu", "a100"], "--gpu: ambiguous gpu or system 'a100': a100-sxm4-40gb, "
                                 "a100-sxm4-80gb"),
    (["attribution", "--targets", "dgx-h100", "h1"], "--targets: unknown gpu or system 'h1'"),
    (["train", "--model", "gpt-13b"], "unknown model 'gpt-13b'"),
    (["train", "--dp", "3", "--gpus", "64", "--tp", "8", "--pp", "8"], "does not equal --gpus"),
    (["validate", "--data", "no/such/file.csv"], "--data: no such file: no/such/file.csv"),
    (["infer", "--model", "llama2-70b", "--gpu", "a100-sxm4-80gb", "--tp", "3"],
     "tp does not divide heads (tp=3, heads=64)"),
    (["train", "--tp", "0"], "--tp must be >= 1, got 0"),
    (["train", "--gpus", "-64"], "--gpus must be >= 1, got -64"),
    (["train", "--efficiency", "."], "--efficiency: not a file: ."),
    (["search", "train", "--gpus", "8", "--out", "no/such/dir/best.csv"],
     "--out: directory does not exist: no/such/dir"),
    (["search", "infer", "--latency", "-1"], "--latency must be > 0, got -1.0"),
    (["technology", "--nodes", "30"], "--nodes must lie in [1, 12] nm"),
    (["codesign", "--memory-gen", "9"], "--memory-gen must lie in [0, 5], got 9"),
    (["calibrate", "--data", "benchmarks_data/train_calibration.csv", "--out", "x.json",
      "--prior-weight", "-1"], "--prior-weight must be >= 0, got -1.0"),
    (["calibrate", "--data", "benchmarks_data/train_calibration.csv", "--out", "x.json",
      "--cv", "kfold", "--folds", "1"], "--folds must be >= 2"),
    (["sensitivity", "--workload", "infer", "--tp", "3"], "tp does not divide heads (tp=3"),
    (["sensitivity", "--tp", "4"], "--tp does not apply to --workload train"),
    (["train", "--nvlink-domain", "16", "--set", "nvlink_domain=72"],
     "--nvlink-domain and --set nvlink_domain=... both set the NVLink domain"),
    (["sensitivity", "--workload", "infer", "--gpus", "8", "--global-batch", "8"],
     "--gpus and --global-batch do not apply to --workload infer"),
    (["calibrate", "--out", "x.json", "--prior-weight", "nan"],
     "--prior-weight must be a finite number, got nan"),
    (["search", "infer", "--latency", "inf"], "--latency must be a finite number, got inf"),
    (["train", "--gpus", "16777224"], "--gpus must be <= 16777216 (2^24"),
    (["search", "train", "--model", "gpt-1.7b", "--gpus", "8", "--offload-layers", "24"],
     "--offload-layers must be fewer than the model's 24 layers"),
    (["validate", "--data", "benchmarks_data/train_calibration.csv", "--data",
      "./benchmarks_data/train_calibration.csv"], "is given twice (its rows would count twice)"),
    # Output formats are checked before the work, not after it.
    (["search", "train", "--gpus", "8", "--out", "best.txt"],
     "--out: use a .csv or .parquet file name, got best.txt"),
    (["infer", "--model", "llama2-7b", "--gpu", "h100-sxm5-80gb", "--plot", "roof.xyz"],
     "--plot: unsupported image format '.xyz' of roof.xyz; use one of"),
    (["attribution", "--plot", ""], "--plot: expected a file name, got an empty string"),
    (["train", "--model", "gpt-1.7b", "--gpus", "1", "--tp", "1", "--pp", "1", "--vp", "1",
      "--global-batch", "1", "--seq-len", "1000000000000000"],
     "--seq-len must be <= 16777216"),
    (["train", "--zero3-per-matrix"], "--zero3-per-matrix describes ZeRO-3's gathers; it needs "
                                      "--zero 3 (got --zero 1)"),
    (["infer", "--model", " ", "--gpu", "h100-sxm5-80gb"], "--model is empty"),
    (["technology", "--references-only", "--csv", "nodes.csv"],
     "--references-only prints the datasheet check only"),
    (["calibrate", "--data", "benchmarks_data/train_calibration.csv", "--out", "x.json",
      "--fields", ",,"], "--fields names no factor (got ',,')"),
])
def test_bad_input_is_one_clear_line(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("error: ") and needle in err
    assert "Traceback" not in err


def test_infeasible_plan_is_reported_not_raised(capsys):
    code, out, _ = run(capsys, "train", "--model", "gpt-1t", "--gpus", "8", "--tp", "8",
                       "--pp", "1", "--vp", "1", "--global-batch", "8", "--recompute", "none",
                       "--json")
    assert code == 0
    s = json.loads(out)
    assert not s["feasible"] and "does not fit in HBM" in s["reason"]


def test_validate_json_on_a_small_file(capsys, tmp_path):
    import pandas as pd
    df = pd.read_csv("benchmarks_data/train_calibration.csv")
    small = tmp_path / "small.csv"
    df[df["id"].str.startswith("imec-korthi-175b")].to_csv(small, index=False)
    code, out, _ = run(capsys, "validate", "--data", str(small), "--json")
    assert code == 0
    r = json.loads(out)
    assert r["summary"]["step_time_s"]["n"] == 4 and not r["failed"]
    assert {"id", "metric", "measured", "predicted", "ape"} <= set(r["rows"][0])


@pytest.mark.slow
def test_search_train_json(capsys):
    code, out, _ = run(capsys, "search", "train", "--model", "gpt-1.7b", "--gpus", "8",
                       "--global-batch", "32", "--precision", "bf16", "--top", "3", "--json")
    assert code == 0
    r = json.loads(out)
    assert r["evaluated"] > 10_000 and 0 < r["feasible"] < r["evaluated"] and r["seconds"] > 0
    times = [p["step_time_s"] for p in r["top"]]
    assert times == sorted(times) and len(times) == 3


@pytest.mark.slow
def test_search_train_and_train_agree_on_the_best_plan(capsys):
    """Both commands use the GPU's own fitted factors: the step time `search train` reports for
    its best plan is the one `train` prints for that plan (H100 has per-GPU overrides)."""
    common = ["--model", "gpt-1.7b", "--gpu", "h100-sxm5-80gb", "--gpus", "8",
              "--global-batch", "32", "--precision", "bf16"]
    code, out, _ = run(capsys, "search", "train", *common, "--top", "1", "--json")
    assert code == 0
    p = json.loads(out)["top"][0]
    flag = lambda on, name: f"--{name}" if on else f"--no-{name}"
    code, out, _ = run(capsys, "train", *common, "--json", "--tp", str(p["tp"]),
                       "--pp", str(p["pp"]), "--vp", str(p["vp"]), "--cp", str(p["cp"]),
                       "--ep", str(p["ep"]), "--micro-batch", str(p["micro_batch"]),
                       "--recompute", p["recompute"], "--zero", str(p["zero"]),
                       flag(p["sequence_parallel"], "sp"), flag(p["flash_attention"], "flash"),
                       flag(p["overlap_tp"], "overlap-tp"), flag(p["overlap_dp"], "overlap-dp"),
                       flag(p["fp32_gradients"], "fp32-gradients"),
                       "--offload-layers", str(p["offload_layers"]))
    assert code == 0
    assert json.loads(out)["step_time_s"] == pytest.approx(p["step_time_s"], rel=1e-6)


def test_presets_lists_everything(capsys):
    code, out, _ = run(capsys, "presets")
    assert code == 0
    for name in ("h100-sxm5-80gb", "gb200-nvl72", "llama3-405b", "mixtral-8x7b"):
        assert name in out


@pytest.mark.parametrize("argv, needle", [
    (["search", "train", "--gpus", "0"], "--gpus must be >= 1, got 0"),
    (["search", "infer", "--max-gpus", "0"], "--max-gpus must be >= 1, got 0"),
])
def test_search_rejects_non_positive_sizes(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == 2 and needle in err


def test_validate_rejects_a_file_without_rows(capsys, tmp_path):
    header = (Path(__file__).resolve().parent.parent / "benchmarks_data" /
              "train_calibration.csv").read_text().splitlines()[0]
    f = tmp_path / "header_only.csv"
    f.write_text(header + "\n")
    code, _, err = run(capsys, "validate", "--data", str(f))
    assert code == 2 and err.startswith("error: no benchmark rows")


def test_empty_efficiency_file_is_an_error(capsys, tmp_path):
    f = tmp_path / "eff.json"
    f.write_text("{}")
    code, _, err = run(capsys, "train", "--efficiency", str(f))
    assert code == 2 and "sets no factors" in err


def test_hf_config_with_a_non_numeric_field_names_it(capsys, tmp_path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"hidden_size": "abc", "num_attention_heads": 32,
                             "num_hidden_layers": 32, "vocab_size": 32000}))
    code, _, err = run(capsys, "train", "--model", str(f), "--gpus", "8", "--tp", "8",
                       "--pp", "1", "--vp", "1", "--global-batch", "8")
    assert code == 2 and "field 'hidden_size' must be a number, got 'abc'" in err


def test_train_notes_an_uneven_pipeline_layout(capsys):
    code, out, _ = run(capsys, "train", "--pp", "8", "--vp", "5")
    assert code == 0 and "uneven layout: 96 layers over pp*vp = 40" in out
    code, out, _ = run(capsys, "train")
    assert code == 0 and "uneven layout" not in out
    # with the embedding and the loss counted as pipeline layers, 98 slots over 24 chunks
    code, out, _ = run(capsys, "train", "--account-embedding-loss")
    assert code == 0 and "98 slots (96 layers + embedding + loss) over pp*vp = 24" in out


def test_train_notes_that_sp_does_nothing_at_tp_1(capsys):
    """--sp with --tp 1 is accepted (Megatron-LM turns it off) and said to have no effect:
    the step time equals the run without it."""
    base = ("train", "--model", "gpt-1.7b", "--gpus", "8", "--tp", "1", "--pp", "1", "--vp", "1",
            "--global-batch", "64", "--json")
    code, with_sp, _ = run(capsys, *base, "--sp")
    note = json.loads(with_sp)["note"]
    assert code == 0 and "sequence parallelism has no effect with tp = 1" in note
    code, without, _ = run(capsys, *base)
    assert code == 0 and "note" not in json.loads(without)
    assert json.loads(with_sp)["step_time_s"] == json.loads(without)["step_time_s"]


@pytest.mark.slow
def test_unconverged_calibration_warns_and_its_intervals_are_refused(capsys, tmp_path):
    import pandas as pd
    small = tmp_path / "three.csv"
    pd.read_csv("benchmarks_data/train_calibration.csv").head(3).to_csv(small, index=False)
    fitted = tmp_path / "fitted.json"
    code, _, err = run(capsys, "calibrate", "--data", str(small), "--out", str(fitted),
                       "--steps", "0", "--lbfgs-steps", "0", "--quiet")
    assert code == 0 and "warning: the fit did not converge" in err
    code, out, err = run(capsys, "train", "--model", "gpt3-175b", "--gpus", "64", "--tp", "8",
                         "--pp", "8", "--global-batch", "64", "--interval", "--efficiency",
                         str(fitted), "--json")
    assert code == 0 and "Traceback" not in err
    assert "did not converge" in json.loads(out)["step_time_interval_s"]["error"]


def test_search_infer_without_a_feasible_plan_says_why(capsys):
    code, out, _ = run(capsys, "search", "infer", "--gpu", "a100-sxm4-80gb", "--precision",
                       "fp8", "--json")
    r = json.loads(out)
    assert code == 1 and r["feasible"] == 0 and r["top"] == []  # 1: no plan, like grep
    assert r["set"] == []  # no --set: not a what-if search
    assert r["infeasible_by_reason"] == {
        "the GPU has no tensor cores for this precision (fp8)": r["evaluated"]}
    code, out, _ = run(capsys, "search", "infer", "--gpu", "a100-sxm4-80gb", "--precision", "fp8")
    assert code == 1
    assert "no feasible plan; why the plans fail" in out and "Empty DataFrame" not in out


@pytest.mark.slow
def test_search_train_without_a_feasible_plan_exits_1(capsys):
    """GPT-3 175B cannot train on 8 A100s: the reasons are listed and the exit status says
    that nothing was found (2 stays for invalid input)."""
    code, out, _ = run(capsys, "search", "train", "--gpus", "8", "--global-batch", "8")
    assert code == 1 and "no feasible plan" in out and "does not fit in HBM" in out
    # ... and the least memory any plan needs: at least the 16-bit weights and gradients of
    # 175 B parameters spread over 8 GPUs (175e9 * 4 B / 8 = 87.5 GB), more than the 80 GiB
    # (81,920 MiB = 85.9 GB) of an A100 80 GB.
    least = re.search(r"least memory of any plan: ([\d.]+) GB per GPU, the GPU has 85.9 GB", out)
    assert least and float(least.group(1)) > 87.5


@pytest.mark.slow
def test_a_prediction_that_overflows_float32_is_an_error_not_nan():
    # Sizes beyond the CLI's 2^24 cap reach the API: the checked entry points refuse a report
    # with NaN / inf fields and name them. Float32 as the CLI runs (another test may have
    # switched the process to float64, where these sizes do not overflow).
    import jax
    with jax.enable_x64(False):
        _overflow_checks()


def _overflow_checks():
    import diffperf as dp
    from diffperf.inference import infer
    from diffperf.internal import check_finite_report
    from diffperf.training import predict_training
    big = dp.Transformer(layers=24, hidden=2304, heads=24, kv_heads=24, ffn_hidden=9216,
                         vocab=51200, seq_len=1e15)
    plan = dp.TrainingPlan(tp=1, pp=1, dp=1, micro_batch=1, global_batch=1)
    with pytest.raises(ValueError, match=r"the training prediction is not finite: step_time.*"
                                         r"seq_len=1e\+15"):
        predict_training(big, dp.system("a100-sxm4-80gb"), plan)
    rep = infer(dp.model("llama2-7b"), dp.system("a100-sxm4-80gb"),
                dp.InferencePlan(tp=1, batch=1, input_len=1e15, output_len=128))
    with pytest.raises(ValueError, match=r"is not finite: ttft.*input=1e15"):
        check_finite_report(rep, "the inference prediction", "input=1e15")


@pytest.mark.parametrize("option, needle", [("--efficiency", "efficiency file"),
                                            ("--model", "Hugging Face config")])
def test_a_binary_input_file_is_named(capsys, tmp_path, option, needle):
    binary = tmp_path / "blob.json"
    binary.write_bytes(bytes(range(128, 256)))
    code, _, err = run(capsys, "train", option, str(binary))
    assert code == 2 and "Traceback" not in err
    assert str(binary) in err and "is not UTF-8 text" in err and needle in err


def test_vp_defaults_to_1_without_pipeline_and_3_with_it(capsys):
    code, out, _ = run(capsys, "train", "--model", "gpt-1.7b", "--gpus", "8", "--pp", "1",
                       "--global-batch", "8", "--json")
    assert code == 0 and json.loads(out)["feasible"]
    code, out, _ = run(capsys, "train", "--model", "gpt-1.7b", "--gpus", "8", "--pp", "1",
                       "--global-batch", "8")
    assert " vp=1 " in out
    code, out, _ = run(capsys, "train")
    assert " pp=8 " in out and " vp=3 " in out


def test_a_bad_per_gpu_factor_names_the_file_and_gpu(capsys, tmp_path):
    bad = tmp_path / "eff.json"
    bad.write_text(json.dumps({"factors": {}, "per_gpu": {"h100-sxm5-80gb": {"hbm": 1.5}}}))
    code, _, err = run(capsys, "train", "--efficiency", str(bad))
    assert code == 2
    assert f"efficiency file {bad}, per_gpu.h100-sxm5-80gb: Efficiency.hbm must lie in (0, 1]" \
        in err


@pytest.mark.parametrize("field, value, needle", [
    ("hidden_size", 10 ** 400, "field 'hidden_size' must be <= 16777216 (2^24: larger counts are "
                               "not exact in float32), got an integer of 401 digits"),
    ("max_position_embeddings", 10 ** 12, "field 'max_position_embeddings' must be <= 16777216"),
])
def test_huge_counts_in_a_hf_config_are_one_clear_line(capsys, tmp_path, field, value, needle):
    """JSON integers beyond float range or float32 exactness: named, never a traceback or an
    absurd prediction (a 10^12-token context gave a 10^16 s step)."""
    cfg = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
           "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096,
           "model_type": "llama", field: value}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, _, err = run(capsys, "train", "--model", str(path), "--gpus", "8", "--tp", "1",
                       "--pp", "1", "--vp", "1", "--global-batch", "8")
    assert code == 2 and needle in err and "Traceback" not in err


def test_an_efficiency_factor_beyond_float_range_is_named(capsys, tmp_path):
    path = tmp_path / "eff.json"
    path.write_text('{"factors": {"hbm": 1' + "0" * 400 + "}}")
    code, _, err = run(capsys, "train", "--efficiency", str(path))
    assert code == 2 and "Efficiency.hbm must lie in (0, 1], got inf" in err


@pytest.mark.slow
def test_a_measurement_off_by_orders_of_magnitude_prints_compactly(capsys, tmp_path):
    import pandas as pd
    df = pd.read_csv("benchmarks_data/infer_calibration.csv", dtype=str, keep_default_na=False)
    row = df[df["id"] == "imec-inf-a100-llama-2-7b-tp1"].copy()
    row["e2e_latency_s"] = "1e-300"
    path = tmp_path / "tiny.csv"
    row.to_csv(path, index=False)
    code, out, _ = run(capsys, "validate", "--data", str(path))
    assert code == 0
    assert max(len(line) for line in out.splitlines()) < 400
    assert re.search(r"e2e_latency_s +n= +1  MAPE +\d\.\de\+30\d %  max +\d\.\de\+30\d %", out)


def test_an_os_error_on_a_named_file_names_its_option(tmp_path):
    """An unreadable input is reported with the option that named it (--data), not as a bare
    errno; an error about some other file keeps its own message."""
    import argparse
    import errno

    from diffperf.internal import os_error_message as _os_error_message
    data = tmp_path / "rows.csv"
    args = argparse.Namespace(data=[str(tmp_path / "other.csv"), str(data)], out="pred.csv")
    e = PermissionError(errno.EACCES, "Permission denied", str(data))
    assert _os_error_message(e, args) == f"--data {data}: [Errno {errno.EACCES}] Permission denied"
    elsewhere = PermissionError(errno.EACCES, "Permission denied", "/somewhere/else")
    assert _os_error_message(elsewhere, args) == str(elsewhere)


def test_search_tables_show_the_columns_in_which_the_plans_differ():
    """Plans that differ only in, e.g., TP overlap must not print as identical rows."""
    import pandas as pd

    from diffperf.internal import search_columns_shown as _shown
    cols = ["tp", "pp", "overlap_tp", "precision", "offload_layers"]
    df = pd.DataFrame({"tp": [2, 2], "pp": [1, 1], "overlap_tp": [1, 0],
                       "precision": ["bf16", "bf16"], "step_time_s": [10.70, 10.78]})
    assert _shown(df, cols, always=2) == ["tp", "pp", "overlap_tp"]
    assert _shown(df.iloc[:1], cols, always=2) == ["tp", "pp"]


def test_fused_expert_gemm_flag_saves_the_per_expert_launches(capsys):
    """Mixtral 8x7B with all 8 experts on each GPU (ep 1): by default each grouped expert GEMM
    launches one GEMM per expert; `--fused-expert-gemm` makes it one kernel, which is faster by
    at most the launches saved (32 layers x 6 GEMMs x 7 launches per micro-batch, a few us
    each) and changes nothing for a dense model."""
    base = ("train", "--model", "mixtral-8x7b", "--gpus", "8", "--tp", "8", "--pp", "1",
            "--global-batch", "8", "--json")
    code, per_expert, _ = run(capsys, *base)
    assert code == 0
    code, fused, _ = run(capsys, *base, "--fused-expert-gemm")
    assert code == 0
    saved = json.loads(per_expert)["step_time_s"] - json.loads(fused)["step_time_s"]
    micro_batches = 8
    assert 0 < saved <= micro_batches * 32 * 6 * 7 * 20e-6
    dense = ("train", "--model", "gpt-1.7b", "--gpus", "8", "--tp", "1", "--pp", "1", "--vp", "1",
             "--global-batch", "64", "--json")
    code, a, _ = run(capsys, *dense)
    code, b, _ = run(capsys, *dense, "--fused-expert-gemm")
    assert json.loads(a)["step_time_s"] == json.loads(b)["step_time_s"]


@pytest.mark.slow
def test_v100_rejects_bf16_and_tf32_by_name(capsys):
    """fp16 and bf16 share one precision code; V100 has only fp16 tensor cores (and no tf32),
    so the command line checks the names, and search labels V100's 16-bit plans fp16."""
    infer = ("infer", "--model", "llama2-7b", "--gpu", "v100-sxm2-32gb")
    code, _, err = run(capsys, *infer, "--precision", "bf16")
    assert code == 2 and "--precision bf16: V100 has no bf16" in err
    assert run(capsys, *infer, "--precision", "fp16")[0] == 0
    code, out, _ = run(capsys, *infer)  # the default 16-bit precision is fp16 on V100
    assert code == 0 and out.splitlines()[0].endswith("fp16")
    code, _, err = run(capsys, *infer, "--precision", "int8", "--activation-precision", "bf16")
    assert code == 2 and "--activation-precision bf16" in err
    train = ("train", "--model", "gpt-1.7b", "--gpu", "v100-sxm2-32gb", "--gpus", "8",
             "--tp", "1", "--pp", "1", "--global-batch", "64")
    code, _, err = run(capsys, *train, "--precision", "tf32")
    assert code == 2 and "V100 has no tf32" in err
    assert run(capsys, *train, "--precision", "fp16")[0] == 0
    code, out, _ = run(capsys, *train)
    assert code == 0 and "fp16)" in out.splitlines()[0]
    code, out, _ = run(capsys, "search", "train", "--model", "gpt-1.7b", "--gpu",
                       "v100-sxm2-32gb", "--gpus", "8", "--global-batch", "64", "--top", "3",
                       "--json")
    assert code == 0
    assert {r["precision"] for r in json.loads(out)["top"]} <= {"fp16", "fp32"}


def test_train_notes_a_foreign_gpu_in_a_system_and_zero3_with_pipelining(capsys):
    base = ("train", "--model", "gpt3-175b", "--gpus", "1024", "--tp", "8", "--pp", "8",
            "--global-batch", "1536")
    code, _, err = run(capsys, *base, "--gpu", "a100-sxm4-80gb", "--system", "gb200-nvl72")
    assert code == 0 and "which is built with gb200" in err
    code, _, err = run(capsys, *base, "--gpu", "gb200", "--system", "gb200-nvl72")
    assert code == 0 and "built with" not in err
    code, out, _ = run(capsys, *base, "--zero", "3")
    assert code == 0 and "ZeRO-3 with pp > 1" in out
    assert "ZeRO-3 with pp > 1" not in run(capsys, *base, "--zero", "1")[1]


def test_small_cli_fixes_from_the_design_bug_bash(capsys):
    """bench --n 1 is refused by name (it crashed deep inside vmap); infer --json says whether
    the plan is feasible, like train --json; a num_sms what-if says the FLOP/s stay."""
    code, _, err = run(capsys, "bench", "--n", "1")
    assert code == 2 and "--n must be at least 2" in err
    code, out, _ = run(capsys, "infer", "--model", "llama2-70b", "--gpu", "h100-sxm5-80gb",
                       "--tp", "1", "--json")
    r = json.loads(out)
    assert code == 0 and r["feasible"] is False and r["reason"] == "does not fit in HBM"
    code, out, _ = run(capsys, "infer", "--model", "llama2-7b", "--gpu", "h100-sxm5-80gb",
                       "--set", "num_sms=x0.5")
    assert code == 0 and "the FLOP/s stay" in out


def test_short_gpu_names_stand_for_their_one_preset(capsys):
    """`--gpu H100` is the H100 preset under its full id, with the H100's own fitted factors:
    the same prediction as `--gpu h100-sxm5-80gb` (the short name reaches no lookup)."""
    base = ("train", "--model", "gpt-7.5b", "--gpus", "32", "--tp", "4", "--pp", "2", "--vp",
            "1", "--global-batch", "64")
    short = json.loads(run(capsys, *base, "--gpu", "H100", "--json")[1])
    full = json.loads(run(capsys, *base, "--gpu", "h100-sxm5-80gb", "--json")[1])
    assert short == full
    code, out, _ = run(capsys, *base, "--gpu", "h100")
    assert code == 0 and "on 32 x h100-sxm5-80gb" in out.splitlines()[0]
