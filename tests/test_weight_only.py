"""Weight-only quantisation (`weight_precision` narrower than the GEMM precision) and GEMM kernels
that cannot issue the GPU's full tensor peak (`gemm_peak_fraction`)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from diffperf.inference import inference_ops, weight_bytes_per_gpu
from diffperf.presets import model, system
from diffperf.specs import Efficiency, InferencePlan
from diffperf.validation import BenchmarkError, infer_specs, read_benchmarks

ROOT = Path(__file__).resolve().parent.parent
INFER_CSV = ROOT / "benchmarks_data" / "infer_calibration.csv"
H100 = "h100-sxm5-80gb"
WEIGHT_GEMMS = ("qkv_proj", "out_proj", "mlp_up", "mlp_down")


def _prefill(mdl, plan):
    return inference_ops(mdl, system(H100), plan, Efficiency())["prefill"]


def test_gemm_peak_fraction_divides_the_weight_gemms_compute_rate_only():
    """At 2/3 of the peak each weight GEMM's compute time is exactly 1.5x, its traffic and
    launches unchanged; the router, the LM head and attention keep the full peak."""
    mdl = model("mixtral-8x7b")
    base = InferencePlan(tp=2, batch=4, input_len=2048, output_len=1)
    slow = InferencePlan(tp=2, batch=4, input_len=2048, output_len=1, gemm_peak_fraction=2 / 3)
    a, b = _prefill(mdl, base), _prefill(mdl, slow)
    for op in WEIGHT_GEMMS:
        assert float(b[op].compute) == pytest.approx(1.5 * float(a[op].compute), rel=1e-5), op
        assert float(b[op].memory) == pytest.approx(float(a[op].memory), rel=1e-6), op
        assert float(b[op].launch) == pytest.approx(float(a[op].launch), rel=1e-6), op
    for op in ("router", "lm_head", "attention", "elementwise"):
        assert float(b[op].compute) == pytest.approx(float(a[op].compute), rel=1e-6), op


def test_4_bit_weights_carry_their_block_scales_by_hand():
    """NVFP4 weights are 4-bit values plus one 8-bit scale per 16 (0.5625 B each); MXFP4 and
    group-wise int4 one per 32 (0.53125 B). Only the layers' weight matrices change; a decode
    step's weight-streaming GEMM reads that many more bytes."""
    mdl = model("llama2-7b")  # 32 layers, h 4096, f 11008 (gated), vocab 32000
    h, f = 4096, 11008
    matrices = 32 * (4 * h * h + 3 * h * f)
    plans = {b: InferencePlan(weight_precision="fp4", activation_precision="bf16",
                              weight_scale_block=b, batch=1, input_len=1, output_len=2)
             for b in (16, 32)}
    w16 = InferencePlan(weight_precision="bf16", batch=1, input_len=1, output_len=2)
    for block, want in ((16, 0.5625), (32, 0.53125)):
        assert float(plans[block].weight_bytes) == want
        saved = (float(weight_bytes_per_gpu(mdl, w16))
                 - float(weight_bytes_per_gpu(mdl, plans[block])))
        assert saved == pytest.approx(matrices * (2 - want), rel=1e-6)
    step = {b: inference_ops(mdl, system(H100), p, Efficiency())["decode"]
            for b, p in plans.items()}
    for op in ("mlp_up", "mlp_down"):
        # weights dominate a batch-1 decode GEMM's traffic: the ratio is close to 18 / 17
        ratio = float(step[16][op].bytes) / float(step[32][op].bytes)
        assert 1.055 < ratio <= 0.5625 / 0.53125 + 1e-6, op
    assert float(InferencePlan(weight_precision="fp8", weight_scale_block=32).weight_bytes) == 1.0
    # by default the block follows the weights' name: int4 (and MXFP4) 32, NVFP4 16
    assert float(InferencePlan(weight_precision="int4").weight_scale_block) == 32.0
    assert float(InferencePlan(weight_precision="fp4").weight_scale_block) == 16.0
    with pytest.raises(ValueError, match="weight_scale_block"):
        InferencePlan(weight_scale_block=2.5)


