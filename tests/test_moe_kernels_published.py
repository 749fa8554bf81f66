"""`diffperf.inference.moe_module_time` against published MoE kernel benchmarks
(`benchmarks_data/moe_kernels_published.csv`; `python calibration/moe_kernels.py` prints every
row). The module counts the router GEMM only where the benchmark ran it (TensorRT-LLM's blog).
Measured / model today:

- TensorRT-LLM's TRTLLM-Gen backend (NVIDIA's "MoE as Dense GEMM" blog, B200 NVFP4, DeepSeek-V3
  as one rank of TP 8, 1-384 tokens): 0.86-0.97, MAPE 12.1 % (the model charges more kernels
  than TRTLLM-Gen's fused module launches);
- TensorRT-LLM's kernels through FlashInfer (one B300, DeepSeek-V3 EP 8 rank, MXFP8 / BF16,
  1-512 tokens): 0.85-1.19 / 0.74-1.06;
- NVIDIA's measured TensorRT-LLM 1.3 MoE database (aiconfigurator): TRTLLM-Gen with gpt-oss's
  MXFP4 x MXFP8 on B200 0.73-1.02 (1-16,384 tokens); the CUTLASS backend in FP8 on H200
  0.61-1.34, in BF16 on B200 / H100 0.86-1.43 (`tests/test_moe_permute.py`); its Triton
  backend in W4A16 (gpt-oss on Hopper) 0.69-1.76 with the W4A16 share of the 16-bit rate;
- vLLM / SGLang Triton fused_moe (H100, H200, B200): 1.05-1.91 up to 8 tokens per expert (a
  slower kernel family: more helper kernels, untuned configurations);
- TensorRT-LLM's CUTLASS backend in NVFP4 on B200: 0.96-3.2, 2-3x for narrow experts, a miss
  left open (calibration/EXPERIMENTS.md).

The bounds below sit outside today's errors by a margin of a few points to about a third of
the error, so a change that moves the MoE model materially fails them."""

from __future__ import annotations

from collections import Counter

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffperf as dp
from diffperf.inference import inference_ops, moe_module_time
from diffperf.specs import InferencePlan, Runtime
from diffperf.validation._moe_kernels import (
    BENCHMARK_RUNTIME,
    predict_moe_kernel_row,
    read_moe_kernel_rows,
    tokens_per_expert,
)

ROWS = read_moe_kernel_rows()
_RATIO: dict[int, float] = {}  # measured / model by id() of a row of ROWS: predicted once


def _ratios(rows) -> np.ndarray:
    """measured / model of `rows` (rows of `ROWS`)."""
    assert rows
    for row in rows:
        if id(row) not in _RATIO:
            _RATIO[id(row)] = row.time_us / predict_moe_kernel_row(row)
    return np.array([_RATIO[id(row)] for row in rows])


def _assert_within(rows, count: int, log_bound: float, mape_bound: float) -> None:
    """`count` rows, each within exp(+-`log_bound`) of the model, MAPE <= `mape_bound`."""
    assert len(rows) == count
    r = _ratios(rows)
    assert np.all(np.abs(np.log(r)) <= log_bound), r
    assert np.mean(np.abs(1.0 / r - 1.0)) <= mape_bound


def test_the_table_holds_what_its_sources_printed():
    assert len(ROWS) == 220
    by_kernel = Counter((r.engine, r.kernel) for r in ROWS)
    assert by_kernel[("tensorrt-llm", "trtllm-gen")] == 14 + 14  # the blog's, gpt-oss's
    # the blog's; NVFP4 on B200, FP8 on H200, BF16 on B200 and H100 (database)
    assert by_kernel[("tensorrt-llm", "cutlass")] == 14 + 49 + 21 + 42
    assert by_kernel[("tensorrt-llm", "triton")] == 21  # W4A16 on H100 / H200
    assert by_kernel[("flashinfer", "trtllm-mxfp8")] == 10
    assert sum(r.router_gemm for r in ROWS) == 28  # the blog's rows
    # the blog's 128-token TRTLLM-Gen module: 161.87 us
    row = next(r for r in ROWS if r.kernel == "trtllm-gen" and r.tokens == 128)
    assert row.time_us == pytest.approx(161.87)


def test_trtllm_gen_module_within_20_percent():
    """The TRTLLM-Gen module on B200 (NVFP4, 1-384 tokens): today 0.86-0.97 x the model."""
    rows = [row for row in ROWS if row.kernel == "trtllm-gen" and row.source.startswith("NVIDIA")]
    _assert_within(rows, 14, 0.22, 0.16)


