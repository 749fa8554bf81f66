"""The token permutation around an inference MoE layer's experts (`moe_permute` in
`inference_ops`, `diffperf.inference._infer.moe_permute_cost`): its bytes by hand, what the
runtime's `moe_permute_copy` changes, expert parallelism, physics (bandwidth, expert width),
gradients and vmap, and the measured CUTLASS BF16 modules it helps explain."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffperf as dp
from diffperf.inference import inference_ops, moe_module_time
from diffperf.inference._infer import MOE_KERNELS, MOE_PERMUTE_KERNELS
from diffperf.specs import InferencePlan, Runtime
from diffperf.validation._moe_kernels import (
    kernel_runtime,
    predict_moe_kernel_row,
    read_moe_kernel_rows,
)

QWEN = dp.model("qwen3-30b-a3b")  # 48 MoE layers, hidden 2048, 128 experts of 768, top 8
SYSTEM = dp.system("dgx-b200")
EFF = dp.presets.resolve_efficiency(None, "b200")


def _prefill(model, plan, runtime=None, system=SYSTEM):
    return inference_ops(model, system, plan, EFF, runtime=runtime)["prefill"]


def test_bytes_and_time_by_hand():
    """One GPU, bf16, 4 x 1,024 prompt tokens: every expert is picked (R = T k exactly), so
    per layer bytes = (T h 2 + R h 2) (the copy) + R h 2 + T h 2 (the combine); the op's
    memory time is bytes / (BW x e_hbm) and it launches 2 kernels per layer."""
    plan = InferencePlan(batch=4.0, input_len=1024, output_len=2)
    op = _prefill(QWEN, plan, Runtime())["moe_permute"]
    t, h, k, layers = 4096.0, 2048.0, 8.0, 48.0
    r = t * k
    per_layer = (t * h * 2 + r * h * 2) + r * h * 2 + t * h * 2
    assert float(op.bytes) == pytest.approx(layers * per_layer, rel=1e-5)
    bw = float(SYSTEM.accelerator.hbm_bandwidth) * float(EFF.hbm)
    assert float(op.memory) == pytest.approx(layers * per_layer / bw, rel=1e-5)
    assert float(op.flops) == 0.0
    assert float(op.kernels) == pytest.approx(layers * MOE_PERMUTE_KERNELS)
    # 4,096 tokens of Qwen3-30B-A3B on a B200: 302 MB per layer, about 47 us
    assert float(op.memory) / layers == pytest.approx(47e-6, rel=0.03)


def test_copy_flag_removes_the_copy_only():
    """`moe_permute_copy` 0 (engines that gather rows inside the GEMM) drops T h s + R h a,
    here with FP8 activations (a = 1 B) and a 16-bit residual stream (s = 2 B)."""
    plan = InferencePlan(batch=2.0, input_len=2048, output_len=2, weight_precision="fp8",
                         activation_precision="fp8")
    copy = _prefill(QWEN, plan, Runtime(moe_permute_copy=1.0))["moe_permute"]
    gather = _prefill(QWEN, plan, Runtime(moe_permute_copy=0.0))["moe_permute"]
    t, h, k = 4096.0, 2048.0, 8.0
    assert float(copy.bytes - gather.bytes) == pytest.approx(48 * (t * h * 2 + t * k * h * 1),
                                                             rel=1e-5)
    assert float(gather.bytes) == pytest.approx(48 * (t * k * h * 2 + t * h * 2), rel=1e-5)
    # the presets: vLLM's and SGLang's Triton fused_moe gather, TensorRT-LLM's CUTLASS copies
    assert float(dp.presets.runtime("vllm").moe_permute_copy) == 0.0
    assert float(dp.presets.runtime("sglang").moe_permute_copy) == 0.0
    assert float(dp.presets.runtime("trtllm").moe_permute_copy) == 1.0
    with pytest.raises(ValueError, match="moe_permute_copy"):
        Runtime(moe_permute_copy=1.5)


def test_dense_model_has_none_and_kernel_count_is_unchanged():
    """A dense model's permutation is zero; for a MoE model the routing kernels are split
    between the element-wise op (top-k) and this op (copy, combine), MOE_KERNELS in all."""
    plan = InferencePlan(batch=1.0, input_len=512, output_len=2)
    dense = _prefill(dp.model("llama3-8b"), plan)["moe_permute"]
    assert float(dense.time) == 0.0 and float(dense.kernels) == 0.0
    ops = _prefill(QWEN, plan, Runtime())
    per_layer = (float(ops["elementwise"].kernels) + float(ops["moe_permute"].kernels)) / 48.0
    assert MOE_KERNELS == 3.0  # top-k, permutation, un-permutation + combine
    assert per_layer == pytest.approx(float(Runtime().elementwise_kernels) + 3.0)


def test_expert_parallel_gpu_permutes_its_own_rows():
    """With EP 8 over 8 GPUs each GPU copies and combines only its experts' rows (the busiest
    GPU's, a little above 1/8), while the T tokens are still read and written."""
    plan1 = InferencePlan(tp=8.0, ep=1.0, batch=8.0, input_len=1024, output_len=2)
    plan8 = InferencePlan(tp=8.0, ep=8.0, batch=8.0, input_len=1024, output_len=2)
    system = dp.system("dgx-b200")
    b1 = float(_prefill(QWEN, plan1, Runtime(), system)["moe_permute"].bytes)
    b8 = float(_prefill(QWEN, plan8, Runtime(), system)["moe_permute"].bytes)
    t, h, k = 8192.0, 2048.0, 8.0
    tokens_part = 48 * 2 * t * h * 2
    rows1, rows8 = b1 - tokens_part, b8 - tokens_part
    assert rows1 == pytest.approx(48 * 2 * t * k * h * 2, rel=1e-5)
    # 65,536 routed rows fill every GPU's 16 experts: exactly an eighth each
    assert rows8 == pytest.approx(rows1 / 8.0, rel=1e-5)
    # 16 tokens (128 routes over 128 experts): the busiest GPU holds more than an eighth
    small1 = InferencePlan(tp=8.0, ep=1.0, batch=1.0, input_len=16, output_len=2)
    small8 = InferencePlan(tp=8.0, ep=8.0, batch=1.0, input_len=16, output_len=2)
    s1 = float(_prefill(QWEN, small1, Runtime(), system)["moe_permute"].bytes)
    s8 = float(_prefill(QWEN, small8, Runtime(), system)["moe_permute"].bytes)
    part = 48 * 2 * 16.0 * h * 2
    assert (s1 - part) / 8.0 < s8 - part < (s1 - part) / 2.0


