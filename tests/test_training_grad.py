"""Differentiability of the training model.

- float32, in process: `jax.grad` of step_time w.r.t. every float leaf of Accelerator, Network
  and Efficiency is finite for a spread of plans (incl. infeasible ones), with physical signs.
- float64, in a subprocess (x64 is global JAX state, so it must not leak into the other
  tests): reverse-mode gradients match central finite differences.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import numpy as np
import pytest

import diffperf as dp
from diffperf.validation import stack


def _step_time(hw, model, plan):
    acc, net, eff = hw
    return dp.train_step(model, dp.System(acc, net), plan, eff).step_time


PLANS = [
    dict(tp=8, pp=2, dp=2, global_batch=16, vp=2, sequence_parallel=1, recompute="selective"),
    dict(tp=8, pp=1, dp=1, global_batch=4, micro_batch=4, recompute="full", zero=0,
         flash_attention=0),
    dict(tp=4, pp=4, dp=4, global_batch=64, micro_batch=2, recompute="none", zero=3),
    dict(tp=2, pp=8, dp=2, global_batch=32, sequence_parallel=1, zero=2, overlap_tp=0),
    dict(tp=1, pp=1, dp=16, global_batch=64, zero=1, overlap_dp=0, flash_attention=0),
    dict(tp=16, pp=1, dp=4, global_batch=64, sequence_parallel=1),        # tp spans 2 domains
    dict(tp=8, pp=1, dp=2, cp=2, global_batch=16, sequence_parallel=1),   # context parallel
    dict(tp=8, pp=2, dp=1, global_batch=16, precision="fp8"),            # infeasible on A100
    dict(tp=5, pp=2, dp=1, global_batch=16),                             # infeasible: heads
    dict(tp=1, pp=1, dp=1, global_batch=64),                             # infeasible: memory
]


@pytest.fixture(scope="module")
def batched_grads(gpt22b, dgx_a100, eff):
    hw = (dgx_a100.accelerator, dgx_a100.network, eff)
    fn = eqx.filter_jit(jax.grad(_step_time))  # compiled once: every plan has scalar leaves
    return stack([jax.device_get(fn(hw, gpt22b, dp.TrainingPlan(**p))) for p in PLANS])


def _leaves_by_name(grads):
    acc, net, eff = grads
    out = {}
    for prefix, mod in (("accelerator", acc), ("network", net), ("efficiency", eff)):
        for name in mod.__dataclass_fields__:
            out[f"{prefix}.{name}"] = np.asarray(getattr(mod, name))
    return out


@pytest.mark.slow
def test_every_hardware_and_efficiency_gradient_is_finite(batched_grads):
    leaves = _leaves_by_name(batched_grads)
    # Accelerator (incl. host_bandwidth, host_memory, host_memory_bandwidth, host_time_factor
    # and sfu_ratio: their gradients are 0 in training), Network (incl. the nvlink_sharp flag),
    # Efficiency (incl. prefill_attention: 0 in training).
    assert len(leaves) == 16 + 6 + 21
    for name, g in leaves.items():
        assert g.shape == (len(PLANS),), name
        assert np.all(np.isfinite(g)), (name, g)


@pytest.mark.slow
def test_gradient_signs_are_physical(batched_grads):
    g = _leaves_by_name(batched_grads)
    feasible = slice(0, 7)
    # faster resources never slow a step; bigger overheads never speed it up
    for name in ("accelerator.flops_bf16", "accelerator.hbm_bandwidth",
                 "network.nvlink_bandwidth", "network.scaleout_bandwidth",
                 "efficiency.matmul_peak", "efficiency.hbm", "efficiency.nvlink",
                 "efficiency.scaleout", "efficiency.attention"):
        assert np.all(g[name][feasible] <= 0), (name, g[name])
    for name in ("accelerator.launch_overhead", "efficiency.kernel_overhead",
                 "efficiency.collective_overhead", "network.nvlink_latency",
                 "network.scaleout_latency", "efficiency.matmul_size_scale"):
        assert np.all(g[name][feasible] >= 0), (name, g[name])
    # bf16 compute speed and kernel overhead always matter for a bf16 training step
    assert np.all(g["accelerator.flops_bf16"][feasible] < 0)
    assert np.all(g["accelerator.launch_overhead"][feasible] > 0)
    # memory capacity and the memory reserve change feasibility, never the time of a step
    for name in ("accelerator.hbm_capacity", "efficiency.memory_reserve"):
        assert np.all(g[name] == 0), (name, g[name])
    # fp8 / fp4 peaks are irrelevant to a bf16 plan
    for name in ("accelerator.flops_fp8", "accelerator.flops_fp4"):
        assert np.all(g[name][feasible] == 0), (name, g[name])


@pytest.mark.slow
def test_inter_node_bandwidth_matters_only_when_a_group_leaves_the_node(batched_grads):
    g = _leaves_by_name(batched_grads)["network.scaleout_bandwidth"]
    # plan 1 (tp=8 on one 8-GPU node, no dp/pp) never touches the scale-out fabric
    assert g[1] == 0
    # plan 0 has dp (stride 8) and pp across nodes
    assert g[0] < 0


# --------------------------------------------------------------------------------------------
# float64 finite-difference check (subprocess)
# --------------------------------------------------------------------------------------------

_FD_SCRIPT = textwrap.dedent(r"""
    import json
    import jax
    jax.config.update("jax_enable_x64", True)
    import equinox as eqx
    import jax.numpy as jnp
    import diffperf as dp

    model = dp.model("gpt-22b")
    system = dp.system("dgx-a100")
    eff = dp.Efficiency()
    plan = dp.TrainingPlan(tp=8, pp=2, dp=2, global_batch=16, vp=2, sequence_parallel=1,
                           recompute="selective", zero=1)
    assert system.accelerator.hbm_bandwidth.dtype == jnp.float64

    def f(hw):
        acc, net, e = hw
        return dp.train_step(model, dp.System(acc, net), plan, e).step_time

    hw = (system.accelerator, system.network, eff)
    value_and_grad = jax.jit(jax.value_and_grad(f))  # one compilation serves both
    step, grads = value_and_grad(hw)

    def f_jit(hw):
        return value_and_grad(hw)[0]

    leaves = [
        (0, "flops_bf16"), (0, "hbm_bandwidth"), (0, "vector_flops"), (0, "launch_overhead"),
        (0, "l2_bandwidth"),
        (1, "nvlink_bandwidth"), (1, "scaleout_bandwidth"), (1, "scaleout_latency"),
        (1, "nvlink_latency"),
        (2, "matmul_peak"), (2, "matmul_size_scale"), (2, "attention"), (2, "tp_overlap"),
        (2, "dp_overlap"), (2, "collective_overhead"), (2, "hbm"), (2, "scaleout"),
    ]
    out = {"step": float(step), "rows": []}
    for i, name in leaves:
        x = float(getattr(hw[i], name))
        h = 1e-6 * abs(x)

        def at(v):
            mod = eqx.tree_at(lambda m: getattr(m, name), hw[i], jnp.asarray(v, jnp.float64))
            new = list(hw)
            new[i] = mod
            return float(f_jit(tuple(new)))

        fd = (at(x + h) - at(x - h)) / (2 * h)
        out["rows"].append({"leaf": name, "x": x, "grad": float(getattr(grads[i], name)),
                            "fd": fd})
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def fd_result():
    proc = subprocess.run([sys.executable, "-c", _FD_SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_grad_matches_central_finite_differences_float64(fd_result):
    step = fd_result["step"]
    assert np.isfinite(step) and step > 0
    bad = []
    nonzero = 0
    for r in fd_result["rows"]:
        g, fd, x = r["grad"], r["fd"], r["x"]
        # tolerance: relative to the derivative, with a floor at 1e-9 of the step-time
        # sensitivity scale (step / x) for leaves the step hardly depends on
        tol = 1e-4 * abs(fd) + 1e-9 * step / abs(x)
        if not abs(g - fd) <= tol:
            bad.append(r)
        if abs(fd) > 1e-6 * step / abs(x):
            nonzero += 1
    assert not bad, bad
    # the check is not vacuous: most of these leaves move the step time
    assert nonzero >= 12, fd_result["rows"]