def test_int8_weights_with_16_bit_math_by_hand():
    """Weight-only int8: the layers' weight matrices are stored at one byte (norms, embedding
    and LM head stay 16 bit), the GEMMs still run at the 16-bit rate, so a compute-bound
    prefill GEMM takes as long as with fp16 weights but reads fewer bytes."""
    mdl = model("llama2-7b")  # 32 layers, h 4096, f 11008 (gated), vocab 32000
    fp16 = InferencePlan(weight_precision="bf16", activation_precision="bf16")
    w8 = InferencePlan(weight_precision="fp8", activation_precision="bf16")
    assert float(w8.math_precision) == 1.0
    h, f, v = 4096, 11008, 32000
    matrices = 32 * (4 * h * h + 3 * h * f)
    assert float(weight_bytes_per_gpu(mdl, fp16)) - float(weight_bytes_per_gpu(mdl, w8)) == (
        pytest.approx(matrices * (2 - 1), rel=1e-6))
    assert float(weight_bytes_per_gpu(mdl, w8)) == pytest.approx(
        matrices + 32 * 4 * h * 2 + 2 * v * h * 2, rel=1e-6)  # norms: 2 x (weight, bias)
    big = dict(batch=8, input_len=2048, output_len=1)
    a = _prefill(mdl, InferencePlan(weight_precision="bf16", **big))
    b = _prefill(mdl, InferencePlan(weight_precision="fp8", activation_precision="bf16", **big))
    for op in WEIGHT_GEMMS:
        assert float(b[op].compute) == pytest.approx(float(a[op].compute), rel=1e-6), op
        assert float(b[op].flops) == pytest.approx(float(a[op].flops), rel=1e-6), op
        assert float(b[op].bytes) < float(a[op].bytes), op


@pytest.mark.parametrize("value", [0.0, -0.5, 1.5])
def test_gemm_peak_fraction_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match=r"InferencePlan.gemm_peak_fraction must lie in \(0, 1\]"):
        InferencePlan(gemm_peak_fraction=value)


HEADER = ["id", "kind", "source", "model", "layers", "hidden", "heads", "kv_heads", "ffn_hidden",
          "vocab", "gated_mlp", "num_experts", "experts_per_token", "gpu", "num_gpus",
          "gpus_per_node", "tp", "pp", "precision", "batch", "input_len", "output_len", "ttft_s",
          "weight_precision", "gemm_peak_fraction", "notes"]
BASE = dict(kind="infer", source="s", model="Mixtral-8x7B", layers=32, hidden=4096, heads=32,
            kv_heads=8, ffn_hidden=14336, vocab=32000, gated_mlp=1, num_experts=8,
            experts_per_token=2, gpu=H100, num_gpus=2, gpus_per_node=8, tp=2, pp=1,
            precision="fp16", batch=1, input_len=128, output_len=1, ttft_s=0.0134)


def _write(path, rows):
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=HEADER)
        w.writeheader()
        for k, r in enumerate(rows):
            w.writerow({**{c: "" for c in HEADER}, **BASE, "id": f"i{k}", **r})
    return path


def test_weight_only_columns_reach_the_plan(tmp_path):
    rows = [{"weight_precision": "int8", "gemm_peak_fraction": "0.667"},
            {"weight_precision": "int4"}, {}, {"weight_precision": "fp16"}]
    plans = [infer_specs(r)[2] for r in read_benchmarks(_write(tmp_path / "w.csv", rows))]
    assert [float(p.weight_precision) for p in plans] == [2.0, 3.0, 1.0, 1.0]  # fp8/fp4 widths
    assert [float(p.math_precision) for p in plans] == [1.0] * 4  # 16-bit GEMMs throughout
    assert [float(p.activation_precision) for p in plans] == [1.0] * 4
    assert [float(p.gemm_peak_fraction) for p in plans] == pytest.approx([0.667, 1, 1, 1])


