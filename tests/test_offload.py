"""Weights and optimizer states in host memory (ZeRO-Offload, ZeRO-Infinity): memory and step
time checked by hand, the search covering them, monotonicity, vmap and the command line.

The hand numbers use GPT 7.5B (Narayanan et al. 2021: 36 layers, h = 4096, f = 4h, V = 51,200,
tied embeddings) on DGX A100 (A100-80GB: PCIe Gen4 host link 32 GB/s per direction, host DRAM
2 x 8 channels of DDR4-3200 = 409.6 GB/s / 8 GPUs = 51.2 GB/s, 2 TB / 8 = 256 GB of host memory).
"""

from __future__ import annotations

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffperf as dp
from diffperf.costs._roofline import exposed_after_overlap
from diffperf.explore._grid import Grid
from diffperf.explore._search_training import search_training
from diffperf.training._layer import layer_costs
from diffperf.training._offload import CPU_ADAM_SHARE, offload_traffic
from diffperf.training._terms import free_compute_share

H, L, V = 4096, 36, 51200
#: Parameters of GPT 7.5B by hand, as the model counts them: per layer 4 h^2 of attention and
#: 8 h^2 of MLP weights, 2 h of biases and 4 h of layer norms (12 h^2 + 6 h), plus one tied
#: V x h embedding table.
P = L * (12 * H * H + 6 * H) + V * H
HOST_LINK, HOST_DRAM = 32e9, 51.2e9
K = 0.1  # diffperf.costs._roofline.SHARPNESS


def smooth_max(a, b):
    """The documented smooth maximum (a + b + sqrt((a - b)^2 + (k (a + b))^2)) / 2."""
    return 0.5 * (a + b + np.sqrt((a - b) ** 2 + (K * (a + b)) ** 2))


@pytest.fixture(scope="module")
def gpt7b():
    return dp.model("gpt-7.5b")


def _plan(**kw):
    base = dict(tp=1, pp=1, dp=1, micro_batch=1, global_batch=8, recompute="full", zero=2,
                fp32_gradients=0)
    return dp.TrainingPlan(**(base | kw))


def test_parameter_count_by_hand(gpt7b):
    from diffperf.training._memory import params_per_gpu
    assert float(params_per_gpu(gpt7b, _plan())) == pytest.approx(P, rel=1e-6)
    assert P == 7_458_357_248


def test_zero_offload_memory_by_hand(step, gpt7b, dgx_a100, eff):
    """ZeRO-Offload on one A100: 16-bit weights stay (2 P B), the fp16 gradients of the
    offloaded shard go to the host (ZeRO-2 keeps none of them), the optimizer states and an
    fp32 gradient copy live in host memory (12 + 4 B per parameter). Without it the 16 P B of
    weights, gradients and states do not fit in 80 GB."""
    r = step(gpt7b, dgx_a100, _plan(offload_optimizer=1), eff)
    m = r.memory
    np.testing.assert_allclose(float(m.weights), 2 * P, rtol=1e-6)
    assert float(m.gradients) == 0.0 and float(m.optimizer) == 0.0
    np.testing.assert_allclose(float(m.host_optimizer), 16 * P, rtol=1e-6)
    np.testing.assert_allclose(float(m.host), 16 * P, rtol=1e-6)
    assert float(m.host_weights) == 0.0 and float(m.host_activations) == 0.0
    assert int(r.reason) == 0
    on_gpu = step(gpt7b, dgx_a100, _plan(), eff)
    np.testing.assert_allclose(float(on_gpu.memory.optimizer), 12 * P, rtol=1e-6)
    np.testing.assert_allclose(float(on_gpu.memory.gradients), 2 * P, rtol=1e-6)
    assert int(on_gpu.reason) == 10 and float(on_gpu.memory.host) == 0.0


