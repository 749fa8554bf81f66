"""Sliding-window attention (Mistral 7B v0.1, Gemma 2 / 3, gpt-oss): attention work and KV cache
checked by hand and against step-by-step sums, no effect where the window covers the context,
monotonicity, vmap == loop and gradients.

Expected values are written out from the definition: a query at position i of a causal
sequence attends to min(i, w) keys in a windowed layer and to i keys in a global one."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffperf as dp
from diffperf.inference import inference_ops

EFF = dp.Efficiency()
H100 = dp.system("h100-sxm5-80gb")
BASE = dp.model("llama3-8b")  # 32 layers, h = 4096, 32 query / 8 KV heads of 128, no window


def windowed(window, global_layers=0, model=BASE, **kw):
    return dataclasses.replace(model, sliding_window=window, global_layers=global_layers, **kw)


def causal_keys(s, w):
    """Keys per query summed over a causal sequence of s tokens, window w (brute force)."""
    i = np.arange(1, s + 1)
    return np.minimum(i, w).sum()


def test_attended_keys_match_a_brute_force_count():
    # In the full-square convention (s keys per query without a window) a window keeps the
    # share of the causal products that the band holds.
    for s, w in [(8192, 1024), (4096, 4096), (2048, 4096), (8192, 128), (1000, 999)]:
        m = windowed(w)
        got = float(m.attended_keys(float(s)))
        want = s * causal_keys(s, min(w, s)) / causal_keys(s, s)
        assert got == pytest.approx(want, rel=2e-3), (s, w)


def test_training_flops_by_hand():
    # 8 of 32 layers global, 24 slide over 1024 tokens of an 8192-token sequence: the windowed
    # layers count 2 * 1024 - 1024^2 / 8192 = 1920 keys per query instead of 8192.
    B, s, a_d = 16, 8192, 4096
    full = dataclasses.replace(BASE, seq_len=s)
    m = windowed(1024, 8, model=full)
    plan = dp.TrainingPlan(global_batch=B)
    saved = 3 * B * s * 24 * 4 * a_d * (8192 - 1920)  # fwd + bwd, QK^T and AV
    got = float(dp.model_flops_per_step(full, plan)) - float(dp.model_flops_per_step(m, plan))
    assert got == pytest.approx(saved, rel=1e-4)
    # d FLOPs / d window = 3 B s (L - global) 4 a d (2 - 2 w / s), by hand
    grad = jax.grad(lambda w: dp.model_flops_per_step(
        dataclasses.replace(m, sliding_window=w), plan))(jnp.float32(1024.0))
    want = 3 * B * s * 24 * 4 * a_d * (2 - 2 * 1024 / 8192)
    assert float(grad) == pytest.approx(want, rel=1e-4)


def test_kv_cache_by_hand():
    # Gemma-3-like layout on the 32-layer model: 8 global layers hold all 8192 tokens, 24
    # windowed layers 1024; 8 KV heads of 128, bf16, batch 3, tp 2.
    m = windowed(1024, 8)
    plan = dp.InferencePlan(tp=2, batch=3, input_len=6000, output_len=2192)
    want = 2 * (8 * 8192 + 24 * 1024) * (8 / 2) * 128 * 2 * 3
    assert float(dp.kv_cache_bytes_per_gpu(m, plan)) == pytest.approx(want, rel=1e-6)
    full = float(dp.kv_cache_bytes_per_gpu(BASE, plan))
    assert full == pytest.approx(2 * 32 * 8192 * 4 * 128 * 2 * 3, rel=1e-6)


def test_decode_attention_equals_the_step_by_step_sum():
    """The closed form over all decode steps vs a loop over the steps: step j reads
    min(input_len + j, w) cached tokens per windowed layer, input_len + j per global one."""
    w, g, batch, n_in, n_out = 1024, 8, 4, 512, 2048  # the context crosses the window
    m = windowed(w, g)
    plan = dp.InferencePlan(batch=batch, input_len=n_in, output_len=n_out)
    op = inference_ops(m, H100, plan, EFF)["decode"]["attention"]
    ctx = n_in + np.arange(1, n_out)
    tokens = (g * ctx + (32 - g) * np.minimum(ctx, w)).sum()  # over layers and steps
    assert float(op.bytes) == pytest.approx(batch * tokens * 2 * 8 * 128 * 2, rel=1e-3)
    assert float(op.flops) == pytest.approx(4 * batch * 32 * tokens * 128, rel=1e-3)
    # a decode that starts beyond the window reads exactly w tokens per windowed layer
    far = dp.InferencePlan(batch=batch, input_len=5000, output_len=100)
    op = inference_ops(windowed(w), H100, far, EFF)["decode"]["attention"]
    assert float(op.bytes) == pytest.approx(batch * 99 * 32 * w * 2 * 8 * 128 * 2, rel=1e-6)


def test_a_window_that_covers_the_context_changes_nothing():
    m = windowed(8192)  # llama3-8b trains at 8192 tokens
    plan = dp.TrainingPlan(tp=2, pp=2, dp=2, micro_batch=1, global_batch=16, recompute=1,
                           sequence_parallel=1)
    a, b = dp.train_step(BASE, H100, plan, EFF), dp.train_step(m, H100, plan, EFF)
    assert float(b.step_time) == pytest.approx(float(a.step_time), rel=1e-6)
    assert float(b.memory.total) == pytest.approx(float(a.memory.total), rel=1e-6)
    served = dp.InferencePlan(tp=2, batch=8, input_len=3000, output_len=1000)
    a, b = dp.infer(BASE, H100, served, EFF), dp.infer(m, H100, served, EFF)
    for f in ("ttft", "tpot", "e2e_latency"):
        assert float(getattr(b, f)) == pytest.approx(float(getattr(a, f)), rel=1e-6)
    assert float(b.memory.total) == pytest.approx(float(a.memory.total), rel=1e-6)


def test_smaller_windows_and_fewer_global_layers_are_never_slower():
    long = dataclasses.replace(BASE, seq_len=32768)
    plan = dp.TrainingPlan(tp=8, cp=2, dp=1, micro_batch=1, global_batch=4, recompute=1,
                           sequence_parallel=1)
    served = dp.InferencePlan(tp=2, batch=16, input_len=16384, output_len=2048)
    rows = []
    for w, g in [(256, 0), (1024, 0), (4096, 0), (4096, 8), (4096, 16), (16384, 16),
                 (32768, 16), (0, 0)]:
        m = windowed(w, g, model=long)
        t, r = dp.train_step(m, H100, plan, EFF), dp.infer(m, H100, served, EFF)
        rows.append([float(x) for x in (t.step_time, r.ttft, r.tpot, r.memory.kv_cache)])
    rows = np.array(rows)
    assert np.all(np.diff(rows, axis=0) >= -1e-6 * rows[1:]), rows
    # and a window of 1024 on every layer makes 16k-token decode much cheaper than none
    assert rows[1, 2] < 0.8 * rows[-1, 2] and rows[1, 3] < 0.1 * rows[-1, 3]


def test_vmap_over_windows_equals_a_loop():
    windows = jnp.array([0.0, 512.0, 2048.0, 8192.0])
    globals_ = jnp.array([0.0, 4.0, 16.0, 32.0])
    served = dp.InferencePlan(batch=8, input_len=4096, output_len=1024)

    def tpot(w, g):
        return dp.infer(windowed(w, g), H100, served, EFF).tpot

    batched = jax.vmap(tpot)(windows, globals_)
    looped = [float(tpot(w, g)) for w, g in zip(windows, globals_)]
    np.testing.assert_allclose(np.asarray(batched), looped, rtol=1e-5)


def test_decode_gradient_matches_finite_differences():
    served = dp.InferencePlan(batch=32, input_len=512, output_len=4096)

    def e2e(w):
        return dp.infer(windowed(w, 8), H100, served, EFF).e2e_latency

    w0, step = 2048.0, 64.0  # e2e is piecewise quadratic in w: central differences are exact
    grad = float(jax.grad(e2e)(jnp.float32(w0)))
    fd = (float(e2e(w0 + step)) - float(e2e(w0 - step))) / (2 * step)
    assert grad > 0
    assert grad == pytest.approx(fd, rel=2e-2)


def test_bad_windows_are_named():
    with pytest.raises(ValueError, match="global_layers=40 exceeds layers=32"):
        windowed(1024, 40)
    with pytest.raises(ValueError, match="sliding_window"):
        windowed(-1)
    with pytest.raises(ValueError, match="sliding_window"):
        windowed(100.5)
