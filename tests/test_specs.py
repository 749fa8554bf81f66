"""Spec construction: bad values raise ValueError naming the field and the value; good values
become float array leaves (so vmap / grad can use them)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import diffperf as dp

GPT = dict(layers=96, hidden=12288, heads=96, kv_heads=96, ffn_hidden=49152, vocab=51200)
A100 = dict(flops_fp32=156e12, flops_bf16=312e12, flops_fp8=0, flops_fp4=0, vector_flops=19.5e12,
            hbm_capacity=80e9, hbm_bandwidth=2.039e12, l2_capacity=40e6, l2_bandwidth=5e12,
            num_sms=108, launch_overhead=3e-6)
NET = dict(nvlink_domain=8, nvlink_bandwidth=300e9, nvlink_latency=2e-6,
           scaleout_bandwidth=25e9, scaleout_latency=5e-6)


def _raises(fn, *needles):
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


@pytest.mark.parametrize("field,value,shown", [
    ("tp", 0, "0"), ("pp", -2, "-2"), ("dp", 1.5, "1.5"), ("micro_batch", 0, "0"),
    ("global_batch", 2.5, "2.5"), ("vp", 0, "0"), ("cp", float("nan"), "nan"),
])
def test_training_plan_bad_integer(field, value, shown):
    _raises(lambda: dp.TrainingPlan(**{field: value}), f"TrainingPlan.{field}", shown)


def test_training_plan_tp_zero_message():
    msg = _raises(lambda: dp.TrainingPlan(tp=0), "TrainingPlan.tp", "0")
    assert re.search(r"\bgot 0\b", msg), msg


@pytest.mark.parametrize("field,value", [("recompute", "partial"), ("precision", "int4"),
                                         ("zero", "zero4")])
def test_training_plan_bad_name(field, value):
    _raises(lambda: dp.TrainingPlan(**{field: value}), f"TrainingPlan.{field}", repr(value))


@pytest.mark.parametrize("field,value", [("recompute", 3), ("zero", 4), ("precision", 7),
                                         ("sequence_parallel", 2), ("flash_attention", -1)])
def test_training_plan_bad_code(field, value):
    _raises(lambda: dp.TrainingPlan(**{field: value}), f"TrainingPlan.{field}", str(value))


def test_training_plan_names_become_codes():
    p = dp.TrainingPlan(recompute="Selective", precision="fp16")
    assert float(p.recompute) == 1 and float(p.precision) == 1
    assert float(dp.TrainingPlan(recompute="full", precision="fp8").recompute) == 2
    assert float(dp.TrainingPlan(precision="tf32").precision) == 0
    assert float(dp.TrainingPlan(zero="zero3").zero) == 3


@pytest.mark.parametrize("make,needle", [
    (lambda: dp.TrainingPlan(tp=None), "TrainingPlan.tp must be a number"),
    (lambda: dp.InferencePlan(batch="many"), "InferencePlan.batch must be a number"),
    (lambda: dp.Efficiency(hbm={"a": 1}), "Efficiency.hbm must be a number"),
    (lambda: dp.Transformer(layers=None, hidden=1, heads=1, kv_heads=1, ffn_hidden=1, vocab=1,
                            seq_len=1), "Transformer.layers must be a number"),
])
def test_a_value_that_is_not_a_number_names_its_field(make, needle):
    """Not a JAX conversion error from deep inside the library."""
    _raises(make, needle)


def test_predict_training_refuses_a_batch():
    plan = dp.TrainingPlan(tp=[8, 4], global_batch=64)
    _raises(lambda: dp.predict_training(dp.model("gpt3-175b"), dp.system("a100-sxm4-80gb"),
                                        plan), "takes one configuration", "jax.vmap")


def test_transformer_heads_must_divide_hidden():
    _raises(lambda: dp.Transformer(**{**GPT, "hidden": 100, "heads": 3, "kv_heads": 3,
                                      "ffn_hidden": 400}),
            "heads", "3", "hidden", "100")


def test_transformer_kv_heads_must_divide_heads():
    _raises(lambda: dp.Transformer(**{**GPT, "kv_heads": 7}), "kv_heads", "7", "96")


@pytest.mark.parametrize("field,value", [("layers", 0), ("vocab", 12.5), ("seq_len", -1)])
def test_transformer_bad_integer(field, value):
    _raises(lambda: dp.Transformer(**{**GPT, field: value}), f"Transformer.{field}", str(value))


def test_transformer_top_k_cannot_exceed_experts():
    _raises(lambda: dp.Transformer(**GPT, num_experts=8, experts_per_token=9),
            "experts_per_token", "9", "8")


@pytest.mark.parametrize("value", [2, 0.5, -1])
def test_transformer_parallel_attention_is_a_flag(value):
    _raises(lambda: dp.Transformer(**GPT, parallel_attention=value), "parallel_attention",
            str(value))


@pytest.mark.parametrize("field,value", [("hbm_bandwidth", 0.0), ("flops_bf16", -1.0),
                                         ("hbm_capacity", float("inf")), ("num_sms", 10.5),
                                         ("launch_overhead", -1e-6)])
def test_accelerator_bad_values(field, value):
    _raises(lambda: dp.Accelerator(**{**A100, field: value}), f"Accelerator.{field}")


@pytest.mark.parametrize("field,value", [("nvlink_bandwidth", 0.0), ("scaleout_latency", -1.0),
                                         ("nvlink_domain", 0)])
def test_network_bad_values(field, value):
    _raises(lambda: dp.Network(**{**NET, field: value}), f"Network.{field}")


@pytest.mark.parametrize("field,value", [("matmul_peak", 1.2), ("hbm", 0.0), ("tp_overlap", -0.1),
                                         ("matmul_size_scale", 0.0), ("memory_reserve", -1.0)])
def test_efficiency_bad_values(field, value):
    _raises(lambda: dp.Efficiency(**{field: value}), f"Efficiency.{field}")


@pytest.mark.parametrize("field,value", [("context_pass", 2), ("context_pass", 0.5),
                                         ("kv_cache_tokens", -1.0),
                                         ("kv_cache_tokens", float("nan"))])
def test_engine_bad_values(field, value):
    from diffperf.specs import Engine
    _raises(lambda: Engine(**{field: value}), f"Engine.{field}")


def test_unknown_preset_names_are_listed():
    _raises(lambda: dp.gpu("a100-pcie"), "a100-pcie", "a100-sxm4-80gb")
    _raises(lambda: dp.model("gpt-5"), "gpt-5", "gpt3-175b")


def test_precision_code():
    assert dp.precision_code("BF16") == 1 and dp.precision_code("fp4") == 3
    _raises(lambda: dp.precision_code("fp6"), "fp6")


def test_leaves_are_float_arrays_and_specs_accept_batches():
    p = dp.TrainingPlan(tp=jnp.array([1, 2, 4]))
    assert p.tp.dtype == jnp.result_type(float) and p.tp.shape == (3,)
    m = dp.model("gpt3-175b")
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(m))
    # a batch with one bad element is still rejected, naming it
    _raises(lambda: dp.TrainingPlan(tp=jnp.array([1.0, 0.0, 4.0])), "TrainingPlan.tp", "0")


def test_presets_are_self_consistent():
    for name in dp.model_names():
        m = dp.model(name)
        assert float(m.hidden) % float(m.heads) == 0, name
    for name in dp.gpu_names():
        g = dp.gpu(name)
        # tensor cores: bf16 rate is twice the tf32/fp32-tensor rate on A100 and later, and
        # fp8 (when present) twice bf16
        if float(g.flops_fp8) > 0:
            assert float(g.flops_fp8) == pytest.approx(2 * float(g.flops_bf16), rel=0.02), name
    for name in dp.system_names():
        s = dp.system(name)
        # NVLink is faster per GPU than the scale-out NIC on every shipped system
        assert float(s.network.nvlink_bandwidth) > float(s.network.scaleout_bandwidth), name


def test_a_gpu_id_gives_that_gpu_in_its_default_system():
    """`system("a100-sxm4-40gb")` is the 40 GB A100 in DGX A100's network, although the DGX A100
    preset lists the 80 GB part: a GPU id never swaps the GPU for another."""
    for name in dp.gpu_names():
        s, g = dp.system(name), dp.gpu(name)
        for field in ("hbm_capacity", "hbm_bandwidth", "flops_bf16", "host_memory"):
            assert float(getattr(s.accelerator, field)) == float(getattr(g, field)), (name, field)
    # NVML's totals: 40,960 and 81,920 MiB (the "40 GB" and "80 GB" labels are GiB)
    assert float(dp.system("a100-sxm4-40gb").accelerator.hbm_capacity) == 40960 * 2**20
    assert float(dp.system("dgx-a100").accelerator.hbm_capacity) == 81920 * 2**20


def test_specs_built_while_tracing_leak_no_tracers():
    """`as_float` reuses the arrays of Python numbers it converted before; one built inside a
    trace is a tracer and must never be reused outside it."""
    from diffperf.internal import as_float

    @jax.jit
    def scaled(y):
        return y * dp.Accelerator(flops_fp32=1.0, flops_bf16=2.0, flops_fp8=0.0, flops_fp4=0.0,
                                  vector_flops=1.0, hbm_capacity=1.0, hbm_bandwidth=1.0,
                                  l2_capacity=1.0, l2_bandwidth=1.0, num_sms=1.0,
                                  launch_overhead=0.0, host_bandwidth=987.654e9).host_bandwidth

    assert float(scaled(2.0)) == pytest.approx(2 * 987.654e9, rel=1e-6)
    a = as_float(987.654e9)  # first converted inside the trace above
    assert not isinstance(a, jax.core.Tracer)
    assert float(a + 1.0) == pytest.approx(987.654e9 + 1.0, rel=1e-6)


@pytest.mark.parametrize("name, total_b, active_b, tol", [
    ("deepseek-v3", 671, None, 0.005),
    ("qwen3-30b-a3b", 30.5, 3.3, 0.02),       # model card: 30.5 B, 3.3 B activated
    ("qwen3-235b-a22b", 235, 22, 0.02),       # 235 B, 22 B activated
    ("gpt-oss-120b", 116.8, 5.1, 0.01),       # 116.8 B, 5.1 B active (unembedding only)
    ("gpt-oss-20b", 20.9, 3.6, 0.01),         # 20.9 B, 3.6 B active
])
def test_moe_presets_match_published_parameter_counts(name, total_b, active_b, tol):
    """Total parameters of the MoE presets as their model cards print them, and the active
    ones: the routed top-k experts of every layer plus attention, norms and router, with both
    embedding tables for Qwen3 and only the unembedding for gpt-oss (OpenAI's convention)."""
    m = dp.model(name)
    assert abs(float(m.num_params()) / 1e9 / total_b - 1) < tol
    if active_b is not None:
        embed = float(m.vocab * m.hidden) / 1e9
        tables = 2 if name.startswith("qwen3") else 1
        active = float(m.active_layer_params() * m.layers) / 1e9 + tables * embed
        assert abs(active / active_b - 1) < 0.03, active
