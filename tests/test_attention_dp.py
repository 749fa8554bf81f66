"""Attention data parallelism (`InferencePlan.attention_dp`): each of the tp GPUs of a stage
serves its own sequences with the whole attention block, only the routed experts are split.
Checked against what it must reduce to (a dense model's ranks are independent replicas) and
hand-counted weights, KV cache and collective traffic."""

from __future__ import annotations

import equinox as eqx
import numpy as np
import pytest

import diffperf as dp
from diffperf.inference import weight_bytes_per_gpu
from diffperf.serving import Traffic, serve
from diffperf.specs import Engine

H100 = dp.system("h100-sxm5-80gb")


def _plan(**kw):
    base = dict(input_len=512, output_len=128, batch=64)
    return dp.InferencePlan(**{**base, **kw})


def test_dense_model_ranks_are_independent_replicas():
    """A dense model has nothing to gather: tp attention-DP ranks are tp replicas of one GPU
    with batch / tp each, so TTFT, TPOT and tokens/s per GPU equal those of tp = 1."""
    m = dp.model("llama3-8b")
    ranks = dp.infer(m, H100, _plan(tp=4, batch=64, attention_dp=1))
    one = dp.infer(m, H100, _plan(tp=1, batch=16))
    for field in ("ttft", "tpot", "output_tok_s_per_gpu"):
        assert float(getattr(ranks, field)) == pytest.approx(float(getattr(one, field)),
                                                             rel=1e-6), field
    assert float(ranks.memory.total) == pytest.approx(float(one.memory.total), rel=1e-6)
    assert float(ranks.max_batch) == 4 * float(one.max_batch)
    assert float(ranks.decode.tp_comm) == 0.0


def test_dense_serving_equals_replicas_of_one_gpu():
    """`serve` splits the stream over the ranks: a dense tp = 2 attention-DP engine serves like
    two tp = 1 replicas (same per-request latencies and tokens/s per GPU)."""
    m = dp.model("llama3-8b")
    traffic = Traffic(rate=8.0, num_requests=200, input_len=512, output_len=128, seed=0)
    eng = Engine(max_num_seqs=32, max_num_batched_tokens=2048)
    a = serve(m, H100, _plan(tp=2, attention_dp=1), eng, traffic)
    b = serve(m, H100, _plan(tp=1), eng, traffic, replicas=2)
    assert float(a.ttft.mean) == pytest.approx(float(b.ttft.mean), rel=1e-5)
    assert float(a.tpot.p90) == pytest.approx(float(b.tpot.p90), rel=1e-5)
    assert float(a.output_tok_s_per_gpu) == pytest.approx(float(b.output_tok_s_per_gpu),
                                                          rel=1e-5)
    assert float(a.num_gpus) == 2.0 and float(a.replicas) == 1.0
    assert float(a.kv_capacity) == 2 * float(b.kv_capacity)  # one replica of two ranks


def test_weights_replicate_attention_and_split_only_the_experts():
    """Mixtral 8x7B (standard attention, 8 experts) on tp = ep = 8: with attention DP a GPU
    holds all of the attention projections, the embedding and LM head, and one expert; with
    tensor-parallel attention 1/8 of them. Difference = 7/8 of the attention, embedding and
    head bytes, hand-counted from the architecture."""
    m = dp.model("mixtral-8x7b")
    plan = _plan(tp=8, ep=8)
    tp_w = float(weight_bytes_per_gpu(m, plan))
    dp_w = float(weight_bytes_per_gpu(m, eqx.tree_at(lambda p: p.attention_dp, plan, 1.0)))
    h, heads, kv, d = (float(getattr(m, k)) for k in ("hidden", "heads", "kv_heads",
                                                       "head_dim"))
    layers, vocab = float(m.layers), float(m.vocab)
    attention = layers * (h * (heads + 2 * kv) * d + heads * d * h) * 2.0  # bf16
    embed_head = 2 * vocab * h * 2.0  # untied embedding + LM head, 16 bit
    assert dp_w - tp_w == pytest.approx(7 / 8 * (attention + embed_head), rel=1e-6)


