"""Inference model: hand-checked formulas, physics of boundedness, vmap, monotonicity, errors."""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from diffperf.inference import (
    bound_shares,
    boundedness,
    dram_scaling,
    experts_touched,
    infer,
    inference_ops,
    kv_cache_bytes_per_gpu,
    weight_bytes_per_gpu,
)
from diffperf.plots import roofline_plot
from diffperf.presets import model, system
from diffperf.specs import Efficiency, InferencePlan

EFF = Efficiency()
A100, H100, B200 = "a100-sxm4-80gb", "h100-sxm5-80gb", "b200"


def test_kv_cache_bytes_by_hand():
    m = model("llama2-70b")  # 80 layers, 8 KV heads of 128
    plan = InferencePlan(tp=2, batch=4, input_len=300, output_len=100)
    assert float(kv_cache_bytes_per_gpu(m, plan)) == pytest.approx(
        2 * 80 * (8 / 2) * 128 * 2 * 400 * 4)
    # tp = 16 > 8 KV heads: each GPU keeps one (replicated) KV head; fp8 halves the bytes.
    plan = InferencePlan(tp=16, pp=2, batch=1, input_len=1000, output_len=24, kv_precision="fp8")
    assert float(kv_cache_bytes_per_gpu(m, plan)) == pytest.approx(2 * 40 * 1 * 128 * 1 * 1024)
    mha = model("llama2-7b")  # MHA: 32 KV heads
    plan = InferencePlan(tp=4, batch=2, input_len=512, output_len=512)
    assert float(kv_cache_bytes_per_gpu(mha, plan)) == pytest.approx(
        2 * 32 * 8 * 128 * 2 * 1024 * 2)


def test_prefill_activation_peak_by_hand():
    """Residual + normalised input (2 h) plus the larger of attention (Q, K, V, output) and MLP
    (first GEMM output(s) + activation output), 16 bit, per prompt token; fp32 logits per
    sequence. GPT-J (f = 4h, MHA): the MLP's 2 f dominates the attention's 4 h."""
    from diffperf.inference import inference_memory
    m = model("gpt-j-6b")
    h, f, V = 4096, 16384, 50400
    plan = InferencePlan(tp=1, batch=512, input_len=128, output_len=128)
    want = 512 * (128 * (2 * h * 2 + max(4 * h * 2, 2 * f * 2)) + V * 4)
    assert float(inference_memory(m, plan, EFF).activations) == pytest.approx(want, rel=1e-6)
    # Llama-2 70B at tp 8 (gated MLP: 3 f / 8; GQA: 64 / 8 query and 8 / 8 KV heads of 128)
    m = model("llama2-70b")
    h, f = 8192, 28672
    plan = InferencePlan(tp=8, batch=2, input_len=1000, output_len=10)
    attn = (8 + 2 * 1) * 128 * 2 + 8 * 128 * 2
    want = 2 * (1000 * (2 * h * 2 + max(attn, 3 * f / 8 * 2)) + 32000 / 8 * 4)
    assert float(inference_memory(m, plan, EFF).activations) == pytest.approx(want, rel=1e-6)


def test_weights_by_hand():
    m = model("llama2-7b")
    w = float(weight_bytes_per_gpu(m, InferencePlan(tp=1)))
    assert w == pytest.approx(float(m.num_params()) * 2, rel=1e-3)
    w_fp8 = float(weight_bytes_per_gpu(m, InferencePlan(tp=2, weight_precision="fp8")))
    assert w_fp8 < 0.3 * w  # layers at 1 B and half of them per GPU; head and embedding 16 bit
    # A tied model (Gemma, GPT-2) keeps one V x h matrix; 2-stage pipelines already hold one
    # per end stage, tied or not.
    tied = eqx.tree_at(lambda x: x.tied_embeddings, m, 1.0)
    w_tied = float(weight_bytes_per_gpu(tied, InferencePlan(tp=1)))
    assert w - w_tied == pytest.approx(32000 * 4096 * 2, rel=1e-4)
    assert float(weight_bytes_per_gpu(tied, InferencePlan(tp=1, pp=2))) == float(
        weight_bytes_per_gpu(m, InferencePlan(tp=1, pp=2)))
    assert w_tied == pytest.approx(float(tied.num_params()) * 2, rel=1e-3)


