"""Feasibility of training plans: the right reason code for each invalid plan; a valid plan's
report (feasible, or only out of memory) never contains NaN / inf. A structurally invalid
plan's numbers are not a prediction (docs/python-api.md: mask them), but its reason is right."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffperf as dp

# GPT-3 175B: heads 96, layers 96, ffn 49152, seq 2048. A feasible Megatron plan on 64 A100s:
OK = dict(tp=8, pp=8, dp=1, micro_batch=1, global_batch=64, vp=3, sequence_parallel=1,
          recompute="selective")

CASES = [
    ("feasible", OK, "dgx-a100", 0),
    ("tp does not divide heads", {**OK, "tp": 5}, "dgx-a100", 1),
    ("global batch not divisible", {**OK, "dp": 2, "global_batch": 63}, "dgx-a100", 4),
    ("pp * vp > layers", {**OK, "pp": 64, "vp": 2, "global_batch": 128}, "dgx-a100", 5),
    ("interleaving without pp", {**OK, "pp": 1, "vp": 2}, "dgx-a100", 6),
    ("interleaving with m not divisible by pp", {**OK, "global_batch": 12}, "dgx-a100", 6),
    ("cp does not divide seq", {**OK, "cp": 3, "dp": 1}, "dgx-a100", 7),
    # Megatron's context parallelism cuts a sequence into 2 * cp chunks: cp = 2048 at 2,048
    # tokens divides the sequence but leaves half a token per chunk
    ("2 cp does not divide seq", {**OK, "cp": 2048, "dp": 1, "global_batch": 64},
     "dgx-a100", 7),
    ("fp8 on A100", {**OK, "precision": "fp8"}, "dgx-a100", 9),
    ("memory too big", dict(tp=8, pp=1, dp=1, global_batch=8, micro_batch=8), "dgx-a100", 10),
]


@pytest.mark.parametrize("label,kw,sysname,reason", CASES, ids=[c[0] for c in CASES])
def test_reason_codes(step, gpt3, eff, label, kw, sysname, reason):
    r = step(gpt3, dp.system(sysname), dp.TrainingPlan(**kw), eff)
    assert int(r.reason) == reason, (label, int(r.reason), dp.explain(int(r.reason)))
    assert bool(r.feasible) == (reason == 0)
    if reason in (0, 10):
        assert bool(r.fits) == (reason == 0)


def test_tp_kv_heads_and_ffn_reasons(step, eff, dgx_a100):
    # GQA with 8 KV heads: tp = 16 is a multiple of 8 (KV replicated) -> allowed;
    llama = dp.model("llama2-70b")
    ok = step(llama, dgx_a100, dp.TrainingPlan(tp=16, pp=4, global_batch=16,
                                               sequence_parallel=1), eff)
    assert int(ok.reason) in (0, 10)
    # 12 query heads, 3 KV heads (d = 64), ffn 3000: tp = 2 divides heads but not kv_heads
    odd = dp.Transformer(layers=4, hidden=768, heads=12, kv_heads=3, ffn_hidden=3000, vocab=1000,
                         seq_len=512)
    assert int(step(odd, dgx_a100, dp.TrainingPlan(tp=2, global_batch=4), eff).reason) == 2
    # tp = 8 does not divide ffn 3000 (= 8 * 375); a 12-head model with tp 4 does divide
    odd2 = dp.Transformer(layers=4, hidden=768, heads=12, kv_heads=12, ffn_hidden=3002,
                          vocab=1000, seq_len=512)
    assert int(step(odd2, dgx_a100, dp.TrainingPlan(tp=4, global_batch=4), eff).reason) == 3


def test_memory_reason_flips_with_capacity(step, gpt3, eff):
    """Same plan: infeasible (10) on 40 GB A100s, and the reported total exceeds 40 GB."""
    plan = dp.TrainingPlan(tp=8, pp=8, dp=1, global_batch=64, micro_batch=1,
                           sequence_parallel=1, recompute="selective")
    big = step(gpt3, dp.system("dgx-a100"), plan, eff)
    small_sys = dp.System(dp.gpu("a100-sxm4-40gb"), dp.system("dgx-a100").network)
    small = step(gpt3, small_sys, plan, eff)
    total = float(small.memory.total)
    assert total == pytest.approx(float(big.memory.total))
    assert (int(small.reason) == 10) == (total > 40e9)
    assert (int(big.reason) == 0) == (total <= 80e9)
    # the explanation carries the numbers
    text = dp.explain(10, total, 40e9)
    assert "HBM" in text and f"{total / 1e9:.1f}" in text and "40.0" in text


def test_explain_every_code():
    for code, text in dp.REASONS.items():
        assert dp.explain(code).startswith(text)
    assert "fp8" in dp.explain(9, precision=2)


def _float_fields(report):
    return [(jax.tree_util.keystr(path), np.asarray(leaf))
            for path, leaf in jax.tree_util.tree_leaves_with_path(report)
            if np.asarray(leaf).dtype.kind == "f"]


def _assert_all_finite(report, label):
    for path, arr in _float_fields(report):
        assert np.all(np.isfinite(arr)), (label, path, arr)


def _assert_refused(report, label):
    """A structurally invalid plan: not feasible, with a structural reason (its numbers are
    not a prediction and are not checked)."""
    assert int(report.reason) not in (0, 10, 12) and not bool(report.feasible), label


@pytest.mark.parametrize("label,kw,sysname,reason", CASES, ids=[c[0] for c in CASES])
def test_valid_reports_are_finite_and_invalid_ones_refused(step, gpt3, eff, label, kw, sysname,
                                                          reason):
    r = jax.device_get(step(gpt3, dp.system(sysname), dp.TrainingPlan(**kw), eff))
    if reason in (0, 10):
        _assert_all_finite(r, label)
        assert float(r.step_time) > 0
    else:
        _assert_refused(r, label)


def test_an_invalid_plan_that_computes_nan_is_refused(step, eff):
    """Issue 41 item 5: a 30-layer model, pp = 32, dp = 2, global batch 2, ZeRO-3, embedding
    and loss counted as pipeline slots on GB200 is reason 5 (its step time is NaN: 0 / 0 in the
    data-parallel window; by the documented rule a refused plan's numbers are not a
    prediction)."""
    from diffperf.specs._training_plan import TrainingPlan
    model = eqx.tree_at(lambda t: t.layers, dp.model("gpt-1.7b"), jnp.float32(30.0))
    plan = eqx.tree_at(lambda t: t.pp, TrainingPlan(dp=2, global_batch=2, zero=3,
                                                    account_embedding_loss=1), jnp.float32(32.0))
    r = jax.device_get(step(model, dp.system("gb200-nvl72"), plan, eff))
    assert int(r.reason) == 5
    _assert_refused(r, "30 layers, pp 32")


@pytest.mark.parametrize("kw", [
    dict(tp=8, pp=8, dp=1, global_batch=1, micro_batch=4),     # fewer sequences than a micro-batch
    dict(tp=8, pp=128, dp=1, global_batch=8),                  # more stages than layers
    dict(tp=64, pp=1, dp=1, global_batch=8),                   # tp beyond the heads
    dict(tp=8, pp=1, dp=1, cp=4096, global_batch=8),           # cp beyond seq_len
    dict(tp=8, pp=2, dp=4, ep=3, global_batch=8),              # ep does not divide anything
    dict(tp=1, pp=1, dp=1, global_batch=1, precision="fp4"),   # no fp4 on A100
])
def test_degenerate_plans_are_refused(step, gpt3, dgx_a100, eff, kw):
    r = jax.device_get(step(gpt3, dgx_a100, dp.TrainingPlan(**kw), eff))
    _assert_refused(r, kw)


def test_predict_training_raises_with_fields_and_values():
    model = dp.model("gpt3-175b")
    system = dp.system("a100-sxm4-80gb")
    with pytest.raises(ValueError, match=r"tp does not divide heads \(tp=5, heads=96\)"):
        dp.predict_training(model, system, dp.TrainingPlan(tp=5, pp=1, dp=1, global_batch=8))
    with pytest.raises(ValueError, match=r"global_batch=100"):
        dp.predict_training(model, system, dp.TrainingPlan(tp=8, pp=8, dp=3, global_batch=100))
    # a valid plan that does not fit is predicted, not raised
    r = dp.predict_training(model, system, dp.TrainingPlan(tp=1, pp=1, dp=1, global_batch=8,
                                                           recompute="none"))
    assert not bool(r.fits) and not bool(r.feasible) and float(r.step_time) > 0


def test_divides_matches_integer_arithmetic_in_float32():
    """`divides` (vectorised float arithmetic) agrees with Python's integer % on every pair of
    divisors 1..1024 and dividends 0..20000, and just below 2^24 where float32 spacing reaches
    1, although XLA's vectorised division is not correctly rounded (21 / 3 < 7 happens); a zero
    divisor or an infinite dividend never counts as dividing."""
    from diffperf.feasibility import divides
    a = np.arange(1, 1025, dtype=np.float32)[:, None]
    b = np.concatenate([np.arange(0, 20001), 2**24 - np.arange(1, 2000)]).astype(np.float32)[None]
    got = np.asarray(jax.jit(divides)(a, b))
    want = (b.astype(np.int64) % a.astype(np.int64)) == 0
    assert got.shape == want.shape and (got == want).all()
    f32 = jax.numpy.float32
    assert not bool(divides(f32(0), f32(8)))
    assert not bool(divides(f32(2), f32(np.inf)))
    assert bool(divides(f32(7), f32(0)))


def test_predict_training_checks_layer_counts_like_the_command_line(eff):
    """`recompute_layers` / `offload_layers` count layers of one pipeline chunk, and
    `predict_training` raises the command line's message for a count beyond it, naming the
    plan field."""
    llama = dp.model("llama3-70b")  # 80 layers, one chunk at pp = vp = 1
    base = dict(tp=8, pp=1, vp=1, dp=8, micro_batch=1, global_batch=64, recompute="none")
    sys_ = dp.system("gb200-nvl72")
    for kw, match in ((dict(recompute_layers=100), "recompute_layers 100 exceeds"),
                      (dict(offload_layers=81), "offload_layers 81 exceeds")):
        with pytest.raises(ValueError, match=f"TrainingPlan.{match}"):
            dp.predict_training(llama, sys_, dp.TrainingPlan(**base, **kw), eff)
    ok = dp.predict_training(llama, sys_, dp.TrainingPlan(**base, recompute_layers=40,
                                                          offload_layers=40), eff)
    assert np.isfinite(float(ok.step_time))


def test_traced_bad_counts_are_infeasible_with_reason_11():
    """Inside jit a plan cannot refuse tp = 0 or a negative batch when it is built: the model
    flags it instead (reason 11), for training and inference, and valid values stay feasible."""
    h100 = dp.system("h100-sxm5-80gb")
    train = jax.jit(lambda tp, pp, mb, gb: dp.train_step(
        dp.model("llama3-8b"), h100, dp.TrainingPlan(tp=tp, pp=pp, dp=2, micro_batch=mb,
                                                     global_batch=gb)).reason)
    assert int(train(8.0, 4.0, 1.0, 64.0)) in (0, 10)
    for bad in [(-8.0, 4.0, 1.0, 64.0), (0.0, 4.0, 1.0, 64.0), (8.0, -4.0, 1.0, 64.0),
                (8.0, 4.0, 0.5, 64.0), (8.0, 4.0, -1.0, -64.0), (8.0, 4.0, 1.0, 0.0)]:
        assert int(train(*bad)) == 11, bad
    infer = jax.jit(lambda b, i, o: dp.infer(
        dp.model("llama2-7b"), h100, dp.InferencePlan(batch=b, input_len=i, output_len=o)).reason)
    assert int(infer(1.0, 128.0, 128.0)) == 0
    for bad in [(0.0, 128.0, 128.0), (-1.0, 128.0, 128.0), (1.0, 0.0, 128.0),
                (1.0, 128.0, 0.0), (1.0, -5.0, 128.0), (1.5, 128.0, 128.0)]:
        assert int(infer(*bad)) == 11, bad
    assert "whole number" in dp.explain(11)


def test_embedding_and_loss_slots_count_in_the_pipeline_split():
    """NVIDIA's Llama 3.1 405B layout on GB200 (pp 16, vp 8, embedding and loss counted as
    pipeline layers): 126 + 2 = 128 slots for 128 chunks. It was refused as 'pp * vp exceeds
    layers' (issue 41, item 4); one chunk more than the slots, or a split that leaves an end
    stage without a transformer layer, is still reason 5."""
    model, system = dp.model("llama3-405b"), dp.system("gb200-nvl72")
    kw = dict(tp=4, dp=4, global_batch=64, sequence_parallel=1, precision="fp8", fp32_gradients=0,
              account_embedding_loss=1)
    recipe = dp.train_step(model, system, dp.TrainingPlan(pp=16, vp=8, **kw))
    assert int(recipe.reason) == 0 and bool(recipe.feasible)
    assert np.isfinite(float(recipe.step_time))
    assert float(dp.TrainingPlan(pp=16, vp=8, **kw).end_stage_layers(126.0)) == 7.0
    without = dp.train_step(model, system, dp.TrainingPlan(
        pp=16, vp=8, **{**kw, "account_embedding_loss": 0}))
    assert int(without.reason) == 5  # 128 chunks for 126 layers
    too_many = dp.train_step(model, system, dp.TrainingPlan(pp=26, vp=5, **{**kw, "dp": 2,
                                                                            "global_batch": 52}))
    assert int(too_many.reason) == 5  # 130 chunks for 128 slots
    small = eqx.tree_at(lambda t: t.layers, dp.model("llama2-7b"), jnp.asarray(30.0))
    empty_end = dp.train_step(small, system, dp.TrainingPlan(
        pp=32, dp=2, global_batch=2, zero=3, account_embedding_loss=1))
    assert int(empty_end.reason) == 5  # 32 slots for 32 stages: the end stages hold no layer


def test_an_infinite_count_is_reason_11_under_jit(step, gpt3, dgx_a100, eff):
    """Issue 41 item 5: a traced count of +inf passed `x >= 1` and `x == round(x)` and got
    reasons 1 / 4 / 5 / 10 from the checks after it; it is not a whole number (reason 11)."""
    from diffperf.feasibility import TRAINING_COUNTS, TRAINING_COUNTS_OR_ZERO
    plan = dp.TrainingPlan(**OK)
    for field in TRAINING_COUNTS + TRAINING_COUNTS_OR_ZERO:
        bad = eqx.tree_at(lambda p, f=field: getattr(p, f), plan, jnp.float32(np.inf))
        r = jax.device_get(step(gpt3, dgx_a100, bad, eff))
        assert int(r.reason) == 11, (field, int(r.reason))
        _assert_refused(r, field)


def test_an_infinite_inference_count_is_reason_11_under_jit(dgx_a100):
    infer = jax.jit(dp.infer)
    plan = dp.InferencePlan(tp=8, batch=4)
    for field in ("tp", "pp", "ep", "batch", "input_len", "output_len"):
        bad = eqx.tree_at(lambda p, f=field: getattr(p, f), plan, jnp.float32(np.inf))
        r = jax.device_get(infer(dp.model("llama2-70b"), dgx_a100, bad))
        assert int(r.reason) == 11, (field, int(r.reason))
        assert not bool(r.feasible), field
