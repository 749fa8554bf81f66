"""CUDA-graph padding of decode steps (`Runtime.graph_pad_ratio`, `graph_pad_from`): the
padded batch by hand, the padded step's pass against an unpadded one at the padded batch, the
attention at the real batch, and trtllm-bench rows that pad up to the tool's max_batch_size."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from diffperf import presets
from diffperf.inference import graph_padded_batch, inference_ops
from diffperf.inference._iteration import iteration_cost, iteration_time
from diffperf.specs import InferencePlan, Runtime

F = jnp.result_type(float)
#: TensorRT-LLM-like ladder: doubling above 128, top 1,792 (an executor max_batch_size).
LADDER = Runtime(decode_graph=1.0, graph_pad_ratio=2.0, graph_pad_from=128.0,
                 graph_max_tokens=1792.0)


def _no_pad(rt: Runtime) -> Runtime:
    return eqx.tree_at(lambda r: r.graph_pad_ratio, rt, jnp.asarray(1.0, F))


@pytest.mark.parametrize("batch,padded", [
    (1, 1), (100, 100), (128, 128),  # at or below the start of the ladder: no padding
    (129, 256), (256, 256), (257, 512), (600, 1024), (1024, 1024),
    (1025, 1792), (1639, 1792), (1792, 1792),  # the top caps the ladder
    (1800, 1800), (5000, 5000),  # above the top: no graph, no padding
])
def test_padded_batch_by_hand(batch, padded):
    assert float(graph_padded_batch(float(batch), LADDER)) == padded


def test_ratio_one_turns_padding_off_and_gradient_is_straight_through():
    for b in (1.0, 129.0, 1639.0):
        assert float(graph_padded_batch(b, _no_pad(LADDER))) == b
    assert float(jax.grad(lambda b: graph_padded_batch(b, LADDER))(700.0)) == 1.0
    with pytest.raises(ValueError, match="graph_pad_ratio"):
        Runtime(graph_pad_ratio=0.5)
    with pytest.raises(ValueError, match="graph_pad_from"):
        Runtime(graph_pad_from=0.0)


def test_padded_decode_iteration_runs_the_pass_at_the_padded_batch():
    """A decode-only iteration of 300 sequences under the ladder costs the pass (GEMMs,
    element-wise, LM head) of 512 sequences plus the attention of the real 300; a prefill
    iteration of the same tokens is not padded; padding never makes a step faster."""
    m, sy = presets.model("llama3-8b"), presets.system("h100-sxm5-80gb")
    plan = InferencePlan(tp=1, input_len=1024, output_len=256)
    pad = iteration_cost(m, sy, plan, 4096.0, None, LADDER)
    # the ladder's top (1,792) lies below the budget, so both costs have the same grid and
    # compare without interpolation differences
    flat = iteration_cost(m, sy, plan, 4096.0, None, _no_pad(LADDER))
    keys = 300.0 * 1100.0
    padded = iteration_time(pad, 300.0, 300.0, keys, 0.0, 0.0)
    # the pass at 512 rows + attention over the real keys, from the unpadded cost
    want = (iteration_time(flat, 512.0, 512.0, keys, 0.0, 0.0))
    assert float(padded) == pytest.approx(float(want), rel=1e-6)
    assert float(padded) > float(iteration_time(flat, 300.0, 300.0, keys, 0.0, 0.0))
    # a pass with prompt tokens is not padded, even when it is replayed from a graph
    both = eqx.tree_at(lambda r: r.prefill_graph, LADDER, jnp.asarray(1.0, F))
    pad_g = iteration_cost(m, sy, plan, 4096.0, None, both)
    flat_g = iteration_cost(m, sy, plan, 4096.0, None, _no_pad(both))
    mixed = iteration_time(pad_g, 300.0, 1.0, keys, 150.0 * 300.0, 1.0)
    assert float(mixed) == pytest.approx(
        float(iteration_time(flat_g, 300.0, 1.0, keys, 150.0 * 300.0, 1.0)), rel=1e-6)
    for n in (1.0, 64.0, 129.0, 700.0, 1500.0):
        assert float(iteration_time(pad, n, n, n * 1100.0, 0.0, 0.0)) >= float(
            iteration_time(flat, n, n, n * 1100.0, 0.0, 0.0)) * (1 - 1e-6)


def test_infer_pads_the_decode_pass_not_its_attention():
    """`inference_ops` at batch 300 under the ladder: the weight GEMMs and the LM head are
    those of batch 512; the decode attention is batch 300's."""
    m, sy = presets.model("llama3-8b"), presets.system("h100-sxm5-80gb")
    at = lambda b: InferencePlan(tp=1, batch=b, input_len=512, output_len=64)
    padded = inference_ops(m, sy, at(300), None, runtime=LADDER)["decode"]
    flat_512 = inference_ops(m, sy, at(512), None, runtime=_no_pad(LADDER))["decode"]
    flat_300 = inference_ops(m, sy, at(300), None, runtime=_no_pad(LADDER))["decode"]
    for op in ("qkv_proj", "mlp_up", "mlp_down", "lm_head"):
        assert float(padded[op].time) == pytest.approx(float(flat_512[op].time), rel=1e-6)
    assert float(padded["attention"].time) == pytest.approx(
        float(flat_300["attention"].time), rel=1e-6)