def _no_overheads(gpu: str):
    """A system and efficiency with zero launch / collective costs and effectively infinite
    FLOP/s, so decode is pure weight (and KV) streaming."""
    s = system(gpu)
    acc = s.accelerator
    acc = eqx.tree_at(lambda a: (a.launch_overhead, a.flops_bf16, a.vector_flops), acc,
                      (jnp.asarray(0.0), acc.flops_bf16 * 1e6, acc.vector_flops * 1e6))
    s = eqx.tree_at(lambda t: t.accelerator, s, acc)
    eff = Efficiency(kernel_overhead=0.0, collective_overhead=0.0, hbm=0.8)
    return s, eff


def test_decode_is_weight_streaming_by_hand():
    m = model("llama2-7b")
    s, eff = _no_overheads(A100)
    plan = InferencePlan(tp=1, batch=1, input_len=1, output_len=2)
    r = infer(m, s, plan, eff)
    h, f, v, layers = 4096, 11008, 32000, 32
    weights = layers * (4 * h * h + 3 * h * f) * 2 + v * h * 2  # per step: layers + LM head
    bw = float(s.accelerator.hbm_bandwidth) * 0.8
    # The GEMMs' smooth maximum of (~0 compute, memory) with knee k = 0.3 exceeds the memory
    # time by (1 + sqrt(1 + k^2)) / 2 - 1 = 2.2 %.
    knee = (1 + (1 + 0.3**2) ** 0.5) / 2
    assert float(r.tpot) == pytest.approx(weights / bw * knee, rel=0.01)
    assert float(r.e2e_latency) == pytest.approx(float(r.ttft + r.tpot), rel=1e-6)


def test_per_head_decode_attention_by_hand():
    """A per-query-head decode kernel (TensorRT-LLM masked MHA) reads the KV cache once, like a
    grouped kernel, but does its 4 b a L d FLOPs in scalar FP32 at `per_head_attention` of the
    CUDA-core FLOP/s: for Mistral-7B (32 query heads on 8 KV heads) with an FP8 KV cache that
    is 8 FLOP per byte, compute-bound on an H100, so more HBM bandwidth (an H200) barely helps,
    while the grouped kernel stays memory-bound."""
    gqa = model("mistral-7b")
    eff = Efficiency(per_head_attention=0.15)
    plan = InferencePlan(batch=16, input_len=1000, output_len=200, weight_precision="fp8",
                         activation_precision="fp8", kv_precision="fp8")
    per_head = eqx.tree_at(lambda p: p.grouped_decode_attention, plan, jnp.asarray(0.0))
    s = system(H100)
    grouped_op = inference_ops(gqa, s, plan, eff)["decode"]["attention"]
    per_head_op = inference_ops(gqa, s, per_head, eff)["decode"]["attention"]
    steps, context = 199, 1000 + 100  # sum of the 199 decode steps' contexts = steps * context
    kv = 16 * steps * context * 2 * 32 * 8 * 128 * 1  # batch, tokens, K+V, layers, heads, d, B
    flops = 4 * 16 * 32 * steps * context * 128 * 32  # 4 b a L d, 32 layers
    for op in (grouped_op, per_head_op):
        assert float(op.bytes) == pytest.approx(kv)
        assert float(op.flops) == pytest.approx(flops)
    vector = float(s.accelerator.vector_flops)
    assert float(per_head_op.compute) == pytest.approx(flops / (vector * 0.15))
    assert float(per_head_op.compute) > 2 * float(per_head_op.memory)  # compute-bound
    assert float(grouped_op.memory) > 1.5 * float(grouped_op.compute)  # memory-bound
    # a more efficient kernel is never slower
    tpots = [float(infer(gqa, s, per_head, Efficiency(per_head_attention=r)).tpot)
             for r in (0.05, 0.1, 0.2, 0.5)]
    assert tpots == sorted(tpots, reverse=True) and tpots[0] > tpots[-1]


