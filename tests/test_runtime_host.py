"""The host stream of a training step (`diffperf.training._host`, `diffperf.specs.Runtime`):
the GPU waits for the host where issuing a layer's work takes longer than running it."""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffperf as dp
from diffperf.costs._roofline import exposed_after_overlap
from diffperf.presets import runtime, runtime_names
from diffperf.specs import Runtime
from diffperf.training._host import (
    collectives_per_layer,
    host_time_per_layer,
    host_wait,
    micro_batch_host_wait,
)
from diffperf.training._layer import LayerTimes

EAGER = runtime("megatron-deepspeed-2023")
A100 = dp.system("dgx-a100")
EFF = dp.default_efficiency("a100-sxm4-80gb")
#: vTrain's model family: GPT, hidden 2048, 16 heads, sequence 1024, fp16, full recompute
SMALL = dp.Transformer(layers=24, hidden=2048, heads=16, kv_heads=16, ffn_hidden=8192,
                       vocab=50257, seq_len=1024)
SMALL_PLAN = dict(tp=8, global_batch=8, recompute="full", precision="fp16", flash_attention=0,
                  overlap_dp=0)


def test_presets_and_default():
    assert {"megatron-core", "megatron-deepspeed-2023"} <= set(runtime_names())
    default = runtime()
    assert float(default.host_op_time) == float(default.host_collective_time) == 0.0
    with pytest.raises(ValueError, match="Runtime.host_op_time must be a finite number >= 0"):
        Runtime(host_op_time=-1e-6)
    with pytest.raises(ValueError, match="Runtime.train_graph must lie in"):
        Runtime(train_graph=2.0)


def test_collective_calls_per_layer_by_hand():
    """TP without SP: 2 all-reduces per pass, 3 passes with full recompute (forward,
    recompute, backward) = 6; SP turns each into an all-gather + a reduce-scatter; no TP, no
    calls; a parallel block reduces once per pass."""
    calls = lambda model, **kw: float(collectives_per_layer(model, dp.TrainingPlan(**kw)))  # noqa: E731
    assert calls(SMALL, tp=8, global_batch=8, recompute="full") == 6.0
    assert calls(SMALL, tp=8, global_batch=8, recompute="full", sequence_parallel=1) == 12.0
    assert calls(SMALL, tp=8, global_batch=8, recompute="none") == 4.0
    assert calls(SMALL, tp=1, global_batch=8, recompute="full") == 0.0
    parallel = eqx.tree_at(lambda m: m.parallel_attention, SMALL, 1.0)
    assert calls(parallel, tp=8, global_batch=8, recompute="none") == 2.0


def test_host_time_per_layer_by_hand():
    """H = n (1 + f) t_op + n b t_bwd + c t_coll: 55 ops, full recompute (f = 1), b = 1.1,
    6 collectives at 20 us, 19 us per op: 55 * 2 * 19 + 55 * 1.1 * 19 + 6 * 20 us."""
    plan = dp.TrainingPlan(**SMALL_PLAN)
    want = 55 * 2 * 19e-6 + 55 * 1.1 * 19e-6 + 6 * 20e-6
    assert float(host_time_per_layer(SMALL, plan, EAGER)) == pytest.approx(want, rel=1e-5)
    graph = eqx.tree_at(lambda r: r.train_graph, EAGER, 1.0)
    assert float(host_time_per_layer(SMALL, plan, graph)) == 0.0


def test_a_gpu_bound_step_is_unchanged_by_an_eager_host():
    """GPT-3 175B on 1,024 A100s: a layer's kernels take tens of ms per micro-batch, the eager
    host needs ~2 ms to issue them: the passes never wait for the host, but for the smooth
    clip's tail (k^2 H^2 / (4 G), 1e-4 of the step here). What is left is the input
    preparation, which Megatron's timers synchronise around (`pass_sync`): m s N_in t_op
    with the GPU idle."""
    model, plan = dp.model("gpt3-175b"), dp.TrainingPlan(
        tp=8, pp=8, dp=16, vp=3, global_batch=1536, recompute="selective", sequence_parallel=1)
    base = dp.train_step(model, A100, plan, EFF)
    eager = dp.train_step(model, A100, plan, EFF, EAGER)
    inputs = 96 * float(EFF.host_overhead) * 35 * 19e-6  # m = 1536 / 16 micro-batches
    assert float(eager.host_time) == pytest.approx(inputs, abs=2e-4 * float(base.step_time))
    assert float(eager.step_time) == pytest.approx(
        float(base.step_time) + float(eager.host_time), rel=1e-5)
    assert float(base.host_time) == 0.0
    free = eqx.tree_at(lambda r: (r.input_ops, r.pass_sync), EAGER, (0.0, 0.0))
    assert float(dp.train_step(model, A100, plan, EFF, free).host_time) < (
        1e-4 * float(base.step_time))