def test_zero_offload_step_time_by_hand(step, gpt7b, dgx_a100, eff):
    """The optimizer step is the smooth maximum of the GPU's part and the host streams: CPU
    Adam streams 2 x 12 + 2 + 2 = 28 B per parameter at half the host DRAM bandwidth, the
    updated 16-bit weights come back over the host link (2 P B), and ZeRO-2's gradients went
    to the host during the backward passes (not in the optimizer). The GPU's own part only
    zeroes the 2 P B gradient buffer (6 launches): under 50 ms on an A100."""
    plan = _plan(offload_optimizer=1)
    r = step(gpt7b, dgx_a100, plan, eff)
    cpu = 28 * P / (CPU_ADAM_SHARE * HOST_DRAM)
    to_gpu = 2 * P / HOST_LINK
    assert cpu == pytest.approx(8.158, rel=1e-3)  # 28 x 7.46e9 / 25.6e9
    low = smooth_max(smooth_max(0.0, cpu), smooth_max(0.0, to_gpu))
    high = smooth_max(smooth_max(0.05, cpu), smooth_max(0.0, to_gpu))
    assert low <= float(r.optimizer_time) * (1 + 1e-6) and float(r.optimizer_time) <= high
    # Gradient copies: per micro-batch 2 P B over the host link, spread over the 36 layers'
    # backward passes, each hidden by the backward compute the layer left free.
    layer = layer_costs(gpt7b, plan, dgx_a100, eff)
    c = 2 * P / HOST_LINK / L
    free = free_compute_share(layer)
    expected = 8 * L * float(exposed_after_overlap(c, free * layer.backward))
    np.testing.assert_allclose(float(r.offload_time), expected, rtol=1e-5)
    assert 0 < expected < 8 * L * c
    # Nothing else changed: the step is the GPU's step with these two terms swapped in.
    base = step(gpt7b, dgx_a100, _plan(), eff)
    np.testing.assert_allclose(float(r.compute_time), float(base.compute_time), rtol=1e-6)
    np.testing.assert_allclose(
        float(r.step_time) - float(r.optimizer_time) - float(r.offload_time),
        float(base.step_time) - float(base.optimizer_time) - float(base.offload_time),
        rtol=1e-5)


def test_zero_infinity_weights_and_states_by_hand(step, gpt7b, eff):
    """ZeRO-3 over 8 GPUs with the weights and the optimizer in host memory: each GPU keeps
    its shard P / 8 in host memory (2 B weights + 16 B states and gradient copy), two layers'
    worth of weights in HBM, and copies its weight shard in before each layer's forward and
    backward pass: 2 passes x 8 micro-batches x 2 P / 8 B per step. The CPU updates the host
    copy in place: nothing goes back after the step."""
    system = dp.system("dgx-a100")
    plan = _plan(dp=8, global_batch=64, zero=3, recompute="selective", offload_optimizer=1,
                 offload_weights=1)
    r = step(gpt7b, system, plan, eff)
    shard = P / 8
    m = r.memory
    np.testing.assert_allclose(float(m.weights), 2 / L * 2 * shard, rtol=1e-5)
    np.testing.assert_allclose(float(m.host_weights), 2 * shard, rtol=1e-5)
    np.testing.assert_allclose(float(m.host_optimizer), 16 * shard, rtol=1e-5)
    assert float(m.optimizer) == 0.0 and float(m.gradients) == 0.0
    layer = layer_costs(gpt7b, plan, system, eff)
    t = offload_traffic(gpt7b, plan, system.accelerator, layer)
    np.testing.assert_allclose(float(t["weights_bytes_per_step"]), 8 * 2 * 2 * shard, rtol=1e-5)
    assert float(t["to_gpu_s"]) == 0.0 and float(t["to_host_s"]) == 0.0
    np.testing.assert_allclose(float(t["cpu_adam_s"]), 28 * shard / (0.5 * HOST_DRAM),
                               rtol=1e-5)
    # Weights only (optimizer on the GPU): the updated shard goes back after the step.
    w_only = eqx.tree_at(lambda p: p.offload_optimizer, plan, jnp.float32(0))
    t = offload_traffic(gpt7b, w_only, system.accelerator,
                        layer_costs(gpt7b, w_only, system, eff))
    np.testing.assert_allclose(float(t["to_host_s"]), 2 * shard / HOST_LINK, rtol=1e-5)
    np.testing.assert_allclose(float(step(gpt7b, system, w_only, eff).memory.optimizer),
                               12 * shard, rtol=1e-5)


def test_partial_optimizer_offload(step, gpt7b, eff):
    """Megatron-core's --optimizer-offload-fraction 0.25 with the distributed optimizer: a
    quarter of the 12 B states (+ 4 B gradient copy) per shard parameter on the host; the
    rest of the states and the whole 16-bit gradient buffer (ZeRO-1 keeps it) on the GPU."""
    system = dp.system("dgx-a100")
    plan = _plan(dp=8, global_batch=64, zero=1, offload_optimizer=0.25)
    m = step(gpt7b, system, plan, eff).memory
    shard = P / 8
    np.testing.assert_allclose(float(m.optimizer), 0.75 * 12 * shard, rtol=1e-5)
    np.testing.assert_allclose(float(m.host_optimizer), 0.25 * 16 * shard, rtol=1e-5)
    np.testing.assert_allclose(float(m.gradients), 2 * P, rtol=1e-5)


def test_host_memory_bounds_the_offload(step, gpt7b, eff):
    """16 P B of offloaded states do not fit in 64 GB of host memory: reason 12."""
    small = eqx.tree_at(lambda s: s.accelerator.host_memory, dp.system("dgx-a100"),
                        jnp.float32(64e9))
    r = step(gpt7b, small, _plan(offload_optimizer=1), eff)
    assert int(r.reason) == 12 and bool(r.fits)