@pytest.mark.parametrize("kernel", ["trtllm-mxfp8", "trtllm-bf16"])
def test_flashinfer_trtllm_kernels_at_two_precisions(kernel):
    """The same layer at 8 and 16 bits: the weight bytes scale the time as measured (today
    0.85-1.17 and 0.74-1.05 x the model; the model's busiest of 8 expert-parallel GPUs reads
    more experts than the one GPU measured, most visibly in BF16 at 16-128 tokens)."""
    rows = [row for row in ROWS if row.engine == "flashinfer" and row.kernel == kernel]
    _assert_within(rows, 10, 0.35, 0.17)


def test_no_published_moe_module_beats_the_model_while_it_streams_weights():
    """Up to 64 tokens per expert the model streams the weights at the fitted HBM efficiency:
    no kernel of any family runs more than a third faster (today the fastest is 0.69 x, 168
    rows: gpt-oss-120b in W4A16 on H200 at 8 tokens per expert, where the W4A16 share,
    fitted over all token counts, makes the model's GEMM compute-bound a little early; every
    other row >= 0.74 x)."""
    r = _ratios([row for row in ROWS if tokens_per_expert(row) <= 64])
    assert len(r) >= 160
    assert r.min() >= 0.66


def test_trtllm_gen_gpt_oss_mxfp4_weights_fp8_activations():
    """gpt-oss's MoE on B200 as TensorRT-LLM runs it (TRTLLM-Gen, MXFP4 x MXFP8), 1-16,384
    tokens, NVIDIA's measured database: today 0.73-1.02 x the model, MAPE 16.7 %."""
    gpt_oss = [row for row in ROWS if row.kernel == "trtllm-gen" and row.model.startswith("gpt")]
    _assert_within(gpt_oss, 14, 0.35, 0.20)


def test_hopper_cutlass_fp8_module():
    """TensorRT-LLM's CUTLASS backend in FP8 on H200 (Qwen3-30B-A3B, Qwen3-235B-A22B,
    Mixtral 8x7B, 1-16,384 tokens): today 0.61-1.34 x the model (MAPE 21 %; the model is slow
    for Mixtral's wide experts at thousands of tokens per expert)."""
    rows = [row for row in ROWS if row.kernel == "cutlass" and row.gpu.startswith("h200")]
    _assert_within(rows, 21, 0.55, 0.25)


def test_trtllm_triton_w4a16_on_hopper():
    """gpt-oss's MoE on Hopper as TensorRT-LLM runs it (its Triton backend, MXFP4 weights x BF16
    activations), H100 / H200, 1-16,384 tokens, NVIDIA's measured database: today 0.69-1.76 x
    the model, MAPE 17.1 % (29.3 % at the 16-bit rate, 1.37-1.83x at >= 1,024 tokens); at
    >= 1,024 tokens 0.81-1.15 x (`costs._gemm.W4A16_MOE_PEAK_SHARE`)."""
    rows = [row for row in ROWS if row.kernel == "triton"]
    _assert_within(rows, 21, 0.62, 0.20)
    big = _ratios([row for row in rows if row.tokens >= 1024])
    assert np.all((big > 0.78) & (big < 1.2)), big


def test_w4a16_share_acts_on_weight_only_4bit_experts_of_fp8_gpus(monkeypatch):
    """The W4A16 share slows the routed experts' compute by 1 / share where they are
    compute-bound, and only for 4-bit weights x 16-bit math on a GPU with FP8 tensor cores:
    not W4A8, not an A100, not a dense model's MLP."""
    import diffperf.inference._infer as infer_module
    from diffperf.costs._gemm import W4A16_MOE_PEAK_SHARE
    gpt = dp.model("gpt-oss-20b")
    w4a16 = InferencePlan(weight_precision="fp4", activation_precision="bf16")
    w4a8 = InferencePlan(weight_precision="fp4", activation_precision="fp8")

    def experts(system, plan, share, model=gpt, tokens=16384.0):
        monkeypatch.setattr(infer_module, "W4A16_MOE_PEAK_SHARE", share)
        return moe_module_time(model, system, plan, tokens, BENCHMARK_RUNTIME)

    h100, a100 = dp.system("dgx-h100"), dp.system("dgx-a100")
    slow = experts(h100, w4a16, W4A16_MOE_PEAK_SHARE).experts
    fast = experts(h100, w4a16, 1.0).experts
    assert float(slow / fast) == pytest.approx(1.0 / W4A16_MOE_PEAK_SHARE, rel=0.05)
    for system, plan in ((h100, w4a8), (a100, w4a16)):
        assert float(experts(system, plan, W4A16_MOE_PEAK_SHARE).experts) == pytest.approx(
            float(experts(system, plan, 1.0).experts))
    def dense_ttft(share):
        monkeypatch.setattr(infer_module, "W4A16_MOE_PEAK_SHARE", share)
        plan = InferencePlan(batch=64.0, input_len=2048, output_len=2,
                             weight_precision="int4", activation_precision="bf16")
        return float(dp.infer(dp.model("llama3-8b"), h100, plan).ttft)

    assert dense_ttft(W4A16_MOE_PEAK_SHARE) == pytest.approx(dense_ttft(1.0))