def test_more_bandwidth_never_slower_and_narrow_experts_pay_most():
    plan = InferencePlan(batch=8.0, input_len=1024, output_len=2)
    base = _prefill(QWEN, plan)["moe_permute"]
    wider = eqx.tree_at(lambda s: s.accelerator.hbm_bandwidth, SYSTEM,
                        2.0 * SYSTEM.accelerator.hbm_bandwidth)
    fast = _prefill(QWEN, plan, system=wider)["moe_permute"]
    assert float(fast.memory) == pytest.approx(0.5 * float(base.memory), rel=1e-5)
    # the permutation against the experts' math: Qwen3-30B-A3B (768-wide experts) pays more
    # than Mixtral 8x7B (14,336-wide) at the same tokens
    def share(model):
        ops = _prefill(model, plan)
        experts = float(ops["mlp_up"].time + ops["mlp_down"].time)
        return float(ops["moe_permute"].time) / experts
    assert share(QWEN) > 3.0 * share(dp.model("mixtral-8x7b"))


def test_vmap_equals_loop_and_gradient_matches_finite_differences():
    plan = InferencePlan(weight_precision="fp8", activation_precision="fp8")
    tokens = jnp.array([3.0, 200.0, 5000.0])
    f = lambda n: moe_module_time(QWEN, SYSTEM, plan, n, Runtime()).permute  # noqa: E731
    np.testing.assert_allclose(np.asarray(jax.vmap(f)(tokens)),
                               np.asarray(jnp.stack([f(n) for n in tokens])), rtol=1e-6)

    def g(bw):
        s = eqx.tree_at(lambda s: s.accelerator.hbm_bandwidth, SYSTEM, bw)
        return moe_module_time(QWEN, s, plan, 2048.0, Runtime()).permute
    bw = SYSTEM.accelerator.hbm_bandwidth
    grad = float(jax.grad(g)(bw))
    h = float(bw) * 1e-3
    fd = (float(g(bw + h)) - float(g(bw - h))) / (2 * h)
    assert grad < 0
    assert grad == pytest.approx(fd, rel=1e-2)


