"""Elasticities from jax.grad match central finite differences (float64, in a subprocess)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, equinox as eqx
    import diffperf as dp
    from diffperf.internal import sensitivity as S
    from diffperf.presets import model, system
    from diffperf.specs import TrainingPlan
    from diffperf.specs import InferencePlan
    out = {}
    sys_ = system("dgx-a100")
    plan = TrainingPlan(tp=8, pp=8, dp=16, micro_batch=1, global_batch=1536, vp=3,
                        sequence_parallel=1, recompute=1)
    cases = {"train": S.workload_time("train", model("gpt3-175b"), plan),
             "infer": S.workload_time("infer", model("llama2-70b"), S.default_inference_plan())}
    leaves = {"accelerator.flops_bf16": lambda s: s.accelerator.flops_bf16,
              "accelerator.hbm_bandwidth": lambda s: s.accelerator.hbm_bandwidth,
              "accelerator.vector_flops": lambda s: s.accelerator.vector_flops,
              "accelerator.launch_overhead": lambda s: s.accelerator.launch_overhead,
              "network.nvlink_bandwidth": lambda s: s.network.nvlink_bandwidth,
              "network.scaleout_bandwidth": lambda s: s.network.scaleout_bandwidth,
              "network.nvlink_latency": lambda s: s.network.nvlink_latency}
    h = 1e-5
    for name, fn in cases.items():
        v, el = S.hardware_elasticities(fn, sys_)
        for leaf, get in leaves.items():
            up = eqx.tree_at(get, sys_, get(sys_) * jnp.exp(h))
            dn = eqx.tree_at(get, sys_, get(sys_) * jnp.exp(-h))
            fd = float((jnp.log(fn(up)) - jnp.log(fn(dn))) / (2 * h))
            out[f"{name}:{leaf}"] = [el[leaf], fd]
    # technology elasticities through the generator
    fn = cases["infer"]
    v, el = S.technology_elasticities(fn, "a100")
    from diffperf.internal import technology as T
    tech, design, arch = T.reference_point("a100")
    archp = T.architecture(arch)
    def t_of(tech_):
        g = T.generate(tech_, design, archp)
        return fn(dp.System(g.accelerator, g.network))
    for leaf in ("hbm_bw", "logic_density", "energy_per_flop", "lane_rate"):
        get = lambda t, leaf=leaf: getattr(t, leaf)
        up = eqx.tree_at(get, tech, get(tech) * jnp.exp(h))
        dn = eqx.tree_at(get, tech, get(tech) * jnp.exp(-h))
        fd = float((jnp.log(t_of(up)) - jnp.log(t_of(dn))) / (2 * h))
        out[f"tech:{leaf}"] = [el[f"tech.{leaf}"], fd]
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_elasticities_match_finite_differences_in_float64():
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(out) == 18
    for key, (ad, fd) in out.items():
        assert abs(ad - fd) <= 1e-4 + 1e-3 * abs(fd), (key, ad, fd)


def test_bottleneck_shares_sum_to_one():
    from diffperf.internal import sensitivity as S
    el = {"accelerator.flops_bf16": -0.6, "accelerator.hbm_bandwidth": -0.1,
          "network.nvlink_bandwidth": -0.2, "accelerator.launch_overhead": 0.1}
    b = S.bottlenecks(el)
    assert abs(sum(b.values()) - 1.0) < 1e-12
    assert abs(b["compute"] - 0.6) < 1e-12 and abs(b["latency/other"] - 0.1) < 1e-12


def test_whole_number_leaves_are_not_ranked():
    """The NVLink domain is a step: at TP 8 on an 8-GPU domain a larger domain changes nothing
    (9, 16 and 72 give the same latency), a smaller one is much slower. Its derivative is the
    slope of that kink, so it is left out of the ranking, as are num_sms and nvlink_sharp."""
    import equinox as eqx
    import jax.numpy as jnp

    from diffperf.internal import sensitivity as S
    from diffperf.presets import model, system
    sys_ = system("h100-sxm5-80gb")
    fn = S.workload_time("infer", model("llama2-70b"), S.default_inference_plan())
    _, el = S.hardware_elasticities(fn, sys_)
    assert not set(S.DISCRETE_LEAVES) & set(el)
    assert "accelerator.hbm_bandwidth" in el and "network.nvlink_latency" in el
    at = lambda d: float(fn(eqx.tree_at(lambda s: s.network.nvlink_domain, sys_,  # noqa: E731
                                        jnp.asarray(d, float))))
    assert at(9) == at(16) == at(72) == at(8)
    assert at(4) > 1.1 * at(8)