def test_triton_fused_moe_while_it_streams_weights():
    """vLLM / SGLang Triton fused_moe up to 8 tokens per expert: slower than the model by a
    fixed cost of its extra helper kernels, never faster (today 1.05-1.91 x)."""
    rows = [row for row in ROWS
            if row.engine in ("vllm", "sglang") and tokens_per_expert(row) <= 8]
    assert len(rows) == 20
    r = _ratios(rows)
    assert np.all((r >= 0.95) & (r <= 2.0)), r


# --- the module itself -------------------------------------------------------------------------

MODEL = dp.model("qwen3-30b-a3b")
SYSTEM = dp.system("dgx-b200")
PLAN = InferencePlan(weight_precision="fp4", activation_precision="fp4")


def test_module_is_the_router_and_expert_ops_of_one_moe_layer():
    """The module's roofline parts are one layer's router + mlp_up + mlp_down in
    `inference_ops`' decode step (which sums them over the layers)."""
    batch = 64.0
    plan = InferencePlan(batch=batch, input_len=128, output_len=2, weight_precision="fp4",
                         activation_precision="fp4")
    step = inference_ops(MODEL, SYSTEM, plan)["decode"]
    ops = sum(float(step[k].roofline) for k in ("router", "mlp_up", "mlp_down"))
    m = moe_module_time(MODEL, SYSTEM, plan, batch)
    assert float(m.router + m.experts) * float(MODEL.layers) == pytest.approx(ops, rel=1e-5)


def test_module_of_a_dense_model_is_zero():
    m = moe_module_time(dp.model("llama3-8b"), SYSTEM, PLAN, 64.0)
    assert float(m.total) == 0.0 and float(m.kernels) == 0.0


def test_graph_replay_costs_each_kernel_its_node_and_tail():
    eager = moe_module_time(MODEL, SYSTEM, PLAN, 4.0, Runtime())
    graph = moe_module_time(MODEL, SYSTEM, PLAN, 4.0, BENCHMARK_RUNTIME)
    eff = dp.presets.resolve_efficiency(None)
    assert float(graph.fixed) == pytest.approx(
        float(graph.kernels) * float(Runtime().graph_node_time + eff.kernel_overhead), rel=1e-6)
    assert float(eager.fixed) > float(graph.fixed)
    assert float(eager.experts) == pytest.approx(float(graph.experts))


def test_more_tokens_never_faster_and_more_bandwidth_never_slower():
    tokens = jnp.array([1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0])
    t = np.asarray(jax.vmap(
        lambda n: moe_module_time(MODEL, SYSTEM, PLAN, n, BENCHMARK_RUNTIME).total)(tokens))
    # one exception, by design (`costs.split_k_gemm_cost`): where a skinny GEMM stops splitting
    # its k loop it drops the reduction kernel, and the module may get faster by up to that
    # kernel's fixed cost and a few per cent of idle SMs (Qwen3-30B-A3B, 128 -> 256 tokens)
    one_kernel = float(Runtime().graph_node_time
                       + dp.presets.resolve_efficiency(None).kernel_overhead)
    assert np.all(np.diff(t) >= -(one_kernel + 0.03 * t[:-1])), t
    assert t[-1] > 2.0 * t[0]
    wider = eqx.tree_at(lambda s: s.accelerator.hbm_bandwidth, SYSTEM,
                        2.0 * SYSTEM.accelerator.hbm_bandwidth)
    for n in (1.0, 64.0, 4096.0):
        a = moe_module_time(MODEL, SYSTEM, PLAN, n, BENCHMARK_RUNTIME).total
        b = moe_module_time(MODEL, wider, PLAN, n, BENCHMARK_RUNTIME).total
        assert float(b) <= float(a)


def test_vmap_equals_loop_and_gradient_matches_finite_differences():
    tokens = jnp.array([2.0, 48.0, 700.0])
    f = lambda n: moe_module_time(MODEL, SYSTEM, PLAN, n, BENCHMARK_RUNTIME).total  # noqa: E731
    batched = jax.vmap(f)(tokens)
    looped = jnp.stack([f(n) for n in tokens])
    np.testing.assert_allclose(np.asarray(batched), np.asarray(looped), rtol=1e-6)

    def g(bw):
        s = eqx.tree_at(lambda s: s.accelerator.hbm_bandwidth, SYSTEM, bw)
        return moe_module_time(MODEL, s, PLAN, 32.0, BENCHMARK_RUNTIME).total
    bw = SYSTEM.accelerator.hbm_bandwidth
    grad = float(jax.grad(g)(bw))
    h = float(bw) * 1e-3
    fd = (float(g(bw + h)) - float(g(bw - h))) / (2 * h)
    assert grad < 0
    assert grad == pytest.approx(fd, rel=2e-2)