def test_module_permute_is_one_layer_of_inference_ops():
    plan = InferencePlan(batch=512.0, input_len=128, output_len=2, weight_precision="fp4",
                         activation_precision="fp4")
    step = inference_ops(QWEN, SYSTEM, plan, EFF, runtime=Runtime())["decode"]
    m = moe_module_time(QWEN, SYSTEM, plan, 512.0, Runtime(), EFF)
    assert float(m.permute) * 48.0 == pytest.approx(float(step["moe_permute"].roofline),
                                                    rel=1e-5)
    assert float(m.total) == pytest.approx(
        float(m.router + m.experts + m.permute + m.fixed), rel=1e-6)


@pytest.mark.parametrize("attention_dp", [0.0, 1.0])
def test_leading_dense_layers_and_attention_data_parallelism(attention_dp):
    """DeepSeek-V3 (3 of 61 layers dense) on 8 GPUs, EP 8: the op is the MoE layers' share
    (58 / 61) of the module's permutation per layer; with attention data parallelism the
    batch is split over the 8 attention ranks and the experts see all their tokens, so the
    module at b / 8 tokens per rank equals the op."""
    ds = dp.model("deepseek-v3")
    system = dp.system("hgx-h200")
    eff = dp.presets.resolve_efficiency(None, "h200-sxm-141gb")
    plan = InferencePlan(tp=8.0, ep=8.0, attention_dp=attention_dp, batch=64.0,
                         input_len=128, output_len=2, weight_precision="fp8",
                         activation_precision="fp8")
    step = inference_ops(ds, system, plan, eff, runtime=Runtime())["decode"]
    per_rank = 64.0 / 8.0 if attention_dp else 64.0
    m = moe_module_time(ds, system, plan, per_rank, Runtime(), eff)
    assert float(m.permute) * 58.0 == pytest.approx(  # 61 layers x their MoE share 58 / 61
        float(step["moe_permute"].roofline), rel=1e-5)
    dense = dp.model("llama3-8b")
    assert float(moe_module_time(dense, system, plan, 64.0, Runtime(), eff).permute) == 0.0


def test_cutlass_bf16_modules_at_throughput_sizes():
    """NVIDIA's measured TensorRT-LLM 1.3 CUTLASS MoE modules in BF16 (B200, H100; Qwen3-30B-A3B,
    Qwen3-235B-A22B, Mixtral 8x7B; one GPU, 1,024-16,384 tokens: 18 rows): with the
    permutation each is within 0.86-1.27x (Qwen3-30B-A3B's 768-wide experts at 16,384 tokens
    on B200 the largest), MAPE 8.8 %; without it (copy and combine both off) 0.88-1.55x,
    MAPE 10.4 %, Qwen3-30B-A3B at 16,384 tokens 1.55x on B200 and 1.36x on H100."""
    rows = [r for r in read_moe_kernel_rows()
            if r.kernel == "cutlass" and float(r.plan.weight_precision) == 1.0
            and r.tokens >= 1024]
    assert len(rows) == 18
    ratios = np.array([r.time_us / predict_moe_kernel_row(r) for r in rows])
    assert np.all((ratios > 0.84) & (ratios < 1.30)), ratios
    assert np.mean(np.abs(1.0 / ratios - 1.0)) < 0.095
    big = [r for r in rows if r.model == "qwen3-30b-a3b" and r.tokens == 16384]
    for r in big:
        with_perm = predict_moe_kernel_row(r)
        model = dp.model(r.model)
        system = dp.system(r.system)
        eff = dp.presets.resolve_efficiency(None, r.gpu)
        full = moe_module_time(model, system, r.plan, r.tokens, kernel_runtime(r.kernel), eff,
                               router_gemm=False)
        without = (float(full.total) - float(full.permute)) * 1e6
        assert r.time_us / without > 1.3  # 1.55x (B200), 1.36x (H100) without the permutation
        assert r.time_us / with_perm < 1.3  # 1.27x, 1.12x with it