def test_grouped_decode_attention_rate_by_hand():
    """A grouped decode kernel (XQA) puts a KV group's g query heads in the M of an MMA tile of
    16 rows: it runs at g / 16 of the attention kernel's rate (16-bit peak x
    `Efficiency.attention` / (1 + c / L + c / d) for L keys of width d), not at the GEMM law's
    1 / (1 + c / g). Llama-3-70B (64 query heads on 8 KV heads, g = 8) on an H200 with an FP8
    cache does 16 FLOP per cached byte: by hand 0.5 x 989.5 x 0.55 / (1 + 48/1100 + 48/128)
    = 189 TFLOP/s, so the step reads the cache at the HBM roof (memory-bound), where the GEMM
    law would have given 1 / 7 of the attention rate and a compute-bound step. MLA's 128 heads
    form one full group (no padding)."""
    eff = Efficiency()
    plan = InferencePlan(batch=64, input_len=1000, output_len=200, weight_precision="fp8",
                         activation_precision="fp8", kv_precision="fp8")
    s = system("h200-sxm-141gb")
    op = inference_ops(model("llama3-70b"), s, plan, eff)["decode"]["attention"]
    steps, context = 199, 1000 + 100
    flops = 4 * 64 * 64 * steps * context * 128 * 80  # 4 b a L d, 80 layers
    assert float(op.flops) == pytest.approx(flops)
    rate = 0.5 * 989.5e12 * 0.55 / (1 + 48 / 1100 + 48 / 128)
    assert float(op.compute) == pytest.approx(flops / rate, rel=1e-4)
    assert float(op.memory) > 2.5 * float(op.compute)  # memory-bound
    # MLA (DeepSeek-V3, 128 heads in one group at TP 1): no padding loss, width (c + d_r + c) / 2
    mla = model("deepseek-v3")
    plan16 = InferencePlan(batch=64, input_len=1000, output_len=200)  # bf16
    op = inference_ops(mla, system(B200), plan16, eff)["decode"]["attention"]
    width = (512 + 64 + 512) / 2
    mla_rate = 2.25e15 * 0.55 / (1 + 48 / 1100 + 48 / width)
    assert float(op.compute) == pytest.approx(float(op.flops) / mla_rate, rel=1e-4)


def test_attention_kernel_launches_per_layer_by_hand():
    """TensorRT-LLM 0.9's attention plugin launches three kernels per layer in the context
    phase (offsets, RoPE + KV write, fused MHA), nine without fused attention, and one per
    decode step; each launch costs launch_overhead + kernel_overhead."""
    m, s = model("llama2-7b"), system(H100)
    t_kernel = float(s.accelerator.launch_overhead + EFF.kernel_overhead)
    plan = InferencePlan(tp=1, batch=1, input_len=128, output_len=11)
    ops = inference_ops(m, s, plan, EFF)
    assert float(ops["prefill"]["attention"].kernels) == pytest.approx(32 * 3)
    assert float(ops["prefill"]["attention"].launch) == pytest.approx(32 * 3 * t_kernel)
    assert float(ops["decode"]["attention"].kernels) == pytest.approx(32 * 10)  # 10 steps
    unfused = inference_ops(m, s, InferencePlan(tp=1, batch=1, input_len=128, output_len=11,
                                                flash_attention=0), EFF)
    assert float(unfused["prefill"]["attention"].kernels) == pytest.approx(32 * 9)


def test_split_k_when_output_tiles_do_not_fill_the_sms_by_hand():
    """A GEMM whose m x n output is fewer 128 x 128 tiles than the GPU has SMs runs split-K
    (two kernels). Llama-2 7B on H100 (132 SMs), TP 1: at batch 1 every decode GEMM does; a
    128-token prefill's MLP up-projection (128 x 22016: 172 tiles) does not, its QKV and
    output projections (96 and 32 tiles) do; at 2,048 tokens the output projection does not
    (512 tiles)."""
    m, s = model("llama2-7b"), system(H100)
    ops = inference_ops(m, s, InferencePlan(tp=1, batch=1, input_len=128, output_len=2), EFF)
    for name in ("qkv_proj", "out_proj", "mlp_up", "mlp_down"):
        assert float(ops["decode"][name].kernels) == pytest.approx(32 * 2)
    assert float(ops["prefill"]["mlp_up"].kernels) == pytest.approx(32 * 1)
    assert float(ops["prefill"]["out_proj"].kernels) == pytest.approx(32 * 2)
    assert float(ops["prefill"]["qkv_proj"].kernels) == pytest.approx(32 * 2)  # 96 tiles
    big = inference_ops(m, s, InferencePlan(tp=1, batch=1, input_len=2048, output_len=2), EFF)
    assert float(big["prefill"]["out_proj"].kernels) == pytest.approx(32 * 1)


