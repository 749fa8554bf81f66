"""Gradients of inference latency vs central finite differences in float64 (in a subprocess,
so that enabling x64 does not leak into other tests)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import jax
    jax.config.update("jax_enable_x64", True)
    import equinox as eqx, jax.numpy as jnp, numpy as np
    from diffperf.specs import Efficiency
    from diffperf.inference import infer
    from diffperf.specs import InferencePlan
    from diffperf.presets import model, system

    # One MoE case (covers the dense terms too); each case costs ~10 s of compilation.
    cases = [("mixtral-8x7b", "h100-sxm5-80gb", dict(tp=2, batch=8, input_len=1024,
                                                    output_len=300, kv_precision="fp8"))]
    names = ["hbm_bandwidth", "flops_bf16", "launch_overhead"]
    for mname, gpu, kw in cases:
        m, s, plan = model(mname), system(gpu), InferencePlan(**kw)
        eff = Efficiency()
        assert s.accelerator.hbm_bandwidth.dtype == jnp.float64

        def f(x):
            acc = eqx.tree_at(lambda a: [getattr(a, n) for n in names], s.accelerator, list(x[:3]))
            sy = eqx.tree_at(lambda t: (t.accelerator, t.network.nvlink_latency), s,
                             (acc, x[3]))
            e = eqx.tree_at(lambda e: (e.hbm, e.kernel_overhead, e.matmul_size_scale), eff,
                            (x[4], x[5], x[6]))
            pl = eqx.tree_at(lambda p: p.batch, plan, x[7])
            r = infer(m, sy, pl, e)
            return jnp.stack([r.ttft, r.tpot, r.e2e_latency])

        f = jax.jit(f)
        x0 = jnp.array([*(getattr(s.accelerator, n) for n in names), s.network.nvlink_latency,
                        eff.hbm, eff.kernel_overhead, eff.matmul_size_scale, plan.batch])
        jac = jax.jit(jax.jacrev(f))(x0)
        assert np.all(np.isfinite(jac)), jac
        for i in range(x0.size):
            h = 1e-6 * abs(float(x0[i]))
            dx = jnp.zeros_like(x0).at[i].set(h)
            fd = (f(x0 + dx) - f(x0 - dx)) / (2 * h)
            np.testing.assert_allclose(jac[:, i], fd, rtol=1e-5,
                                       atol=1e-9 * float(jnp.max(jnp.abs(fd))))
        # the physics signs
        assert jac[2, 0] < 0 and jac[2, 1] < 0 and jac[2, 2] > 0 and jac[2, 5] > 0
    print("ok")
""")


@pytest.mark.slow
def test_gradients_match_finite_differences():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