def test_serving_caps_the_ladder_at_max_num_seqs_and_stays_differentiable():
    """`serve`'s iteration cost stops a padding ladder at the engine's max_num_seqs (1,639
    sequences of a 1,792-slot engine pad to 1,792, not 2,048); a runtime without padding keeps
    its graph limit, even above max_num_seqs; the gradient of an iteration's time with respect
    to its tokens is finite and vmap over the padding ratio equals a loop."""
    from diffperf.serving._serve import _cost_and_capacity
    from diffperf.specs import Engine

    m, sy = presets.model("llama3-8b"), presets.system("h100-sxm5-80gb")
    plan = InferencePlan(tp=1, input_len=512, output_len=128)
    eng = Engine(max_num_seqs=1792, max_num_batched_tokens=4096)
    top8k = eqx.tree_at(lambda r: r.graph_max_tokens, LADDER, jnp.asarray(8192.0, F))
    cost, _ = _cost_and_capacity(m, sy, plan, eng, None, top8k)
    assert float(cost.graph_pad_top) == 1792.0
    small = Engine(max_num_seqs=64, max_num_batched_tokens=4096)
    plain, _ = _cost_and_capacity(m, sy, plan, small, None, _no_pad(top8k))
    assert float(plain.graph_pad_top) == 8192.0
    exact = iteration_cost(m, sy, plan, 4096.0, None, _no_pad(top8k))
    want = iteration_time(exact, 1792.0, 1792.0, 1639.0 * 600.0, 0.0, 0.0)
    got = iteration_time(cost, 1639.0, 1639.0, 1639.0 * 600.0, 0.0, 0.0)
    assert float(got) == pytest.approx(float(want), rel=5e-3)  # interpolation between grids
    for n in (100.0, 128.0, 129.0, 300.0, 1792.0):
        g = jax.grad(lambda t: iteration_time(cost, t, t, t * 600.0, 0.0, 0.0))(n)
        assert jnp.isfinite(g) and float(g) > 0.0
    ratios = jnp.asarray([1.0, 1.5, 2.0], F)

    def at(r):
        rt = eqx.tree_at(lambda x: x.graph_pad_ratio, top8k, r)
        c = iteration_cost(m, sy, plan, 4096.0, None, rt, 1792.0)
        return iteration_time(c, 700.0, 700.0, 700.0 * 600.0, 0.0, 0.0)

    looped = [float(at(r)) for r in ratios]
    assert jax.vmap(at)(ratios).tolist() == pytest.approx(looped, rel=1e-6)
    assert looped[0] < looped[1] < looped[2]  # 700 -> 700, 972, 1024 sequences


def test_trtllm_bench_rows_pad_up_to_the_tools_max_batch_size():
    """A trtllm-bench PyTorch-backend row runs the `trtllm-bench` runtime, whose padded ladder
    its deployment stops at the engine's max_num_seqs (the max_batch_size the tool picked); a
    TensorRT-engine (0.17) row keeps its preset's runtime (no padding)."""
    from diffperf.serving._serve import _cost_and_capacity
    from diffperf.validation._serving_rows import read_serving_rows, serving_case

    rows = {r["id"]: r for r in read_serving_rows()}
    case = serving_case(rows["trtllmpost-A-b200-qwen3-30b-a3b-tp1-1000x1000"])
    assert case.runtime_name == "trtllm-bench"
    rt = case.runtime
    assert float(rt.graph_pad_ratio) == 2.0 and float(rt.graph_pad_from) == 128.0
    assert float(rt.graph_max_tokens) == 8192.0  # the pages' largest listed size
    assert float(case.engine.max_num_seqs) == 1792.0
    typical = eqx.tree_at(lambda p: (p.input_len, p.output_len), case.plan,
                          (jnp.asarray(1000.0, F), jnp.asarray(1000.0, F)))
    cost, _ = _cost_and_capacity(case.model, case.system, typical, case.engine, None, rt)
    assert float(cost.graph_pad_top) == 1792.0
    engine = next(r for r in rows.values() if r["benchmark_tool"].startswith("trtllm-bench build"))
    assert float(serving_case(engine).runtime.graph_pad_ratio) == 1.0
