"""Fine-grained MoE physics (issue 37): the fixed k-loop cost of an fp8 GEMM's output tiles
(DeepGEMM's published FP8 GEMM rates) and the SMs an overlapped expert-parallel all-to-all
takes from the compute it hides behind (DeepSeek-V3's 20 communication SMs).

Expected values are written from the formulas in the docstrings, not taken from the code;
16-bit dense training is pinned to its value before these mechanisms."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toy_moe import EFF, H100, MOE, STEP, E, F, H, K, L, V  # noqa: F401

import diffperf as dp
from diffperf.costs._gemm import K_LOOP_FP8, gemm_cost, k_loop_loss
from diffperf.training._layer_comm import EP_COMM_SMS, ep_comm


def _plan(**kw):
    base = dict(tp=1, pp=1, dp=8, ep=8, micro_batch=2, global_batch=64, zero=1)
    return dp.TrainingPlan(**(base | kw))


def test_k_loop_loss_by_hand():
    k0 = 644.0
    assert K_LOOP_FP8 == k0
    # Qwen3-30B-A3B's expert down projection: 8,192 tokens x 2,048 out x 768 in, fp8
    want = 1 + k0 / 3 * (1 / 8192 + 1 / 2048 + 1 / 768)
    assert float(k_loop_loss(8192.0, 2048.0, 768.0, 2.0)) == pytest.approx(want, rel=1e-6)
    # fp4's k steps are twice as fast against the same fixed cost: k0 doubles
    want4 = 1 + 2 * k0 / 3 * (3 / 4096)
    assert float(k_loop_loss(4096.0, 4096.0, 4096.0, 3.0)) == pytest.approx(want4, rel=1e-6)
    # 16 bit and fp32 keep their fitted size loss only
    for p in (0.0, 1.0):
        assert float(k_loop_loss(64.0, 64.0, 64.0, p)) == 1.0


def test_k_loop_reproduces_deepgemms_published_k_trend():
    """DeepGEMM's FP8 GEMMs on H800 (README; m >= 4,096, n >= 4,096): TFLOPS against k. One
    rate A / (1 + k0 / k) with the shipped k0 follows them within 10 %."""
    table = [(512, 590), (1536, 990), (2048, 1025), (2048, 1099), (2048, 1093), (7168, 1304),
             (7168, 1297), (7168, 1288), (16384, 1358)]
    shape = np.array([1 / (1 + K_LOOP_FP8 / k) for k, _ in table])
    measured = np.array([t for _, t in table], dtype=float)
    scale = np.exp(np.mean(np.log(measured / shape)))
    np.testing.assert_allclose(scale * shape, measured, rtol=0.10)
    # without the term (the size loss alone) k = 512 would run at 87 % of k = 16,384's rate;
    # measured: 43 %
    assert measured[0] / measured[-1] == pytest.approx(0.434, abs=0.01)


def test_fp8_gemm_time_carries_the_k_loop_and_16_bit_does_not():
    acc = H100.accelerator
    m, n, k = 8192.0, 2048.0, 768.0
    fp8 = gemm_cost(acc, EFF, m, n, k, 2.0, act_bytes=2.0, k_loop=True)
    bf16 = gemm_cost(acc, EFF, m, n, k, 1.0, k_loop=True)
    # a dense GEMM (k_loop off) keeps the fitted size loss alone
    plain = gemm_cost(acc, EFF, m, n, k, 2.0, act_bytes=2.0)
    assert float(fp8.compute) / float(plain.compute) == pytest.approx(
        float(k_loop_loss(m, n, k, 2.0)), rel=1e-5)
    assert float(bf16.compute) == float(gemm_cost(acc, EFF, m, n, k, 1.0).compute)
    # compute-bound: the fp8 compute roof is the bf16 one at twice the peak, less matmul_lowp,
    # divided by the k-loop factor
    ratio = float(fp8.compute) / float(bf16.compute)
    want = (float(acc.flops_bf16) / float(acc.flops_fp8) / float(EFF.matmul_lowp)
            * float(k_loop_loss(m, n, k, 2.0)))
    assert ratio == pytest.approx(want, rel=1e-5)


def test_k_loop_gradient_matches_finite_differences():
    x = jnp.array([8192.0, 2048.0, 768.0])
    f = lambda v: k_loop_loss(v[0], v[1], v[2], 2.0)
    g = np.asarray(jax.grad(f)(x))
    np.testing.assert_allclose(g, -K_LOOP_FP8 / 3 / np.asarray(x) ** 2, rtol=1e-5)
    h = 0.01 * np.asarray(x)  # 1 % steps: float32 resolves the difference
    fd = [(float(f(x.at[i].add(h[i]))) - float(f(x.at[i].add(-h[i])))) / (2 * h[i])
          for i in range(3)]
    np.testing.assert_allclose(g, fd, rtol=1e-2)


@pytest.mark.parametrize("precision,before", [("bf16", 13.065351486206055),
                                              ("fp8", 9.372669219970703)])
def test_dense_training_is_unchanged(precision, before):
    """Neither mechanism touches a dense step: Llama-3 70B on 64 H100 at the default factors
    gives the step time it gave before them, in 16 bit and in fp8."""
    plan = dp.TrainingPlan(tp=4, pp=2, dp=8, micro_batch=1, global_batch=128,
                           precision=precision, sequence_parallel=1)
    r = dp.train_step(dp.model("llama3-70b"), H100, plan, EFF)
    assert float(r.step_time) == pytest.approx(before, rel=1e-6)
    # and overlap_ep means nothing without experts
    dense = dataclasses.replace(MOE, num_experts=1, experts_per_token=1, ffn_hidden=4 * H)
    a = STEP(dense, H100, _plan(ep=1), EFF)
    b = STEP(dense, H100, _plan(ep=1, overlap_ep=1), EFF)
    assert float(a.step_time) == float(b.step_time)


def test_overlapped_all_to_all_pays_for_the_sms_it_takes():
    plan = _plan(overlap_ep=1)
    net, n = H100.network, float(H100.accelerator.num_sms)
    window = 1e-3
    free_exposed, total = ep_comm(MOE, plan, net, EFF, window)  # no SM cost
    exposed, total2 = ep_comm(MOE, plan, net, EFF, window, n)
    assert float(total2) == float(total) > 0
    c = EP_COMM_SMS
    want = float(free_exposed) + (float(total) - float(free_exposed)) * c / (n - c)
    assert float(exposed) == pytest.approx(want, rel=1e-6)
    assert float(free_exposed) < float(exposed) <= float(total)
    # more SMs, a smaller share taken
    more = ep_comm(MOE, plan, net, EFF, window, 2 * n)[0]
    assert float(free_exposed) < float(more) < float(exposed)
    # without overlap the whole all-to-all is exposed, SMs or not
    off = _plan(overlap_ep=0)
    assert float(ep_comm(MOE, off, net, EFF, window, n)[0]) == pytest.approx(float(total))
    # in the step: overlapping still never costs more than not overlapping
    a = STEP(MOE, H100, off, EFF)
    b = STEP(MOE, H100, plan, EFF)
    assert float(b.step_time) < float(a.step_time)
    assert float(b.ep_comm_time) > 0  # the SMs the hidden part took


def test_step_gradient_through_the_overlapped_all_to_all_matches_finite_differences():
    plan = _plan(overlap_ep=1)
    f = lambda a2a: dp.train_step(MOE, H100, plan, eqx.tree_at(
        lambda e: e.all_to_all, EFF, a2a)).step_time
    x = jnp.asarray(0.6)
    g = float(jax.grad(f)(x))
    h = 1e-3
    fd = (float(f(x + h)) - float(f(x - h))) / (2 * h)
    assert g < 0  # a faster all-to-all, a faster step
    assert g == pytest.approx(fd, rel=2e-2)


def test_fp8_casts_of_the_routed_tokens_by_hand():
    """R = 2 x 2,048 tokens x top 4 routed tokens per GPU (tp 1, balanced); forward casts the
    up projection's input (R x h) and the down projection's (R x f), backward the two output
    gradients (R x h and R x 2 f, gated), 4 B per element, 2 kernels each pass."""
    from diffperf.training._layer import (
        FP8_CAST_BYTES,
        _moe_quantize_ops,
        moe_quantize_op,
        moe_quantize_time,
    )
    assert FP8_CAST_BYTES == 4.0
    acc = H100.accelerator
    plan = _plan(precision="fp8")
    r = 2 * 2048 * K
    fwd, bwd = _moe_quantize_ops(MOE, plan, acc, EFF)
    assert float(fwd.hbm_bytes) == pytest.approx(4 * r * (H + F), rel=1e-6)
    assert float(bwd.hbm_bytes) == pytest.approx(4 * r * (H + 2 * F), rel=1e-6)
    assert float(fwd.kernels) == float(bwd.kernels) == 2.0
    assert float(fwd.flops) == 0.0
    t = moe_quantize_time(MOE, plan, acc, EFF)
    assert float(t.forward) == pytest.approx(float(fwd.time))
    assert float(t.backward) == pytest.approx(float(bwd.time))
    assert float(moe_quantize_op(MOE, plan, acc, EFF).time) == pytest.approx(float(fwd.time))
    # 16-bit GEMMs cast nothing; a dense model has no routed tokens
    assert float(moe_quantize_time(MOE, _plan(precision="bf16"), acc, EFF).forward) == 0.0
    dense = dataclasses.replace(MOE, num_experts=1, experts_per_token=1, ffn_hidden=4 * H)
    assert float(moe_quantize_time(dense, _plan(ep=1, precision="fp8"), acc, EFF).backward) == 0
    # the casts are in the step and in its detail
    detail = dp.training_detail(MOE, H100, plan, EFF)
    assert float(detail.forward["moe_quantize"].time) == pytest.approx(float(fwd.time))
    assert float(detail.backward["moe_quantize"].time) == pytest.approx(float(bwd.time),
                                                                        rel=1e-5)


def test_biased_clamped_experts_eager_work_by_hand():
    """gpt-oss in Megatron-Core (`TEGroupedMLP` at Megatron-LM 0d8e0714): R = 2 x 2,048 x 4
    routed tokens per GPU, 16-bit (2 B). Clamp + concatenation of the R x 2 f up-projection
    output: 4 x 2 B per element forward in 3 kernels, PyTorch's clamp backward below. The
    down-projection bias, a loop over E / ep = 4 local experts: 6 x 2 B per element of R x h
    forward (2 kernels per expert + a concatenation), 8 x 2 B backward (4 per expert + 1)."""
    from diffperf.training._layer import _moe_eager_ops, moe_eager_op, moe_eager_time
    acc = H100.accelerator
    plan = _plan(precision="bf16")
    r, local = 2 * 2048 * K, E / 8
    oss = dataclasses.replace(MOE, expert_bias=1, glu_clamp=1)
    fwd, bwd = _moe_eager_ops(oss, plan, acc, EFF)
    assert float(fwd.hbm_bytes) == pytest.approx(2 * r * (4 * 2 * F + 6 * H), rel=1e-6)
    # backward clamp: PyTorch's clamp_backward. Linear half, where((x >= lo) & (x <= hi), g,
    # 0): two comparisons (read 2, write a 1-byte mask) 6 B, the in-place `and` 3 B, the
    # `where` (read 2 + 1, write 2) 5 B: 14 B. Gate half, where(x <= hi, g, 0): 3 + 5 = 8 B.
    # The halves' gradients concatenated: 4 B. (14 + 8) / 2 + 4 = 15 B per element of R x 2 f
    assert float(bwd.hbm_bytes) == pytest.approx(r * (15.0 * 2 * F + 2 * 8 * H), rel=1e-6)
    assert float(fwd.kernels) == 3 + 2 * local + 1
    assert float(bwd.kernels) == (5 + 3 + 1) + 4 * local + 1
    assert float(fwd.flops) == 0.0
    # each flag alone carries its own part
    clamp_only = _moe_eager_ops(dataclasses.replace(MOE, glu_clamp=1), plan, acc, EFF)[0]
    assert float(clamp_only.hbm_bytes) == pytest.approx(2 * r * 4 * 2 * F, rel=1e-6)
    bias_only = _moe_eager_ops(dataclasses.replace(MOE, expert_bias=1), plan, acc, EFF)[1]
    assert float(bias_only.hbm_bytes) == pytest.approx(2 * r * 8 * H, rel=1e-6)
    t = moe_eager_time(oss, plan, acc, EFF)
    assert float(t.forward) == pytest.approx(float(fwd.time))
    assert float(t.backward) == pytest.approx(float(bwd.time))
    assert float(moe_eager_op(oss, plan, acc, EFF).time) == pytest.approx(float(fwd.time))
    # models without biases or a clamp, and dense models, have no such work
    assert float(moe_eager_time(MOE, plan, acc, EFF).forward) == 0.0
    dense = dataclasses.replace(MOE, num_experts=1, experts_per_token=1, ffn_hidden=4 * H,
                                glu_clamp=1)
    assert float(moe_eager_time(dense, _plan(ep=1), acc, EFF).backward) == 0.0
    with pytest.raises(ValueError, match="expert_bias > 0 needs a MoE model"):
        dataclasses.replace(dense, expert_bias=1)
    # in the step: slower by at least the op's time over L layers x 4 micro-batches (only
    # compute changes: the all-to-all may hide more behind it), and in the detail
    plain, biased = STEP(MOE, H100, plan, EFF), STEP(oss, H100, plan, EFF)
    m = 64 / (8 * 2)
    added = float(biased.compute_time - plain.compute_time)
    assert added == pytest.approx(L * m * float(t.forward + t.backward), rel=1e-4)
    assert float(biased.step_time) > float(plain.step_time)
    detail = dp.training_detail(oss, H100, plan, EFF)
    assert float(detail.forward["moe_eager"].time) == pytest.approx(float(fwd.time))
    assert float(detail.backward["moe_eager"].time) == pytest.approx(float(bwd.time), rel=1e-5)


def test_eager_expert_work_gradient_matches_finite_differences():
    """d step / d HBM bandwidth with the eager expert work on, against central differences."""
    oss = dataclasses.replace(MOE, expert_bias=1, glu_clamp=1)
    plan = _plan(precision="bf16", micro_batch=1)

    def step(bw):
        system = eqx.tree_at(lambda s: s.accelerator.hbm_bandwidth, H100, bw)
        return STEP(oss, system, plan, EFF).step_time

    bw = jnp.asarray(float(H100.accelerator.hbm_bandwidth))
    grad = float(jax.grad(step)(bw))
    eps = 1e-3 * float(bw)
    fd = (float(step(bw + eps)) - float(step(bw - eps))) / (2 * eps)
    assert grad < 0
    assert grad == pytest.approx(fd, rel=2e-2)


def test_k_loop_forward_by_hand_and_in_serving(monkeypatch):
    """Inference runs the forward GEMM alone: its factor is 1 + k0 / k at its own depth k. It
    applies to a MoE model's routed experts in fp8 / fp4; a dense model, and a MoE model in
    16 bit, serve exactly as without the term (checked by switching it off)."""
    import diffperf.inference._infer as infer_module
    from diffperf.costs._gemm import k_loop_forward
    assert float(k_loop_forward(768.0, 2.0)) == pytest.approx(1 + K_LOOP_FP8 / 768, rel=1e-6)
    assert float(k_loop_forward(2048.0, 3.0)) == pytest.approx(1 + 2 * K_LOOP_FP8 / 2048,
                                                               rel=1e-6)
    assert float(k_loop_forward(768.0, 1.0)) == 1.0
    b200 = dp.system("dgx-b200")

    def run(name, prec):
        plan = dp.InferencePlan(tp=1, batch=64, input_len=1024, output_len=256,
                                weight_precision=prec, activation_precision=prec)
        r = dp.infer(dp.model(name), b200, plan, EFF)
        return float(r.ttft), float(r.tpot)

    cases = [("llama3-70b", "fp8"), ("llama3-70b", "fp4"), ("qwen3-30b-a3b", "fp4"),
             ("qwen3-30b-a3b", "bf16")]
    on = {c: run(*c) for c in cases}
    monkeypatch.setattr(infer_module, "k_loop_forward", lambda k, precision: 1.0)
    off = {c: run(*c) for c in cases}
    for c in (("llama3-70b", "fp8"), ("llama3-70b", "fp4"), ("qwen3-30b-a3b", "bf16")):
        assert on[c] == pytest.approx(off[c], rel=1e-6)
    # Qwen3-30B-A3B's experts (k = 2,048 and 768) slow its fp4 prefill by 1 + 1,288 / k
    # on their GEMMs: 0.130 -> 0.172 s when measured at the change
    assert 1.15 < on[("qwen3-30b-a3b", "fp4")][0] / off[("qwen3-30b-a3b", "fp4")][0] < 1.6