@pytest.mark.parametrize("row, needle", [
    ({"weight_precision": "int3"}, "must be one of"),
    ({"weight_precision": "fp32"}, "wider than the GEMM precision fp16"),
    ({"weight_precision": "int8", "precision": "fp8"}, "W8A8"),
    ({"weight_precision": "int4", "precision": "fp4"}, "W8A8"),
    ({"gemm_peak_fraction": "1.2"}, "must lie in (0, 1]"),
    ({"gemm_peak_fraction": "0"}, "must lie in (0, 1]"),
])
def test_bad_weight_only_cells_name_file_row_and_column(tmp_path, row, needle):
    path = _write(tmp_path / "bad.csv", [{}, row])
    column = next(iter(c for c in ("weight_precision", "gemm_peak_fraction") if c in row))
    with pytest.raises(BenchmarkError) as info:
        read_benchmarks(path)
    msg = str(info.value)
    assert "bad.csv" in msg and "row 2" in msg and f"'{column}'" in msg and needle in msg, msg


def test_shipped_trtllm09_mixtral_rows_are_int8_weight_only():
    """TensorRT-LLM 0.9 had no FP8 for Mixtral, only INT8 / INT4 weight-only; its weight-only
    and MoE GEMMs were SM80 (mma.sync) kernels, at about 2/3 of Hopper's tensor peak. Every
    Mixtral row of that table says so, and no other row carries either column."""
    rows = read_benchmarks(INFER_CSV)
    mixtral = [r for r in rows if r.id.startswith("trtllm090") and "mixtral" in r.id]
    assert len(mixtral) == 18
    for r in rows:
        v = r.values
        if r in mixtral:
            assert (v["precision"], v["weight_precision"]) == ("fp16", "fp8"), r.id
            hopper = v["gpu"].startswith(("h100", "h200"))
            assert v["gemm_peak_fraction"] == (0.667 if hopper else 1.0), r.id
        else:
            assert v["weight_precision"] == v["precision"], r.id
            assert v["gemm_peak_fraction"] == 1.0, r.id
    with INFER_CSV.open(newline="") as f:
        raw = {r["id"]: r for r in csv.DictReader(f)}
    assert {raw[r.id]["weight_precision"] for r in mixtral} == {"int8"}


