"""The inference engines' tensor-parallel all-reduce (`diffperf.costs.engine_all_reduce`): the
one-shot / two-shot law by hand, NCCL's ring where it must be, monotonicity, gradients,
vmap, its error on NVIDIA's measured all-reduces, and what it does to an inference pass."""

from __future__ import annotations

import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffperf as dp
from diffperf.costs import all_reduce, engine_all_reduce
from diffperf.costs._engine_all_reduce import (
    ENGINE_ALL_REDUCE_LATENCY,
    ENGINE_ALL_REDUCE_LATENCY_PER_RANK,
    ONE_SHOT_BANDWIDTH,
    TWO_SHOT_BANDWIDTH,
)
from diffperf.inference import inference_ops

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "calibration"))

import allreduce_kernels  # noqa: E402

H100 = "h100-sxm5-80gb"


def _net_eff(gpu=H100):
    return dp.system(gpu).network, dp.default_efficiency(gpu)


def test_the_law_by_hand():
    """t = smooth min over one-shot A + (n-1) S / (f1 B), two-shot 2A + 2 (n-1)/n S / (f2 B)
    and NCCL's ring, p = 32, with A = 3.74 + 0.20 (n - 2) us and B the ring's NVLink
    bandwidth; written out here with numbers, not the module's code."""
    net, eff = _net_eff()
    b = 450e9 * float(eff.nvlink)
    assert float(net.nvlink_bandwidth) == pytest.approx(450e9)
    for n, size in ((8, 16384.0), (4, 1 << 20), (2, 8 << 20)):
        a = 3.74e-6 + 0.20e-6 * (n - 2)
        one = a + (n - 1) * size / (0.68 * b)
        two = 2 * a + 2 * (n - 1) / n * size / (0.56 * b)
        ring = float(all_reduce(net, eff, size, n))
        expect = (one ** -32 + two ** -32 + ring ** -32) ** (-1 / 32)
        got = float(engine_all_reduce(net, eff, size, n))
        assert got == pytest.approx(expect, rel=1e-4)
        assert got <= min(one, two, ring) * (1 + 1e-6)
    assert ENGINE_ALL_REDUCE_LATENCY == 3.74e-6 and ENGINE_ALL_REDUCE_LATENCY_PER_RANK == 0.20e-6
    assert (ONE_SHOT_BANDWIDTH, TWO_SHOT_BANDWIDTH) == (0.68, 0.56)
    # a 16-KB all-reduce over 8 H100s: about 5 us, where NCCL's ring takes about 20
    assert 4e-6 < float(engine_all_reduce(net, eff, 16384.0, 8)) < 6e-6
    assert float(all_reduce(net, eff, 16384.0, 8)) > 15e-6


def test_nccl_where_the_engine_kernels_cannot_run():
    """custom = 0 is NCCL's ring exactly; a group of one costs 0; a group larger than the NVLink
    domain runs NCCL's hierarchical ring whatever `custom` says; a share in between mixes."""
    net, eff = _net_eff()
    for size in (2048.0, 1 << 20, 64 << 20):
        ring = float(all_reduce(net, eff, size, 8))
        assert float(engine_all_reduce(net, eff, size, 8, 0.0)) == ring
        half = float(engine_all_reduce(net, eff, size, 8, 0.5))
        full = float(engine_all_reduce(net, eff, size, 8, 1.0))
        assert half == pytest.approx(0.5 * (ring + full), rel=1e-5)
        assert float(engine_all_reduce(net, eff, size, 16)) == pytest.approx(
            float(all_reduce(net, eff, size, 16)), rel=1e-6)
    assert float(engine_all_reduce(net, eff, 1e6, 1)) == 0.0
    # a 72-GPU NVLink domain: groups above 8 GPUs (beyond the engines' kernels) keep the ring
    nvl72, eff72 = dp.system("gb200-nvl72").network, dp.default_efficiency("gb200")
    assert float(nvl72.nvlink_domain) == 72
    for n in (16, 72):
        assert float(engine_all_reduce(nvl72, eff72, 16384.0, n)) == float(
            all_reduce(nvl72, eff72, 16384.0, n))
    assert float(engine_all_reduce(nvl72, eff72, 16384.0, 8)) < 0.5 * float(
        all_reduce(nvl72, eff72, 16384.0, 8))
    # gradients stay finite for a group of one and an empty message
    g = jax.grad(lambda s, n: engine_all_reduce(net, eff, s, n), argnums=(0, 1))
    for s, n in ((1e6, 1.0), (0.0, 8.0), (0.0, 1.0)):
        assert all(np.isfinite(float(x)) for x in g(s, n))