def test_a_host_bound_step_takes_the_host_time():
    """A tiny model (hidden 128, 32 tokens) on one GPU: each layer's kernels take microseconds,
    its eager host 100x longer. Every layer then costs its host time H, and each micro-batch
    the host time of its work outside the layers (N_mb + N_in operators): the step is
    m (L H + s (N_mb + N_in) t_op) plus the LM head and optimizer, and host_time is that less
    the GPU time, within the smooth clip's ~k^2/4 = 0.25 %."""
    model = dp.Transformer(layers=4, hidden=128, heads=2, kv_heads=2, ffn_hidden=512,
                           vocab=1000, seq_len=32)
    plan = dp.TrainingPlan(global_batch=4, recompute="none")
    slow_host = eqx.tree_at(lambda r: (r.host_op_time, r.host_backward_op_time), EAGER,
                            (1e-3, 1e-3))
    base = dp.train_step(model, A100, plan, EFF)
    r = dp.train_step(model, A100, plan, EFF, slow_host)
    s = float(EFF.host_overhead)  # the calibrated factor on every host time
    h = float(host_time_per_layer(model, plan, slow_host, s))
    assert h == pytest.approx(s * (55 * 1e-3 + 55 * 1.1 * 1e-3), rel=1e-5)
    m_l = 4 * 4  # 4 micro-batches x 4 layers
    layer_gpu = float(base.compute_time - 0.0) / m_l  # an upper bound: includes the head
    assert layer_gpu < 0.01 * h
    outside = s * (105 + 35) * 1e-3
    assert float(r.host_time) == pytest.approx(m_l * h + 4 * outside, rel=0.01)
    assert float(r.step_time) == pytest.approx(float(base.step_time) + float(r.host_time),
                                               rel=1e-6)


FIELDS = ("host_op_time", "host_backward_op_time", "host_collective_time", "ops_per_layer",
          "backward_ops_per_op", "micro_batch_ops", "input_ops")


@jax.jit
def _step_times(plan, runtimes):
    """SMALL's step time on A100 with `plan` under each of a batch of runtimes: one compiled
    program for every host field and plan of `test_more_host_time_is_never_faster`."""
    return jax.vmap(lambda rt: dp.train_step(SMALL, A100, plan, EFF, rt).step_time)(runtimes)


@pytest.mark.parametrize("field", [FIELDS[0]] + [pytest.param(f, marks=pytest.mark.slow)
                                                  for f in FIELDS[1:]])
def test_more_host_time_is_never_faster(field):
    """Along each host field, on vTrain-like plans from GPU-bound to host-bound (tp 1 -> 8,
    micro-batch 8 -> 1): the step time never falls."""
    plans = [dp.TrainingPlan(**{**SMALL_PLAN, "tp": tp, "micro_batch": mb})
             for tp, mb in ((1, 8), (2, 4), (4, 2), (8, 1))]
    scales = jnp.linspace(0.0, 3.0, 13)
    runtimes = jax.vmap(lambda k: eqx.tree_at(lambda r: getattr(r, field), EAGER,
                                              getattr(EAGER, field) * k))(scales)

    for plan in plans:
        t = np.asarray(_step_times(plan, runtimes))
        assert np.all(np.diff(t) >= -1e-6 * t[:-1]), (field, float(plan.tp), t)
    assert t[-1] > t[0]  # and it binds somewhere (the last, host-bound plan)


def test_vmap_over_runtimes_equals_a_loop():
    runtimes = [runtime("megatron-core"), EAGER,
                eqx.tree_at(lambda r: r.train_graph, EAGER, 1.0),
                eqx.tree_at(lambda r: r.host_op_time, EAGER, 40e-6)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *runtimes)
    plan = dp.TrainingPlan(**SMALL_PLAN)
    batch = jax.jit(jax.vmap(lambda r: dp.train_step(SMALL, A100, plan, EFF, r)))(stacked)
    for i, rt in enumerate(runtimes):
        one = dp.train_step(SMALL, A100, plan, EFF, rt)
        for name in ("step_time", "host_time", "bubble_time"):
            assert float(getattr(batch, name)[i]) == pytest.approx(
                float(getattr(one, name)), rel=1e-6), (i, name)
    # the graph-captured runtime is the default's step; the eager one is slower
    assert float(batch.step_time[2]) == pytest.approx(float(batch.step_time[0]), rel=1e-7)
    assert float(batch.step_time[1]) > 1.5 * float(batch.step_time[0])