def test_cli_gemm_peak_fraction(capsys):
    from diffperf.cli import build_parser
    from diffperf.internal import run_infer
    argv = ["infer", "--model", "mixtral-8x7b", "--gpu", H100, "--tp", "2", "--input", "2048",
            "--output", "1", "--precision", "fp8", "--activation-precision", "fp16",
            "--kv-precision", "fp16"]
    parser = build_parser()
    ttft = []
    for extra in ([], ["--gemm-peak-fraction", "0.667"]):
        assert run_infer(parser.parse_args(argv + extra)) == 0
        out = capsys.readouterr().out
        assert "weights fp8, GEMM inputs fp16, KV cache fp16" in out.splitlines()[0]
        assert ("0.667 of the tensor peak" in out) == bool(extra)
        assert run_infer(parser.parse_args(argv + extra + ["--json"])) == 0
        ttft.append(json.loads(capsys.readouterr().out)["ttft_s"])
    assert ttft[1] > 1.2 * ttft[0]  # a prefill of 2,048 tokens is GEMM-bound
    assert run_infer(parser.parse_args(argv + ["--gemm-peak-fraction", "0"])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "gemm_peak_fraction" in err and "Traceback" not in err


def test_cli_integer_weight_names(capsys):
    """`--precision int8 / int4` are weight-only formats: the same prediction as fp8 weights
    with the given 16-bit GEMM precision (the KV cache defaults to that precision), and for
    int4 a little faster than NVFP4 weights (4.25 against 4.5 bits: one scale per 32 weights,
    not per 16); without one, a one-line error."""
    from diffperf.cli import build_parser
    from diffperf.internal import run_infer
    parser = build_parser()
    base = ["infer", "--model", "llama2-70b", "--gpu", "a100-sxm4-80gb", "--tp", "4", "--json"]
    out = {}
    for weights, name in (("int8", "fp8"), ("int4", "fp4")):
        for w in (weights, name):
            for kv in (["--kv-precision", "fp16"], []):  # the cache defaults to fp16 too
                argv = base + ["--precision", w, "--activation-precision", "fp16"] + kv
                assert run_infer(parser.parse_args(argv)) == 0
                out[w, bool(kv)] = json.loads(capsys.readouterr().out)["e2e_latency_s"]
            assert out[w, True] == out[w, False]
            out[w] = out[w, True]
        if weights == "int8":
            assert out[weights] == out[name]
    # only the weight reads shrink (17 / 18); at batch 1 launches take much of the step
    assert 0.94 < out["int4"] / out["fp4"] < 1.0
    assert out["int4"] < out["int8"]  # batch-1 decode streams half the weight bytes
    assert run_infer(parser.parse_args(base + ["--precision", "int8"])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --precision int8 is weight-only") and "Traceback" not in err


def test_plan_accepts_integer_weight_names():
    """From Python: int8 / int4 weights are the bytes of fp8 / fp4, and with the default
    16-bit activations the GEMMs run in 16 bit; integer activations are refused by name."""
    for name, code in (("int8", 2.0), ("int4", 3.0)):
        plan = InferencePlan(weight_precision=name)
        assert float(plan.weight_precision) == code and float(plan.math_precision) == 1.0
    with pytest.raises(ValueError, match="InferencePlan.activation_precision must be one of"):
        InferencePlan(activation_precision="int8")


def test_int4_weights_with_fp8_gemms_are_w4a8(capsys):
    """TensorRT-LLM's W4A8 (int4 weights dequantised to fp8 for fp8 GEMMs) is accepted by the
    command line as by the Python API: 4-bit weight bytes, fp8 math, the same prediction."""
    import diffperf as dp
    from diffperf.cli import main
    from diffperf.specs import weight_storage
    assert weight_storage("int4", "fp8") == "fp4"
    plan = dp.InferencePlan(weight_precision="int4", activation_precision="fp8",
                            kv_precision="fp8")  # the CLI: KV cache at the GEMM input precision
    assert float(plan.math_precision) == 2.0 and float(plan.weight_precision) == 3.0
    code = main(["infer", "--model", "llama2-7b", "--gpu", "h100-sxm5-80gb", "--precision",
                 "int4", "--activation-precision", "fp8", "--json"])
    assert code == 0
    e2e = json.loads(capsys.readouterr().out)["e2e_latency_s"]
    api = dp.infer(dp.model("llama2-7b"), dp.system("h100-sxm5-80gb"), plan,
                   dp.default_efficiency("h100-sxm5-80gb"))
    assert e2e == pytest.approx(float(api.e2e_latency), rel=1e-6)


def test_cli_header_names_the_4_bit_format(capsys):
    """The report's header says what a 4-bit weight costs: NVFP4 (`fp4`) 4.5 bits, int4 (one
    scale per 32, as MXFP4) 4.25; wider weights add nothing."""
    from diffperf.cli import build_parser
    from diffperf.internal import run_infer
    parser = build_parser()
    base = ["infer", "--model", "llama2-7b", "--gpu", "b200"]
    for argv, want in ((["--precision", "fp4"], "NVFP4 weights: 4.5 bits"),
                       (["--precision", "int4", "--activation-precision", "bf16"],
                        "int4 weights: 4.25 bits"),
                       (["--precision", "fp8"], None)):
        assert run_infer(parser.parse_args(base + argv)) == 0
        header = capsys.readouterr().out.splitlines()[0]
        if want is None:
            assert "bits" not in header
        else:
            assert want in header
