"""`jax.vmap(train_step)` over a batch of different configurations equals a Python loop."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest

import diffperf as dp
from diffperf.validation import stack

# 20 valid plans (every divisibility check holds for both models below); they differ in every
# categorical and integer knob of TrainingPlan.
PLANS = [
    dict(tp=1, pp=1, dp=8, micro_batch=1, global_batch=64, zero=0),
    dict(tp=2, pp=1, dp=4, micro_batch=2, global_batch=64, recompute="selective", zero=1),
    dict(tp=4, pp=2, dp=1, micro_batch=1, global_batch=16, recompute="full", zero=2),
    dict(tp=8, pp=1, dp=1, micro_batch=4, global_batch=16, sequence_parallel=1, zero=3),
    dict(tp=8, pp=2, dp=2, micro_batch=1, global_batch=32, vp=2, sequence_parallel=1),
    dict(tp=8, pp=4, dp=1, micro_batch=1, global_batch=32, vp=2, sequence_parallel=1,
         recompute="selective", flash_attention=0),
    dict(tp=4, pp=4, dp=2, micro_batch=2, global_batch=64, vp=4, recompute="full"),
    dict(tp=2, pp=8, dp=1, micro_batch=1, global_batch=64, sequence_parallel=1, zero=0),
    dict(tp=1, pp=4, dp=4, micro_batch=1, global_batch=64, recompute="selective", zero=3),
    dict(tp=8, pp=8, dp=1, micro_batch=1, global_batch=64, vp=2, sequence_parallel=1,
         recompute="full", flash_attention=0),
    dict(tp=4, pp=1, dp=16, micro_batch=1, global_batch=128, zero=1, overlap_dp=0),
    dict(tp=8, pp=2, dp=4, micro_batch=2, global_batch=128, overlap_tp=0),
    dict(tp=2, pp=2, dp=2, micro_batch=4, global_batch=32, recompute="selective",
         flash_attention=0, sequence_parallel=1),
    dict(tp=1, pp=2, dp=1, micro_batch=8, global_batch=64, recompute="full", zero=0),
    dict(tp=8, pp=1, dp=8, micro_batch=1, global_batch=64, sequence_parallel=1, zero=2),
    dict(tp=4, pp=8, dp=2, micro_batch=1, global_batch=128, vp=2, zero=3),
    dict(tp=16, pp=1, dp=2, micro_batch=1, global_batch=16, sequence_parallel=1),
    dict(tp=8, pp=1, dp=2, cp=2, micro_batch=1, global_batch=16, sequence_parallel=1),
    dict(tp=2, pp=4, dp=8, micro_batch=2, global_batch=256, recompute="selective", zero=1),
    dict(tp=1, pp=1, dp=1, micro_batch=2, global_batch=8, zero=0, flash_attention=0),
]
MODELS = ["gpt-22b", "llama2-7b"]
SYSTEMS = ["dgx-a100", "dgx-h100", "gb200-nvl72"]


@pytest.fixture(scope="module")
def batch():
    models = [dp.model(MODELS[i % 2]) for i in range(len(PLANS))]
    systems = [dp.system(SYSTEMS[i % 3]) for i in range(len(PLANS))]
    plans = [dp.TrainingPlan(**p) for p in PLANS]
    effs = [dp.Efficiency(tp_overlap=0.1 * (i % 5), hbm=0.8 + 0.005 * i)
            for i in range(len(PLANS))]
    return models, systems, plans, effs


def test_plans_are_valid(batch, step):
    for m, s, p, e in zip(*batch):
        assert int(step(m, s, p, e).reason) in (0, 10)


@pytest.mark.slow  # the fast set's vmap == loop check: test_feature_table (every feature, mixed)
def test_vmap_equals_python_loop(batch, step):
    models, systems, plans, effs = batch
    batched = jax.device_get(eqx.filter_jit(jax.vmap(dp.train_step))(
        stack(models), stack(systems), stack(plans), stack(effs)))
    n_checked = 0
    for i, args in enumerate(zip(models, systems, plans, effs)):
        single = jax.device_get(step(*args))
        flat_b, tree_b = jax.tree_util.tree_flatten(batched)
        flat_s, tree_s = jax.tree_util.tree_flatten(single)
        assert tree_b == tree_s
        for b, s in zip(flat_b, flat_s):
            np.testing.assert_allclose(np.asarray(b)[i], np.asarray(s), rtol=1e-5, atol=0)
            n_checked += 1
    assert n_checked >= 20 * 20
    # the batch is not degenerate: step times really differ across the 20 configurations
    assert len(set(np.round(np.log(np.asarray(batched.step_time)), 3))) >= 18



def test_benchmark_plans_batch_every_plan_field():
    """`diffperf bench core` vmaps over random plans: every TrainingPlan field (including ones
    with defaults) must carry the batch axis, and a small rate measurement must run."""
    import dataclasses

    from diffperf.internal import bench as bench
    plans = bench.random_plans(64)
    for f in dataclasses.fields(plans):
        leaf = getattr(plans, f.name)
        assert np.shape(leaf) == (64,), (f.name, np.shape(leaf))
    rate = bench.sweep_rate(2_000, repeats=1)
    assert rate["configs"] == 2_000 and rate["evals_per_s"] > 0 and rate["feasible"] > 0