def test_gradients_of_runtime_fields_match_finite_differences():
    """d step / d (each runtime field) in float64 against central differences, on a plan that
    is host-bound (tp 4, micro-batch 1) and pipelined (the bubble carries the wait too)."""
    jax.config.update("jax_enable_x64", True)  # conftest restores it after the test
    plan = dp.TrainingPlan(**{**SMALL_PLAN, "pp": 2, "tp": 4, "global_batch": 8})
    to64 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), t)  # noqa: E731
    model, system, eff, rt = to64(SMALL), to64(A100), to64(EFF), to64(EAGER)
    f = jax.jit(lambda r: dp.train_step(model, system, plan, eff, r).step_time)
    grad = jax.grad(f)(rt)
    for field in (*FIELDS, "pass_sync"):
        x = float(getattr(rt, field))
        h = 1e-6 * x if field != "pass_sync" else 1e-4  # pass_sync = 1 lies on its bound
        up = eqx.tree_at(lambda r, f_=field: getattr(r, f_), rt, jnp.float64(x + h))
        down = eqx.tree_at(lambda r, f_=field: getattr(r, f_), rt, jnp.float64(x - h))
        fd = (float(f(up)) - float(f(down))) / (2 * h)
        assert float(getattr(grad, field)) == pytest.approx(fd, rel=1e-4, abs=1e-9), field
    assert float(grad.host_op_time) > 0


def test_a_rows_runtime_column_sets_its_runtime_and_plan_defaults(tmp_path):
    """`runtime` names a preset (empty: the default); the runtime's plan defaults (Megatron-
    DeepSpeed: no TP overlap, no asynchronous backward TP all-reduce, 16-bit gradients) fill
    the cells a row leaves empty, and a value in the row wins; an unknown runtime names row
    and column."""
    from diffperf.validation._data import read_benchmarks, row_runtime, train_specs
    src = Path(__file__).resolve().parent.parent / "benchmarks_data" / "train_vtrain_h2048.csv"
    lines = src.read_text().splitlines()
    header = lines[0].split(",")
    assert "runtime" in header and "overlap_tp" not in header
    rows = read_benchmarks(src)
    assert {r.values["runtime"] for r in rows} == {"megatron-deepspeed-2023"}
    plan = train_specs(rows[0])[2]
    assert float(plan.overlap_tp) == 0.0 and float(plan.overlap_tp_backward) == 0.0
    assert float(plan.fp32_gradients) == 0.0  # fp16 gradients, reduced as stored
    assert float(plan.gradient_bytes) == 2.0
    assert float(row_runtime(rows[0]).host_op_time) == float(EAGER.host_op_time)
    # an explicit overlap_tp = 1 wins over the runtime's default
    text = "\n".join([lines[0] + ",overlap_tp", lines[1] + ",1"])
    (tmp_path / "one.csv").write_text(text + "\n")
    (row,) = read_benchmarks(tmp_path / "one.csv")
    assert float(train_specs(row)[2].overlap_tp) == 1.0
    bad = lines[1].replace("megatron-deepspeed-2023", "tensorflow-1")
    (tmp_path / "bad.csv").write_text("\n".join([lines[0], bad]) + "\n")
    with pytest.raises(ValueError, match=r"row 1, column 'runtime': unknown runtime "
                                         r"'tensorflow-1'"):
        read_benchmarks(tmp_path / "bad.csv")


def test_host_overhead_scales_the_host_time():
    """H = s (n (1 + f) t_op + n b t_bwd + c t_coll) with s = Efficiency.host_overhead."""
    plan = dp.TrainingPlan(**SMALL_PLAN)
    want = 1.5 * (55 * 2 * 19e-6 + 55 * 1.1 * 19e-6 + 6 * 20e-6)
    assert float(host_time_per_layer(SMALL, plan, EAGER, 1.5)) == pytest.approx(want, rel=1e-5)