@pytest.mark.parametrize("gpu, tp, precision", [(B200, 8, "bf16"), (H100, 8, "bf16"),
                                                 (B200, 4, "fp4")])
def test_decode_step_never_faster_at_a_larger_batch_across_the_split_k_switch(gpu, tp,
                                                                               precision):
    """One more request never makes a decode step faster, also where the GEMMs' outputs reach
    one tile per SM and drop split-K's second kernel (Llama 3 70B, 1,024 + 256 tokens). Before
    the choice between split-K and one under-occupied kernel was a minimum, TPOT fell 4.7 %
    from batch 295 to 296 on 8 B200 (3.0 % at 263 -> 264 on H100, 5.8 % for fp4 on 4 B200);
    before split-K followed the tile count it fell 14 % from batch 64 to 65."""
    m, s = model("llama3-70b"), system(gpu)
    batches = jnp.arange(1.0, 513.0)
    tpot = jax.vmap(lambda b: infer(m, s, InferencePlan(
        tp=tp, batch=b, input_len=1024, output_len=256, weight_precision=precision,
        activation_precision=precision, kv_precision=precision), EFF).tpot)(batches)
    steps = np.diff(np.asarray(tpot))
    assert np.all(steps >= -1e-9 * float(tpot[-1])), batches[:-1][steps < 0]


def test_split_k_choice_is_continuous_at_one_tile_per_sm():
    """The GEMM cost is the cheaper of split-K (two kernels, every SM busy) and one kernel on
    the SMs its tiles occupy: just below one tile per SM the single kernel wins (it idles only
    a few SMs) and costs what the full-rate single kernel costs at one tile per SM."""
    from diffperf.internal import inference_gemm as _gemm
    s = system(B200)
    n, k = 8192.0, 1024.0
    one_tile_per_sm = 148 * 128 * 128 / n  # m = 296
    def time(m):
        return float(_gemm(s.accelerator, EFF, m, n, k, 1, 2.0, 2.0).time)
    below, at = time(one_tile_per_sm - 1e-3), time(one_tile_per_sm)
    assert below == pytest.approx(at, rel=1e-4)
    assert float(_gemm(s.accelerator, EFF, one_tile_per_sm - 1, n, k, 1, 2.0, 2.0).kernels) == 1.0
    # batch-1 decode splits
    assert float(_gemm(s.accelerator, EFF, 1.0, n, k, 1, 2.0, 2.0).kernels) == 2.0


def test_parallel_block_halves_tp_reductions_by_hand():
    """A parallel attention + MLP block (Falcon, GPT-J) reduces the summed branches once per
    layer: exactly half the all-reduce time of the sequential block, in both phases, and a
    residual add that reads three tensors instead of two adds of two."""
    seq = model("falcon-180b")
    par = eqx.tree_at(lambda m: m.parallel_attention, seq, jnp.asarray(1.0))
    seq = eqx.tree_at(lambda m: m.parallel_attention, seq, jnp.asarray(0.0))
    s = system(H100)
    plan = InferencePlan(tp=8, batch=4, input_len=512, output_len=64)
    a, b = inference_ops(seq, s, plan, EFF), inference_ops(par, s, plan, EFF)
    for phase, passes in (("prefill", 1), ("decode", 63)):  # decode sums its 63 steps
        assert float(b[phase]["tp_allreduce"].network) == pytest.approx(
            0.5 * float(a[phase]["tp_allreduce"].network))
        assert float(b[phase]["elementwise"].kernels) == pytest.approx(
            float(a[phase]["elementwise"].kernels) - 80 * passes)
    tokens, h = 4 * 512, 14848
    saved = float(a["prefill"]["elementwise"].bytes - b["prefill"]["elementwise"].bytes)
    assert saved == pytest.approx(80 * tokens * h * 2 * 2)  # 80 layers, 2 elements of 2 B
    assert float(infer(par, s, plan, EFF).e2e_latency) < float(infer(seq, s, plan, EFF).e2e_latency)