def test_more_bytes_never_faster_more_bandwidth_never_slower():
    net, eff = _net_eff()
    sizes = np.geomspace(256, 1 << 30, 60)
    for n in (2, 4, 8):
        t = np.array([float(engine_all_reduce(net, eff, s, n)) for s in sizes])
        assert np.all(np.diff(t) >= 0)
        faster = eqx.tree_at(lambda m: m.nvlink_bandwidth, net, 2 * net.nvlink_bandwidth)
        t2 = np.array([float(engine_all_reduce(faster, eff, s, n)) for s in sizes])
        assert np.all(t2 <= t * (1 + 1e-6))


def test_gradient_matches_finite_differences():
    net, eff = _net_eff()

    def f(log_size, bw):
        n2 = eqx.tree_at(lambda m: m.nvlink_bandwidth, net, bw)
        return jnp.log(engine_all_reduce(n2, eff, jnp.exp(log_size), 8.0))

    bw0 = float(net.nvlink_bandwidth)
    for size in (16384.0, float(1 << 21), float(1 << 25)):
        x = float(np.log(size))
        g = jax.grad(f, argnums=(0, 1))(x, bw0)
        h = 1e-3
        fd0 = (float(f(x + h, bw0)) - float(f(x - h, bw0))) / (2 * h)
        fd1 = (float(f(x, bw0 * (1 + h))) - float(f(x, bw0 * (1 - h)))) / (2 * h * bw0)
        assert float(g[0]) == pytest.approx(fd0, rel=2e-2, abs=1e-3)
        assert float(g[1]) == pytest.approx(fd1, rel=2e-2, abs=1e-16)
        assert float(g[0]) >= 0 and float(g[1]) <= 0


def test_vmap_equals_a_loop():
    net, eff = _net_eff()
    sizes = jnp.array([512.0, 65536.0, 4e6, 2e8])
    ns = jnp.array([2.0, 8.0, 4.0, 16.0])
    custom = jnp.array([1.0, 1.0, 0.3, 1.0])
    v = jax.vmap(lambda s, n, c: engine_all_reduce(net, eff, s, n, c))(sizes, ns, custom)
    loop = [float(engine_all_reduce(net, eff, s, n, c)) for s, n, c in zip(sizes, ns, custom)]
    np.testing.assert_allclose(np.asarray(v), loop, rtol=1e-6)


def test_error_on_the_engines_measured_all_reduces():
    """Against the 414 measured all-reduces (TensorRT-LLM, vLLM, SGLang on A100 / H100 / B200,
    2-8 GPUs, 256 B to 1 GB; `calibration/allreduce_kernels.py`): MAPE 19.4 % where NCCL's ring
    is 163 % off; up to 2 MB 23 % against 257 %; every engine, GPU and group size within 40 %."""
    rows = allreduce_kernels.read_rows()
    assert len(rows) == 414
    err = [abs(allreduce_kernels.model_us(r) / r["time_us"] - 1) for r in rows]
    ring = [abs(allreduce_kernels.model_us(r, 0.0) / r["time_us"] - 1) for r in rows]
    small = [e for e, r in zip(err, rows) if r["bytes"] <= 1 << 21]
    assert np.mean(err) < 0.22 and np.mean(small) < 0.26
    assert np.mean(ring) > 1.0
    groups: dict = {}
    for e, r in zip(err, rows):
        groups.setdefault((r["engine"], r["gpu"], r["num_gpus"]), []).append(e)
    assert len(groups) == 18
    assert max(np.mean(v) for v in groups.values()) < 0.40


def test_an_engine_runtime_makes_small_tp_all_reduces_cheaper():
    """Decode at batch 1 over 8 H100s: the engine's kernels cut the all-reduce time of a step
    several-fold; one GPU is unchanged; the engines' presets set the field, the calibration
    set's default and LMDeploy's do not."""
    model = dp.model("llama3-70b")
    plan = dp.InferencePlan(tp=8, batch=1, input_len=128, output_len=128)
    system = dp.system(H100)
    ops = {c: inference_ops(model, system, plan, runtime=eqx.tree_at(
        lambda r: r.custom_allreduce, dp.runtime("trtllm"), jnp.asarray(c)))
        for c in (0.0, 1.0)}
    nccl = float(ops[0.0]["decode"]["tp_allreduce"].network)
    engine = float(ops[1.0]["decode"]["tp_allreduce"].network)
    assert engine < nccl / 2.5
    one = dp.InferencePlan(tp=1, batch=1, input_len=128, output_len=128)
    a, b = (inference_ops(model, system, one, runtime=dp.runtime(r)) for r in ("megatron-core",
                                                                             "trtllm"))
    assert float(a["decode"]["tp_allreduce"].network) == float(
        b["decode"]["tp_allreduce"].network) == 0.0
    for name in ("trtllm", "trtllm-bench", "trtllm-engine", "vllm", "sglang",
                 "sglang-0.4-deepseek-eager"):
        assert float(dp.runtime(name).custom_allreduce) == 1.0
    for name in ("megatron-core", "pytorch-eager"):
        assert float(dp.runtime(name).custom_allreduce) == 0.0