def test_micro_batch_host_wait_by_hand():
    """The two regimes of `micro_batch_host_wait` on hand-made layer times (s): per layer
    G = 1 ms forward, 2 ms backward, 1 ms recompute, 0.3 ms exposed communication; head 3 ms;
    L = 24 layers, 55 ops per layer at 19 us (backward 1.1 per op), 6 collectives at 20 us,
    105 + 35 operators outside the layers. pass_sync = 1: x(H_f, G_f) + x(H_b, G_b) + H_in;
    pass_sync = 0: L x(H, G) + x(H_mb + H_in, head); in between, the linear blend."""
    plan = dp.TrainingPlan(**SMALL_PLAN)
    layer = LayerTimes(forward=1e-3, backward=2e-3, recompute=1e-3, tp_comm=0.3e-3,
                       cp_comm=0.0, ep_comm=0.0, hidden=0.0)
    head = 3e-3
    x = lambda h, g: float(exposed_after_overlap(jnp.float32(h), jnp.float32(g)))  # noqa: E731
    t, c = 19e-6, 6 * 20e-6
    h_fwd = 24 * (55 * t + c / 3) + 105 * t
    h_bwd = 24 * (55 * t + 55 * 1.1 * t + 2 * c / 3)
    g_fwd = 24 * (1e-3 + 0.1e-3) + 1e-3
    g_bwd = 24 * (3e-3 + 0.2e-3) + 2e-3
    synced = x(h_fwd, g_fwd) + x(h_bwd, g_bwd) + 35 * t
    h_layer = 55 * 2 * t + 55 * 1.1 * t + c
    free = 24 * x(h_layer, 4.3e-3) + x(140 * t, head)
    wait = lambda rt: float(micro_batch_host_wait(SMALL, plan, layer, head, rt))  # noqa: E731
    assert wait(EAGER) == pytest.approx(synced, rel=1e-5)
    half = eqx.tree_at(lambda r: r.pass_sync, EAGER, 0.5)
    assert wait(half) == pytest.approx(0.5 * synced + 0.5 * free, rel=1e-5)
    # the forward pass is host-bound (2.6 ms of GPU work against 26 ms of host), the backward
    # GPU-bound: the passes add up to more than one overlap of the whole micro-batch
    assert h_fwd > g_fwd and h_bwd < g_bwd
    # without the work outside the layers and without synchronisation: the layers' own wait
    layers_only = eqx.tree_at(lambda r: (r.micro_batch_ops, r.input_ops, r.pass_sync), EAGER,
                              (0.0, 0.0, 0.0))
    assert wait(layers_only) == pytest.approx(
        24 * float(host_wait(SMALL, plan, layer, layers_only)), rel=1e-6)
    assert wait(runtime()) == 0.0  # the default runtime: no host time, no wait


def test_work_outside_the_layers_binds_where_the_layers_are_short():
    """vTrain's TP 8, micro-batch 1 plan: the LM head's GPU time does not cover the host's
    105 + 35 operators per micro-batch, so they lengthen the step; at TP 1 with micro-batch 8
    the passes are GPU-bound and only the input preparation (the GPU idle) remains."""
    def extra(tp, mb):
        plan = dp.TrainingPlan(**{**SMALL_PLAN, "tp": tp, "micro_batch": mb,
                                  "global_batch": 8 * mb})
        without = eqx.tree_at(lambda r: (r.micro_batch_ops, r.input_ops), EAGER, (0.0, 0.0))
        a, b = (float(dp.train_step(SMALL, A100, plan, EFF, r).step_time)
                for r in (without, EAGER))
        return (b - a) / float(plan.num_micro_batches)  # per micro-batch, s
    s = float(EFF.host_overhead)
    assert extra(8, 1) == pytest.approx(s * 140 * 19e-6, rel=0.05)
    assert extra(1, 8) == pytest.approx(s * 35 * 19e-6, rel=0.05)


# --------------------------------------------------------------------- MoE layers' host work
MOE = dp.Transformer(layers=48, hidden=2048, heads=32, kv_heads=4, ffn_hidden=768,
                     vocab=151936, seq_len=4096, num_experts=128, experts_per_token=8)