def test_faster_host_is_never_slower_and_vmap_equals_loop(step, gpt7b, eff):
    """More host-link or host-DRAM bandwidth never slows an offloading step; vmap over the
    offloaded share equals a loop."""
    system = dp.system("dgx-a100")
    plan = _plan(offload_optimizer=1, offload_weights=1, zero=3)

    @jax.jit  # one program for both sweeps
    @jax.vmap
    def step_time(link, dram):
        s = eqx.tree_at(lambda x: (x.accelerator.host_bandwidth,
                                   x.accelerator.host_memory_bandwidth), system, (link, dram))
        return dp.train_step(gpt7b, s, plan, eff).step_time

    scale = jnp.geomspace(0.25, 8.0, 12, dtype=jnp.float32)
    link, dram = jnp.full_like(scale, HOST_LINK), jnp.full_like(scale, HOST_DRAM)
    by_link = np.asarray(step_time(scale * HOST_LINK, dram))
    by_dram = np.asarray(step_time(link, scale * HOST_DRAM))
    assert np.all(np.diff(by_link) <= 1e-6 * by_link[:-1])
    assert np.all(np.diff(by_dram) <= 1e-6 * by_dram[:-1])
    assert by_link[0] > 1.5 * by_link[-1] and by_dram[0] > 1.5 * by_dram[-1]

    shares = jnp.asarray([0.0, 0.25, 0.5, 1.0], dtype=jnp.float32)
    base = _plan(zero=2, dp=8, global_batch=64)
    f = lambda s: dp.train_step(gpt7b, system,  # noqa: E731
                                eqx.tree_at(lambda p: p.offload_optimizer, base, s), eff)
    batched = np.asarray(jax.jit(jax.vmap(f))(shares).step_time)
    # the loop: the session's compiled train_step, one share at a time
    looped = np.asarray([step(gpt7b, system, eqx.tree_at(lambda p: p.offload_optimizer, base, s),
                              eff).step_time for s in shares])
    np.testing.assert_allclose(batched, looped, rtol=1e-6)


def test_gradient_of_host_bandwidths_matches_finite_differences(gpt7b, eff):
    """d step / d host_memory_bandwidth where CPU Adam binds: the automatic derivative against a
    central difference (float32, 1 % steps)."""
    system = dp.system("dgx-a100")
    plan = _plan(offload_optimizer=1)

    def step_time(dram):
        s = eqx.tree_at(lambda x: x.accelerator.host_memory_bandwidth, system, dram)
        return dp.train_step(gpt7b, s, plan, eff).step_time

    x = jnp.float32(HOST_DRAM)
    g = float(jax.jit(jax.grad(step_time))(x))
    h = 0.01 * HOST_DRAM
    fd = (float(step_time(x + h)) - float(step_time(x - h))) / (2 * h)
    assert g < 0 and g == pytest.approx(fd, rel=0.02)


@pytest.mark.slow
def test_search_finds_the_offload_plan(gpt7b, eff):
    """GPT 7.5B on one A100-80GB: no plan fits without offloading; with the optimizer in host
    memory the search finds one, and ranks it (ZeRO >= 1 as its software needs)."""
    system = dp.system("dgx-a100")
    axes = {"micro_batch": [1, 2], "recompute": [0, 2], "zero": [0, 1, 2, 3],
            "offload_optimizer": [0, 1], "offload_weights": [0, 1]}
    res = search_training(gpt7b, system, 1, 8, grid=Grid(axes), efficiency=eff, top_k=5,
                          progress=False)
    top = res["top"]
    assert len(top) > 0 and (top["offload_optimizer"] == 1).all()
    assert (top["zero"] >= 1).all()
    no_offload = search_training(gpt7b, system, 1, 8, efficiency=eff, top_k=1, progress=False,
                                 grid=Grid(axes | {"offload_optimizer": [0],
                                                   "offload_weights": [0]}))
    assert no_offload["feasible"] == 0


@pytest.mark.slow
def test_cli_train_reports_the_offload(capsys):
    from diffperf.cli._main import main
    args = ["train", "--model", "gpt-7.5b", "--gpu", "a100-sxm4-80gb", "--gpus", "1", "--tp",
            "1", "--pp", "1", "--global-batch", "8", "--zero", "2", "--no-fp32-gradients",
            "--recompute", "full", "--offload-optimizer", "1"]
    assert main(args + ["--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["feasible"] and s["memory_gb"]["optimizer"] == 0.0
    assert s["memory_gb"]["host_optimizer"] == pytest.approx(16 * P / 1e9, rel=1e-5)
    assert s["offload"]["cpu_adam_s"] == pytest.approx(28 * P / 25.6e9, rel=1e-4)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "offloaded: optimizer 119.3" in out and "CPU optimizer" in out
    assert main(args[:-1] + ["1.5"]) == 2
    assert "--offload-optimizer must lie in [0, 1], got 1.5" in capsys.readouterr().err