@pytest.mark.parametrize("gpu", [A100, H100, B200])
def test_llama70b_prefill_compute_bound_decode_memory_bound(gpu):
    plan = InferencePlan(tp=4, batch=8, input_len=2048, output_len=128)
    df = boundedness(model("llama2-70b"), system(gpu), plan, EFF)
    gemms = df[df["kind"] == "gemm"]
    pre = gemms[(gemms["phase"] == "prefill") & (gemms["op"] != "lm_head")]
    assert (pre["bound"] == "compute").all(), pre
    assert (pre["intensity"] > pre["machine_balance"]).all()
    shares = bound_shares(df)
    assert shares.loc["prefill", "compute"] > 0.5
    # Decode at batch 1: every GEMM below the machine balance, memory the main roof.
    df1 = boundedness(model("llama2-70b"), system(gpu),
                      InferencePlan(tp=4, batch=1, input_len=2048, output_len=128), EFF)
    dec = df1[(df1["phase"] == "decode") & (df1["kind"] == "gemm")]
    assert (dec["intensity"] < dec["machine_balance"] / 50).all()
    assert (dec["memory_s"] > 2 * dec["compute_s"]).all()
    big = dec[dec["op"].isin(["mlp_up", "mlp_down"])]
    assert (big["bound"] == "memory").all()
    s1 = bound_shares(df1).loc["decode"]
    assert s1.get("memory", 0.0) > s1.get("compute", 0.0)
    assert np.isclose(df1.groupby("phase")["share"].sum(), 1.0).all()


def test_vmap_equals_loop():
    m, s = model("llama2-13b"), system(H100)
    plans = [InferencePlan(tp=t, batch=b, input_len=i, output_len=o, kv_precision=k)
             for t, b, i, o, k in [(1, 1, 128, 128, 1), (2, 16, 2048, 1, 2), (8, 3, 77, 5, 2)]]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *plans)
    batched = jax.vmap(lambda p: infer(m, s, p, EFF))(stacked)
    for i, p in enumerate(plans):
        one = infer(m, s, p, EFF)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(batched)):
            np.testing.assert_allclose(np.asarray(b[i]), np.asarray(a), rtol=2e-5)


def test_phase_definitions_and_single_token():
    m, s = model("llama2-7b"), system(H100)
    r = infer(m, s, InferencePlan(tp=1, batch=4, input_len=128, output_len=100), EFF)
    assert float(r.e2e_latency) == pytest.approx(float(r.ttft + 99 * r.tpot), rel=1e-5)
    assert float(r.output_tok_s_per_gpu) == pytest.approx(400 / float(r.e2e_latency), rel=1e-5)
    one = infer(m, s, InferencePlan(tp=1, batch=1, input_len=128, output_len=1), EFF)
    assert float(one.e2e_latency) == pytest.approx(float(one.ttft))
    assert np.isfinite(float(one.tpot)) and float(one.tpot) > 0
    assert float(one.decode.total) == 0.0


def test_moe_reads_only_touched_experts():
    m = model("mixtral-8x7b")
    assert float(experts_touched(m, 1.0)) == pytest.approx(2.0)
    assert float(experts_touched(m, 4096.0)) == pytest.approx(8.0)
    assert float(experts_touched(model("llama2-7b"), 7.0)) == 1.0
    s = system(H100)
    t1 = infer(m, s, InferencePlan(tp=2, batch=1, input_len=128, output_len=64), EFF).tpot
    t64 = infer(m, s, InferencePlan(tp=2, batch=64, input_len=128, output_len=64), EFF).tpot
    assert float(t64) > 1.5 * float(t1)  # batch 64 touches all 8 experts, batch 1 only 2


def test_reason_codes_and_fit():
    s = system(A100)
    m = model("llama2-70b")
    assert int(infer(m, s, InferencePlan(tp=3), EFF).reason) == 1
    assert int(infer(m, s, InferencePlan(tp=4, weight_precision="fp8",
                                         activation_precision="fp8"), EFF).reason) == 9
    r = infer(m, s, InferencePlan(tp=1), EFF)
    assert int(r.reason) == 10 and not bool(r.fits) and float(r.max_batch) == 0
    ok = infer(m, s, InferencePlan(tp=4, batch=1, input_len=2048, output_len=2048), EFF)
    assert bool(ok.feasible) and float(ok.max_batch) > 10
    big = InferencePlan(tp=4, batch=float(ok.max_batch) + 1, input_len=2048, output_len=2048)
    assert not bool(infer(m, s, big, EFF).fits)
    # fp4 weights with 16-bit activations run bf16 GEMMs: fine on an A100.
    w4 = InferencePlan(tp=4, weight_precision="fp4", activation_precision="bf16")
    assert int(infer(m, s, w4, EFF).reason) == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"tp": 0}, "tp"), ({"batch": 1.5}, "batch"), ({"weight_precision": "fp5"}, "fp5"),
    ({"kv_precision": 7}, "kv_precision"), ({"flash_attention": 2}, "flash_attention"),
    ({"grouped_decode_attention": 0.5}, "grouped_decode_attention"),
    ({"output_len": -1}, "output_len"),
])
def test_invalid_plans_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        InferencePlan(**kwargs)