def test_moe_gemm_time_factor_slows_the_routed_experts_only():
    """`Runtime.moe_gemm_time_factor` multiplies the routed experts' GEMM time (a slower MoE
    kernel backend), not the router, the fixed costs or a dense model's MLP."""
    base = moe_module_time(MODEL, SYSTEM, PLAN, 1024.0, BENCHMARK_RUNTIME)
    slow = moe_module_time(MODEL, SYSTEM, PLAN, 1024.0,
                           eqx.tree_at(lambda r: r.moe_gemm_time_factor, BENCHMARK_RUNTIME, 2.5))
    assert float(slow.experts) == pytest.approx(2.5 * float(base.experts), rel=1e-5)
    assert float(slow.router) == pytest.approx(float(base.router))
    assert float(slow.fixed) == pytest.approx(float(base.fixed))
    dense = dp.model("llama3-8b")
    plan = InferencePlan(batch=32.0, input_len=512, output_len=64)
    slow_runtime = Runtime(moe_gemm_time_factor=3.0)
    a = dp.infer(dense, SYSTEM, plan, runtime=Runtime())
    b = dp.infer(dense, SYSTEM, plan, runtime=slow_runtime)
    assert float(b.tpot) == pytest.approx(float(a.tpot))
    moe_plan = InferencePlan(batch=32.0, input_len=512, output_len=64,
                             weight_precision="fp4", activation_precision="fp4")
    c = dp.infer(MODEL, SYSTEM, moe_plan, runtime=Runtime())
    d = dp.infer(MODEL, SYSTEM, moe_plan, runtime=slow_runtime)
    assert float(d.tpot) > float(c.tpot)
    at64 = moe_module_time(MODEL, SYSTEM, PLAN, 64.0, BENCHMARK_RUNTIME)
    grad = jax.grad(lambda f: moe_module_time(MODEL, SYSTEM, PLAN, 64.0, eqx.tree_at(
        lambda r: r.moe_gemm_time_factor, BENCHMARK_RUNTIME, f)).total)(1.0)
    assert float(grad) == pytest.approx(float(at64.experts), rel=1e-4)


def test_moe_gemm_time_factor_must_be_positive():
    with pytest.raises(ValueError, match="moe_gemm_time_factor"):
        Runtime(moe_gemm_time_factor=0.0)


def test_router_flag_and_routing_kernels():
    """`router_gemm=False` drops the router GEMM and its kernels; the layer's routing kernels
    (top-k, permutation, un-permutation: `MOE_KERNELS`) are always counted."""
    from diffperf.inference._infer import MOE_KERNELS
    full = moe_module_time(MODEL, SYSTEM, PLAN, 256.0, BENCHMARK_RUNTIME)
    bare = moe_module_time(MODEL, SYSTEM, PLAN, 256.0, BENCHMARK_RUNTIME, router_gemm=False)
    assert float(bare.router) == 0.0 and float(full.router) > 0.0
    assert float(bare.experts) == pytest.approx(float(full.experts))
    assert float(full.kernels) - float(bare.kernels) >= 1.0
    assert float(bare.kernels) >= 2.0 + MOE_KERNELS


def test_padding_graph_runtime_runs_the_padded_batch_as_inference_ops_does():
    """Under a runtime that pads decode batches to its captured sizes, the module at b tokens
    equals one MoE layer of `inference_ops`' decode step at batch b (padded there too)."""
    runtime = Runtime(decode_graph=1.0, graph_pad_ratio=2.0, graph_pad_from=1.0)
    batch = 300.0
    plan = InferencePlan(batch=batch, input_len=128, output_len=2, weight_precision="fp4",
                         activation_precision="fp4")
    step = inference_ops(MODEL, SYSTEM, plan, runtime=runtime)["decode"]
    ops = sum(float(step[k].roofline) for k in ("router", "mlp_up", "mlp_down"))
    m = moe_module_time(MODEL, SYSTEM, plan, batch, runtime)
    assert float(m.router + m.experts) * float(MODEL.layers) == pytest.approx(ops, rel=1e-5)
    unpadded = moe_module_time(MODEL, SYSTEM, plan, batch, BENCHMARK_RUNTIME)
    assert float(m.experts) > float(unpadded.experts)
