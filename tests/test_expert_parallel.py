"""Expert parallelism as Megatron-core lays it out (`TrainingPlan.expert_tp`, `overlap_ep`):
the expert layers regroup the tp * cp * dp ranks of a stage as expert-tensor x expert x
expert-data parallel ("MoE parallel folding"). Expert weights are sharded over their own
data-parallel ranks, which the old layout got wrong by a factor ep; the rank-divisibility rule
is Megatron-core's; folding leaves the FLOPs alone; the all-to-all carries each rank's own
tokens; overlapping it never costs time. Expected values are written from the layout, not
taken from the code."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toy_moe import EFF, H100, MOE, STEP, E, F, H, K, L, V  # noqa: F401

import diffperf as dp
from diffperf.feasibility import REASONS, describe_failure

EXPERT_PARAMS = L * E * 3 * H * F  # all experts of all layers
# attention, 2 h of its biases, the router, 2 layer norms' weights and biases; the 2 tables
DENSE_PARAMS = L * (4 * H * H + 2 * H + H * E + 4 * H) + 2 * V * H


def _plan(**kw):
    base = dict(tp=2, pp=1, dp=8, ep=4, micro_batch=1, global_batch=32, sequence_parallel=1,
                zero=1)
    return dp.TrainingPlan(**(base | kw))


def test_expert_weights_are_sharded_over_their_own_data_parallel_ranks():
    """tp 2, ep 4, dp 8 (16 GPUs): a GPU holds E / 4 experts split in 2 (expert_tp = tp), and
    eight ranks share the same dense shard but only 8 / 4 = 2 the same expert shard, so the
    distributed optimizer divides the expert states by 2, not by 8."""
    from diffperf.training import params_per_gpu, sharded_params_per_gpu
    plan = _plan()
    per_gpu = DENSE_PARAMS / 2 + EXPERT_PARAMS / (2 * 4)
    assert float(params_per_gpu(MOE, plan)) == pytest.approx(per_gpu, rel=1e-6)
    sharded = DENSE_PARAMS / 2 / 8 + EXPERT_PARAMS / (2 * 4) / 2
    assert float(sharded_params_per_gpu(MOE, plan)) == pytest.approx(sharded, rel=1e-6)
    mem = STEP(MOE, H100, plan, EFF).memory
    assert float(mem.optimizer) == pytest.approx(12.0 * sharded, rel=1e-6)
    # expert_tp 1 (folding): whole experts, E / 4 per GPU; 2 * 8 / 4 = 4 ranks share them
    folded = _plan(expert_tp=1)
    assert float(params_per_gpu(MOE, folded)) == pytest.approx(
        DENSE_PARAMS / 2 + EXPERT_PARAMS / 4, rel=1e-6)
    assert float(sharded_params_per_gpu(MOE, folded)) == pytest.approx(
        DENSE_PARAMS / 2 / 8 + EXPERT_PARAMS / 4 / 4, rel=1e-6)


def test_zero3_gathers_expert_weights_only_over_their_own_data_parallel_ranks():
    """ZeRO-3 with ep = dp (tp 2, etp 2): each GPU holds the only copy of its experts, so it
    gathers and reduce-scatters none of their weights, and wider experts leave the DP traffic
    alone. With ep 4 two ranks share each expert shard, and wider experts cost DP time."""
    no_hiding = dataclasses.replace(EFF, zero3_overlap=0.0)
    wide = dataclasses.replace(MOE, ffn_hidden=4 * F)

    def dp_time(model, ep):
        return float(STEP(model, H100, _plan(ep=ep, zero=3), no_hiding).dp_comm_time)
    assert dp_time(MOE, 8) > 0
    assert dp_time(wide, 8) == pytest.approx(dp_time(MOE, 8), rel=1e-9)
    assert dp_time(wide, 4) > 1.01 * dp_time(MOE, 4)


def test_dense_models_and_expert_tp_equal_to_tp_keep_the_default_layout():
    dense = dataclasses.replace(MOE, num_experts=1, experts_per_token=1, ffn_hidden=4 * H)
    plan = _plan(ep=1)
    for model, ep in ((MOE, 4), (dense, 1)):
        a = STEP(model, H100, _plan(ep=ep), EFF)
        b = STEP(model, H100, _plan(ep=ep, expert_tp=2), EFF)
        assert float(a.step_time) == float(b.step_time)
        assert float(a.memory.total) == float(b.memory.total)
    # a dense model ignores expert_tp altogether, also on the path a concrete dense model takes
    # (the expert terms left out of the trace)
    a = dp.train_step(dense, H100, plan, EFF)
    c = dp.train_step(dense, H100, _plan(ep=1, expert_tp=1), EFF)
    assert float(a.step_time) == float(c.step_time)
    assert float(a.step_time) == pytest.approx(float(STEP(dense, H100, plan, EFF).step_time),
                                               rel=1e-6)


def test_megatron_core_rank_rule_for_expert_parallelism():
    """ep * expert_tp must divide tp * cp * dp. With tp 2 and dp 16 (32 ranks per stage), ep 32
    needs expert_tp 1 (NVIDIA's Qwen3-235B H100 recipe: TP 2, EP 32 on 256 GPUs, PP 8)."""
    plan = _plan(dp=16, ep=32, global_batch=64)
    assert int(STEP(MOE, H100, plan, EFF).reason) == 8
    folded = _plan(dp=16, ep=32, expert_tp=1, global_batch=64)
    assert int(STEP(MOE, H100, folded, EFF).reason) == 0
    msg = describe_failure(8, MOE, plan)
    assert "expert_tp=2" in msg and "tp * cp * dp=32" in msg
    assert "ep * expert_tp does not divide tp * cp * dp" in REASONS[8]
    with pytest.raises(ValueError, match="expert_tp"):
        dp.TrainingPlan(expert_tp=1.5)


def test_folding_keeps_the_flops_and_dispatches_each_ranks_own_tokens():
    """Same model FLOPs with expert_tp 1 or 2. With expert_tp 1 the all-to-all carries the
    rank's own (sequence-parallel) tokens, tokens / tp, and the expert MLPs need no tensor-
    parallel reduction (ep 4 stays inside one node either way: ranks 1 or 2 apart)."""
    a = STEP(MOE, H100, _plan(), EFF)
    b = STEP(MOE, H100, _plan(expert_tp=1), EFF)
    assert float(a.model_flops) == pytest.approx(float(b.model_flops), rel=1e-9)
    # the MoE layers' MLP reductions vanish (expert_tp 1) and the all-to-all halves
    assert float(b.tp_comm_time + b.ep_comm_time) < 0.8 * float(a.tp_comm_time + a.ep_comm_time)
    assert float(b.tp_comm_time) < float(a.tp_comm_time)
    # half the all-to-all payload; each collective's fixed latency stays
    assert 0.5 * float(a.ep_comm_time) < float(b.ep_comm_time) < 0.75 * float(a.ep_comm_time)


def test_overlapping_the_all_to_all_never_costs_time_and_hides_at_most_it():
    for kw in ({}, {"expert_tp": 1}, {"dp": 16, "ep": 16, "expert_tp": 1, "global_batch": 64}):
        a = STEP(MOE, H100, _plan(**kw), EFF)
        b = STEP(MOE, H100, _plan(overlap_ep=1, **kw), EFF)
        assert float(b.step_time) <= float(a.step_time)
        # the step saves at most the all-to-all time it hides (the DP reduction may lose some
        # of its window to it), and only communication changes
        hidden = float(a.ep_comm_time) - float(b.ep_comm_time)
        assert float(b.tp_comm_time) == pytest.approx(float(a.tp_comm_time), rel=1e-9)
        saved = float(a.step_time) - float(b.step_time)
        assert hidden > 0 and 0 < saved <= hidden * (1 + 1e-5)
        assert float(b.compute_time) == pytest.approx(float(a.compute_time), rel=1e-6)
        # the dense model has nothing to overlap
    dense = dataclasses.replace(MOE, num_experts=1, experts_per_token=1, ffn_hidden=4 * H)
    a = STEP(dense, H100, _plan(ep=1), EFF)
    b = STEP(dense, H100, _plan(ep=1, overlap_ep=1), EFF)
    assert float(a.step_time) == float(b.step_time)


def test_expert_fields_vmap_and_differentiate():
    """vmap over expert_tp / overlap_ep equals the loop; the step time has a finite gradient
    in the hardware with folding on."""
    plans = [_plan(expert_tp=e, overlap_ep=o) for e in (0, 1, 2) for o in (0, 1)]
    stacked = jax.tree.map(lambda *x: np.stack(x), *plans)
    batched = jax.vmap(lambda p: dp.train_step(MOE, H100, p, EFF).step_time)(stacked)
    loop = [float(STEP(MOE, H100, p, EFF).step_time) for p in plans]
    np.testing.assert_allclose(np.asarray(batched), loop, rtol=1e-5)
    g = jax.grad(lambda s: dp.train_step(MOE, s, _plan(expert_tp=1, overlap_ep=1),
                                         EFF).step_time)(H100)
    assert np.isfinite(float(g.accelerator.hbm_bandwidth))
    assert float(g.accelerator.hbm_bandwidth) < 0  # more bandwidth, faster step


def test_layer_communication_is_reported_by_parallelism():
    """The layers' exposed communication splits into its TP reductions, CP K / V exchanges and
    EP all-to-alls: each appears exactly when its degree exceeds 1, and the parts add up to the
    step with the other terms."""
    one = jnp.float32(1.0)  # array leaves: STEP's compiled program serves the dense model too
    dense = eqx.tree_at(lambda m: (m.num_experts, m.experts_per_token), MOE, (one, one))
    for model, kw, present in (
            (MOE, {"tp": 2, "cp": 2, "dp": 4, "ep": 4}, ("tp", "cp", "ep")),
            (MOE, {"tp": 1, "dp": 16, "ep": 4}, ("ep",)),
            (dense, {"tp": 2, "cp": 2, "dp": 4, "ep": 1}, ("tp", "cp")),
            (dense, {"tp": 1, "dp": 16, "ep": 1}, ())):
        r = STEP(model, H100, _plan(**kw), EFF)
        for part in ("tp", "cp", "ep"):
            t = float(getattr(r, f"{part}_comm_time"))
            assert (t > 0) == (part in present), (kw, part, t)
        total = sum(float(getattr(r, f)) for f in (
            "compute_time", "tp_comm_time", "cp_comm_time", "ep_comm_time", "pp_comm_time",
            "dp_comm_time", "bubble_time", "optimizer_time", "offload_time"))
        assert float(r.step_time) == pytest.approx(total, rel=1e-6)