_mono_model = model("llama2-13b")


@jax.jit
def _latencies(system_, plan):
    r = infer(_mono_model, system_, plan, EFF)
    return jnp.stack([r.ttft, r.tpot, r.e2e_latency])


def _scaled(gpu, bw_factor, flops_factor):
    s = system(gpu)
    a = s.accelerator
    a = eqx.tree_at(lambda a: (a.hbm_bandwidth, a.flops_fp32, a.flops_bf16, a.flops_fp8,
                               a.vector_flops),
                    a, (a.hbm_bandwidth * bw_factor, a.flops_fp32 * flops_factor,
                        a.flops_bf16 * flops_factor, a.flops_fp8 * flops_factor,
                        a.vector_flops * flops_factor))
    return eqx.tree_at(lambda t: t.accelerator, s, a)


@settings(max_examples=25, deadline=None)
@given(gpu=st.sampled_from([A100, H100]), tp=st.sampled_from([1, 2, 4, 8]),
       batch=st.integers(1, 512), inp=st.integers(1, 8192), out=st.integers(1, 4096),
       factor=st.floats(1.0, 20.0))
def test_more_bandwidth_or_flops_never_slower(gpu, tp, batch, inp, out, factor):
    plan = InferencePlan(tp=tp, batch=batch, input_len=inp, output_len=out)
    base = np.asarray(_latencies(_scaled(gpu, 1.0, 1.0), plan))
    more_bw = np.asarray(_latencies(_scaled(gpu, factor, 1.0), plan))
    more_flops = np.asarray(_latencies(_scaled(gpu, 1.0, factor), plan))
    assert np.all(np.isfinite(base))
    assert np.all(more_bw <= base * (1 + 1e-5))
    assert np.all(more_flops <= base * (1 + 1e-5))


@pytest.mark.slow
def test_dram_scaling_and_plot(tmp_path):
    m, s = model("llama2-70b"), system(H100)
    plan = InferencePlan(tp=8, batch=1, input_len=200, output_len=200)
    df = dram_scaling(m, s, plan, efficiency=EFF)
    assert list(df["memory"])[0].startswith("HBM2e") and len(df) == 5
    assert np.all(np.diff(df["tpot_s"]) < 0) and np.all(np.diff(df["e2e_latency_s"]) < 0)
    # With overheads the benefit saturates: 6.5x the bandwidth buys well under 6.5x.
    assert 1.2 < df["e2e_speedup"].iloc[-1] < 3.0
    custom = dram_scaling(m, s, plan, bandwidths=[1e12, 2e12, 3e12, 4e12, 5e12], efficiency=EFF)
    assert list(custom["memory"])[:2] == ["1 TB/s", "2 TB/s"]
    with pytest.raises(ValueError, match="bandwidths"):
        dram_scaling(m, s, plan, bandwidths=[-1.0], efficiency=EFF)
    pytest.importorskip("matplotlib")
    path = tmp_path / "roof.png"
    roofline_plot(boundedness(m, s, plan, EFF), path, s)
    assert path.stat().st_size > 1000


def _cli_args(argv):
    from diffperf.internal import add_infer_parser
    parser = argparse.ArgumentParser()
    add_infer_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_runs(capsys, tmp_path):
    from diffperf.internal import run_infer
    argv = ["infer", "--model", "llama2-70b", "--gpu", H100, "--tp", "4", "--batch", "1",
            "--input", "200", "--output", "200"]
    try:
        from diffperf.cli import main
    except ImportError:
        main = None
    assert run_infer(_cli_args(argv)) == 0
    out = capsys.readouterr().out
    for word in ("TTFT", "TPOT", "e2e latency", "throughput", "memory per GPU", "mlp_up",
                 "memory"):
        assert word in out
    assert run_infer(_cli_args(argv + ["--json"])) == 0
    import json
    data = json.loads(capsys.readouterr().out)
    assert data["ttft_s"] > 0 and data["boundedness"]
    if main is not None:
        try:
            rc = main(argv + ["--json"])
        except SystemExit as e:  # a cli without the infer command yet
            rc = e.code
        capsys.readouterr()
        assert rc in (0, 2)


