"""The measured GEMM factors of TensorRT-LLM's CUTLASS NVFP4 MoE backend
(`diffperf.inference._moe_gemm_factors`, `Runtime.moe_gemm_table`)."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffperf import presets
from diffperf.inference import moe_module_time
from diffperf.inference._moe_gemm_factors import FACTORS_JSON, TOKEN_GRID, measured_gemm_factor
from diffperf.specs import InferencePlan
from diffperf.validation._moe_kernels import (
    kernel_runtime,
    model_module_times,
    read_moe_kernel_rows,
)

DATA = json.loads(FACTORS_JSON.read_text())


def entry(hidden, width, experts, top_k):
    return next(e for e in DATA["entries"] if (e["hidden"], e["expert_width"], e["num_experts"],
                                               e["top_k"]) == (hidden, width, experts, top_k))


@pytest.mark.parametrize("check", DATA["checks"], ids=lambda c: f"{c['gpu']}-{c['entry']}")
def test_table_was_solved_against_this_model(check):
    """calibration/moe_gemm_tables.py stores the model's module and GEMM times it solved g
    against (1,024 tokens; the first entry on each GPU, one split over 8 GPUs on B200); a
    change of the model's MoE costs must rerun it."""
    e = DATA["entries"][check["entry"]]
    total, experts = model_module_times(
        presets.system(check["system"]), presets.resolve_efficiency(None, check["gpu"]),
        e["hidden"], e["expert_width"] * e["moe_tp"], e["num_experts"], e["top_k"],
        e["moe_tp"], [check["tokens"]])
    assert total[0] == pytest.approx(check["module_s"], rel=1e-4)
    assert experts[0] == pytest.approx(check["experts_s"], rel=1e-4)


def test_every_shape_once_on_the_token_grid():
    keys = [(e["hidden"], e["expert_width"], e["num_experts"], e["top_k"])
            for e in DATA["entries"]]
    assert len(keys) == len(set(keys)) == 81
    assert DATA["token_grid"] == [int(t) for t in TOKEN_GRID]
    assert all(len(e["log_factor"]) == len(TOKEN_GRID) for e in DATA["entries"])


def test_lookup_by_hand():
    """On the grid: the stored factor; between two grid points: linear in log g over log
    tokens; beyond: flat; a shape the tables lack: 1."""
    lf = np.array(entry(2048, 768, 128, 8)["log_factor"])
    g = lambda t: float(measured_gemm_factor(2048.0, 768.0, 128.0, 8.0, t))  # noqa: E731
    j = list(TOKEN_GRID).index(1024)
    assert g(1024.0) == pytest.approx(np.exp(lf[j]), rel=1e-5)
    mid = float(np.sqrt(TOKEN_GRID[j] * TOKEN_GRID[j + 1]))
    assert g(mid) == pytest.approx(np.exp(0.5 * (lf[j] + lf[j + 1])), rel=1e-5)
    assert g(1e6) == pytest.approx(np.exp(lf[-1]), rel=1e-5)
    assert g(0.25) == pytest.approx(np.exp(lf[0]), rel=1e-5)
    assert float(measured_gemm_factor(2048.0, 700.0, 128.0, 8.0, 1024.0)) == 1.0
    # Qwen3-30B-A3B's experts at throughput sizes: 2-3.5x; DeepSeek-V3's about the model's
    assert 2.0 < g(1024.0) < 3.5 and 2.0 < g(8192.0) < 3.5
    assert 0.9 < float(measured_gemm_factor(7168.0, 2048.0, 256.0, 8.0, 1024.0)) < 1.2


def test_vmap_equals_loop_and_gradient_follows_the_table():
    tokens = jnp.array([3.0, 100.0, 700.0, 1300.0, 5000.0])
    f = lambda t: measured_gemm_factor(2048.0, 768.0, 128.0, 8.0, t)  # noqa: E731
    assert np.allclose(jax.vmap(f)(tokens), [f(t) for t in tokens], rtol=1e-6)
    # arrays broadcast without vmap: shapes as one batch, tokens as another axis
    both = measured_gemm_factor(jnp.array([[2048.0], [7168.0]]), jnp.array([[768.0], [2048.0]]),
                                jnp.array([[128.0], [256.0]]), 8.0, tokens)
    assert both.shape == (2, 5) and np.allclose(both[0], jax.vmap(f)(tokens), rtol=1e-6)
    assert np.allclose(both[1], [measured_gemm_factor(7168.0, 2048.0, 256.0, 8.0, t)
                                 for t in tokens], rtol=1e-6)
    # d log g / d log t inside a grid segment = the segment's slope
    lf = np.array(entry(2048, 768, 128, 8)["log_factor"])
    j = list(TOKEN_GRID).index(1024)
    slope = (lf[j + 1] - lf[j]) / np.log(TOKEN_GRID[j + 1] / TOKEN_GRID[j])
    t = 1300.0
    grad = jax.grad(lambda lt: jnp.log(f(jnp.exp(lt))))(jnp.log(t))
    assert float(grad) == pytest.approx(slope, rel=1e-3)