def test_moe_forward_ops_by_hand():
    """n = ops_per_layer + (moe_ops_per_layer + E / ep moe_ops_per_expert) in a MoE model
    whose every layer has experts: 40 + (60 + 128 / 8 x 5) = 180; a dense model ignores the
    MoE fields; H = n t_op + n b t_bwd (no recompute, b = 1; the all-to-alls' calls cost
    t_coll = 0 here)."""
    from diffperf.training._host import forward_ops_per_layer
    rt = Runtime(host_op_time=10e-6, host_backward_op_time=10e-6, ops_per_layer=40.0,
                 moe_ops_per_layer=60.0, moe_ops_per_expert=5.0)
    plan = dp.TrainingPlan(ep=8, dp=8, global_batch=64)
    assert float(forward_ops_per_layer(MOE, plan, rt)) == pytest.approx(180.0)
    assert float(forward_ops_per_layer(SMALL, dp.TrainingPlan(global_batch=8), rt)) == 40.0
    # forward + backward ops at 10 us, plus 2 passes x 2 all-to-alls at t_coll = 0
    assert float(host_time_per_layer(MOE, plan, rt)) == pytest.approx(2 * 180 * 10e-6)


def test_moe_layer_sync_never_hides_more():
    """A MoE layer whose forward syncs with the host (`moe_layer_sync`) splits the layer's
    forward and backward into separate segments: the GPU's wait is never shorter than with
    the host running ahead, and strictly longer when the forward is host-bound while the
    backward's longer GPU time would have hidden the excess; a dense model is unaffected."""
    zero = jnp.asarray(0.0)
    layer = LayerTimes(forward=jnp.asarray(1e-3), backward=jnp.asarray(2e-3), recompute=zero,
                       tp_comm=zero, cp_comm=zero, ep_comm=zero, hidden=zero)
    plan = dp.TrainingPlan(ep=8, dp=8, global_batch=64)
    wait = lambda model, sync: float(micro_batch_host_wait(  # noqa: E731
        model, plan, layer, 0.0, Runtime(host_op_time=10e-6, host_backward_op_time=2e-6,
                                         ops_per_layer=150.0, moe_layer_sync=sync)))
    # per layer: forward host 1.5 ms against 1 ms of GPU (0.5 ms exposed); backward host
    # 0.3 ms against 2 ms; pooled 1.8 ms against 3 ms hides it all
    assert wait(MOE, 1.0) == pytest.approx(48 * 0.5e-3, rel=0.05)
    assert wait(MOE, 0.0) < 0.02 * wait(MOE, 1.0)  # the smooth clip's tail only
    assert wait(SMALL, 1.0) == pytest.approx(wait(SMALL, 0.0))


def test_dropless_runtime_binds_small_micro_batches_only():
    """`megatron-core-dropless` (counted host work of a Megatron-Core MoE layer, the forward's
    host wait): Qwen3-30B-A3B on 8 B200 at micro-batch 1 becomes host-bound (the published
    25.11 run took 2x its 25.09 twin's time: Megatron-Bridge issue 1998), while micro-batch 4
    keeps the layers GPU-bound and the default runtime never binds."""
    qwen = dp.model("qwen3-30b-a3b")
    b200 = dp.system("dgx-b200")
    eff = dp.default_efficiency("b200")
    plan = lambda mb: dp.TrainingPlan(ep=8, dp=8, global_batch=512, micro_batch=mb,  # noqa: E731
                                      precision="fp8", recompute="none")
    step = lambda mb, rt: dp.train_step(qwen, b200, plan(mb), eff, runtime(rt))  # noqa: E731
    slow, base = step(1, "megatron-core-dropless"), step(1, "megatron-core")
    assert float(base.host_time) == 0.0
    assert float(slow.step_time) > 1.5 * float(base.step_time)
    big, big_base = step(4, "megatron-core-dropless"), step(4, "megatron-core")
    assert float(big.step_time) < 1.15 * float(big_base.step_time)


def test_training_host_stream_ignores_the_host_time_factor():
    """`Accelerator.host_time_factor` is for the serving runtimes only: an eager training step
    whose host binds (vTrain's GPT at TP 8) is the same at factor 1 and 2.75 (the training
    runtimes' per-operator times were fitted / assumed on their own hosts;
    calibration/EXPERIMENTS.md), while its host wait is a real share of the step."""
    plan = dp.TrainingPlan(dp=1, **SMALL_PLAN)
    grace = eqx.tree_at(lambda s: s.accelerator.host_time_factor, A100, 2.75)
    one = dp.train_step(SMALL, A100, plan, EFF, EAGER)
    other = dp.train_step(SMALL, grace, plan, EFF, EAGER)
    assert float(one.host_time) > 0.05 * float(one.step_time)
    assert float(other.step_time) == float(one.step_time)
    assert float(other.host_time) == float(one.host_time)