def test_cli_per_head_decode_is_slower_for_gqa(capsys, tmp_path):
    """`--per-head-decode` (masked-MHA decode attention on the CUDA cores, 8 query heads per KV
    head for Llama-2 70B) makes long-context decode slower than a grouped kernel."""
    import json

    from diffperf.internal import run_infer
    factors = tmp_path / "eff.json"
    factors.write_text(json.dumps({"per_head_attention": 0.15}))  # the physical default
    argv = ["infer", "--model", "llama2-70b", "--gpu", H100, "--tp", "4", "--batch", "64",
            "--input", "2048", "--output", "512", "--json", "--efficiency", str(factors)]
    tpot = []
    for extra in ([], ["--per-head-decode"]):
        assert run_infer(_cli_args(argv + extra)) == 0
        tpot.append(json.loads(capsys.readouterr().out)["tpot_s"])
    assert tpot[1] > 1.2 * tpot[0]


@pytest.mark.parametrize("argv, match", [
    (["--model", "nope", "--gpu", H100], "unknown model"),
    (["--model", "llama2-7b", "--gpu", H100, "--tp", "3"], "tp does not divide heads"),
    (["--model", "llama2-7b", "--gpu", H100, "--precision", "fp5"], "fp5"),
    (["--model", "llama2-7b", "--gpu", H100, "--efficiency", "/nonexistent.json"], "exist"),
])
def test_cli_errors(capsys, argv, match):
    from diffperf.internal import run_infer
    assert run_infer(_cli_args(["infer"] + argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and match in err and "Traceback" not in err


def test_bench_inference():
    from diffperf.internal import bench_inference
    assert bench_inference(n=2000, repeats=1) > 1000


def test_inference_commands_check_prompts_against_the_served_context(capsys):
    """A preset's seq_len is its pre-training length (DeepSeek-V3: 4096); inference checks a
    prompt against the longest context the model serves (its config's 163,840)."""
    from diffperf.cli import build_parser
    from diffperf.internal import run_infer
    assert float(model("deepseek-v3").seq_len) == 4096
    assert float(model("deepseek-v3", max_context=True).seq_len) == 163840
    assert float(model("llama2-7b", max_context=True).seq_len) == 4096  # none recorded
    parser = build_parser()
    for name, context, warned in (("mixtral-8x7b", 5120, False), ("llama2-7b", 4200, True)):
        argv = ["infer", "--model", name, "--gpu", H100, "--tp", "2", "--input",
                str(context - 100), "--output", "100"]
        assert run_infer(parser.parse_args(argv)) == 0
        assert ("exceeds the model's context" in capsys.readouterr().err) == warned


def test_infer_notes_an_uneven_pipeline_layout(capsys):
    """80 layers over 3 stages: the memory is the average stage's, which the command says."""
    from diffperf.cli import build_parser
    from diffperf.internal import run_infer
    parser = build_parser()
    for pp, noted in ((3, True), (2, False)):
        argv = ["infer", "--model", "llama2-70b", "--gpu", H100, "--tp", "1", "--pp", str(pp)]
        assert run_infer(parser.parse_args(argv)) == 0
        err = capsys.readouterr().err
        assert ("uneven layout: 80 layers over pp = 3" in err) == noted
        assert ("the largest holds 27 layers" in err) == noted


def test_boundedness_takes_the_callers_report():
    """`boundedness(..., report=)` (what `diffperf infer` passes: its own `infer` of the same
    arguments) gives the table it computes itself."""
    m, s = model("llama2-70b"), system(H100)
    plan = InferencePlan(tp=4, batch=8, input_len=512, output_len=64)
    own = boundedness(m, s, plan, EFF)
    given_report = boundedness(m, s, plan, EFF, report=jax.device_get(infer(m, s, plan, EFF)))
    assert own.equals(given_report)