def module(model, system, gpu, precision, table, tokens=1024.0, tp=1.0):
    rt = eqx.tree_at(lambda r: r.moe_gemm_table, kernel_runtime("cutlass"), table)
    plan = InferencePlan(tp=tp, weight_precision=precision, activation_precision=precision)
    return moe_module_time(presets.model(model), presets.system(system), plan, tokens, rt,
                           presets.resolve_efficiency(None, gpu), router_gemm=False)


def test_applies_only_to_4bit_math_on_gpus_with_fp4_tensor_cores():
    on = module("qwen3-30b-a3b", "dgx-b200", "b200", "fp4", 1.0)
    off = module("qwen3-30b-a3b", "dgx-b200", "b200", "fp4", 0.0)
    g = float(measured_gemm_factor(2048.0, 768.0, 128.0, 8.0, 1024.0))
    assert float(on.experts) == pytest.approx(g * float(off.experts), rel=1e-5)
    assert float(on.permute) == pytest.approx(float(off.permute), rel=1e-6)
    for system, gpu, prec in (("dgx-b200", "b200", "fp8"), ("dgx-h100", "h100-sxm5-80gb",
                                                            "fp8")):
        a = module("qwen3-30b-a3b", system, gpu, prec, 1.0)
        b = module("qwen3-30b-a3b", system, gpu, prec, 0.0)
        assert float(a.total) == float(b.total)
    # half-way: the factor's square root (the field is an exponent, differentiable)
    half = module("qwen3-30b-a3b", "dgx-b200", "b200", "fp4", 0.5)
    assert float(half.experts) == pytest.approx(np.sqrt(g) * float(off.experts), rel=1e-5)


def test_tensor_parallel_experts_use_their_per_gpu_width():
    """TP 8 splits Qwen3-235B-A22B's 1,536-wide experts into 192-wide ones: the entry with
    that per-GPU width (measured at moe_tp 8) applies."""
    on = module("qwen3-235b-a22b", "dgx-b200", "b200", "fp4", 1.0, tp=8.0)
    off = module("qwen3-235b-a22b", "dgx-b200", "b200", "fp4", 0.0, tp=8.0)
    g = float(measured_gemm_factor(4096.0, 192.0, 128.0, 8.0, 1024.0))
    assert g != 1.0 and entry(4096, 192, 128, 8)["moe_tp"] == 8
    assert float(on.experts) == pytest.approx(g * float(off.experts), rel=1e-5)


def test_trtllm_presets_ask_for_it():
    assert float(presets.runtime("trtllm").moe_gemm_table) == 1.0
    assert float(presets.runtime("trtllm-bench").moe_gemm_table) == 1.0
    for name in ("vllm", "sglang", "megatron-core"):
        assert float(presets.runtime(name).moe_gemm_table) == 0.0


def test_reproduces_the_measured_b200_modules():
    """NVIDIA's B200 CUTLASS NVFP4 modules in moe_kernels_published.csv (49 rows: Qwen3-30B-
    A3B, Qwen3-235B-A22B, DeepSeek-V3, Mixtral at TP 1 / 8, 1-16,384 tokens), the tables'
    own source: 0.31-1.04x the measurement without the factors (MAPE 39 %), 0.52-1.24x with
    them (MAPE 16 %: the table is the median of four GPUs, and fixed costs at a few tokens
    stay the model's)."""
    rows = [r for r in read_moe_kernel_rows() if r.kernel == "cutlass" and r.gpu == "b200"
            and "aiconfigurator" in r.source and float(r.plan.weight_precision) == 3.0]
    assert len(rows) == 49
    ratios = {}
    for table in (0.0, 1.0):
        rt = eqx.tree_at(lambda r: r.moe_gemm_table, kernel_runtime("cutlass"), table)
        ratios[table] = np.array([
            float(moe_module_time(presets.model(r.model), presets.system(r.system), r.plan,
                                  r.tokens, rt, presets.resolve_efficiency(None, r.gpu),
                                  router_gemm=r.router_gemm).total) * 1e6 / r.time_us
            for r in rows])
    mape = {k: float(np.mean(np.abs(v - 1.0))) for k, v in ratios.items()}
    assert mape[0.0] > 0.35 and mape[1.0] < 0.18
    assert 0.5 < ratios[1.0].min() and ratios[1.0].max() < 1.3