def test_mla_cache_is_not_replicated():
    """DeepSeek-V3 (MLA: one latent 'head' every tensor-parallel GPU caches whole): with tp = 8
    tensor-parallel attention each GPU caches the latent of all 64 sequences; with attention
    DP each caches its 8 sequences only: 1/8 of the KV bytes, and 8x the sequences fit."""
    m = dp.model("deepseek-v3")
    plan = _plan(tp=8, ep=8, weight_precision="fp8", activation_precision="fp8",
                 kv_precision="fp8")
    tp_r = dp.infer(m, dp.system("h200-sxm-141gb"), plan)
    dp_r = dp.infer(m, dp.system("h200-sxm-141gb"),
                    eqx.tree_at(lambda p: p.attention_dp, plan, 1.0))
    width = float(m.kv_lora_rank + m.rope_head_dim)
    hand = float(m.layers) * width * 1.0 * (512 + 128) * 64 / 8  # fp8: 1 byte
    assert float(dp_r.memory.kv_cache) == pytest.approx(hand, rel=1e-6)
    assert float(tp_r.memory.kv_cache) == pytest.approx(8 * hand, rel=1e-6)
    assert bool(dp_r.feasible) and bool(tp_r.feasible)


def test_moe_layers_gather_every_ranks_tokens():
    """The MoE all-gather + reduce-scatter moves the tokens of all ranks: its time grows with
    the ranks' tokens and falls with NVLink bandwidth; the dense-MLP layers add none."""
    m = dp.model("deepseek-v3")
    plan = _plan(tp=8, ep=8, attention_dp=1, weight_precision="fp8",
                 activation_precision="fp8", kv_precision="fp8")
    h200 = dp.system("h200-sxm-141gb")
    comm = lambda sys_, b: float(dp.infer(m, sys_, eqx.tree_at(lambda p: p.batch, plan,
                                                                b)).prefill.tp_comm)
    assert comm(h200, 128) > comm(h200, 32) > 0
    faster = eqx.tree_at(lambda s: s.network.nvlink_bandwidth, h200,
                         2 * h200.network.nvlink_bandwidth)
    assert comm(faster, 128) < comm(h200, 128)


def test_experts_see_all_ranks_tokens():
    """A decode step's expert GEMMs on one GPU: with attention DP over 8 ranks of 8 sequences
    each, the experts see 64 tokens, as with tensor-parallel attention over 64 sequences
    (ep = 8 in both): equal expert GEMM time, while the attention and projections run 8 vs 64
    tokens."""
    m = dp.model("deepseek-v3")
    base = dict(tp=8, ep=8, input_len=512, output_len=2, weight_precision="fp8",
                activation_precision="fp8", kv_precision="fp8")
    from diffperf.inference import inference_ops
    h200 = dp.system("h200-sxm-141gb")
    d_ops = inference_ops(m, h200, dp.InferencePlan(batch=64, attention_dp=1, **base))["decode"]
    t_ops = inference_ops(m, h200, dp.InferencePlan(batch=64, **base))["decode"]
    for op in ("mlp_up", "mlp_down"):
        assert float(d_ops[op].roofline) == pytest.approx(float(t_ops[op].roofline), rel=1e-6)
    assert float(d_ops["attention"].roofline) < float(t_ops["attention"].roofline)


def test_bad_flag_is_one_line_error():
    with pytest.raises(ValueError, match="attention_dp"):
        dp.InferencePlan(attention_dp=2)


def test_vmap_over_attention_dp_equals_loop():
    import jax
    import jax.numpy as jnp
    m = dp.model("deepseek-v3")
    h200 = dp.system("h200-sxm-141gb")
    flags = jnp.array([0.0, 1.0])
    plan = _plan(tp=8, ep=8, weight_precision="fp8", activation_precision="fp8",
                 kv_precision="fp8")
    f = jax.vmap(lambda a: dp.infer(m, h200, eqx.tree_at(lambda p: p.attention_dp, plan,
                                                         a)).tpot)
    batched = np.asarray(f(flags))
    loop = [float(dp.infer(m, h200, eqx.tree_at(lambda p: p.attention_dp, plan,
                                                 jnp.asarray(a))).tpot) for a in flags]
    np.testing.assert_allclose(batched, loop, rtol=1e-5)


def test_search_and_disaggregated_refuse_attention_dp():
    """Not supported yet: a clear one-line error naming the field, not a wrong answer."""
    from diffperf.serving import serve_disaggregated, slo_search
    m = dp.model("llama3-8b")
    plan = _plan(tp=2, attention_dp=1)
    traffic = Traffic(rate=4.0, num_requests=20, input_len=128, output_len=16, seed=0)
    with pytest.raises(ValueError, match="attention_dp"):
        slo_search(m, H100, plan, Engine(), traffic, {"ttft_p90": 1.0})
    with pytest.raises(ValueError, match="prefill_plan.attention_dp"):
        serve_disaggregated(m, H100, plan, _plan(tp=2), Engine(), Engine(), traffic, 1, 1)
