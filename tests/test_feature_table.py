"""One table of cases covering every model feature, and properties checked over the whole table.

The table (`TRAIN_CASES`, `INFER_CASES`) names, for each case, the features it exercises; a first
test checks that every case is feasible, that each label really holds for the case's model / plan
(so a label cannot lie) and that every feature in `TRAIN_FEATURES` / `INFER_FEATURES` is covered
(so a feature cannot silently drop out of the table when a case is edited).

Properties, over every case of the table:

- every leaf of the report (times, memory, throughput, flags) is finite, times and memory > 0;
- ONE `jax.vmap(train_step)` / `jax.vmap(infer)` over the stacked table, with all features mixed in
  one batch (MoE next to dense, MLA next to sliding windows, fp4 next to fp32 optimiser state),
  equals a Python loop of scalar calls;
- faster / bigger hardware and higher efficiencies never make a step or a request slower (each
  resource scaled by 2 alone, and all of them together) and never make a feasible case infeasible;
- (slow) reverse-mode gradients of step time / TTFT / TPOT / end-to-end latency w.r.t. the
  continuous hardware leaves and efficiency factors equal float64 central finite differences.

Only the vmap == loop and gradient == finite-difference identities compare the code with itself;
everything else is a physical property that the code can violate.
"""

from __future__ import annotations

import dataclasses
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

# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------

#: feature -> predicate on (model, system, plan) that must hold for a case labelled with it
TRAIN_FEATURES = {
    "dense": lambda m, s, p: float(m.num_experts) == 1,
    "moe": lambda m, s, p: float(m.num_experts) > 1,
    "expert_parallel": lambda m, s, p: float(m.num_experts) > 1 and float(p.ep) > 1,
    "expert_tp": lambda m, s, p: (float(m.num_experts) > 1 and float(p.tp) > 1
                                  and 0 < float(p.expert_tp) < float(p.tp)),
    "mla": lambda m, s, p: float(m.kv_lora_rank) > 0,
    "sliding_window": lambda m, s, p: 0 < float(m.sliding_window) < float(m.seq_len),
    "parallel_block": lambda m, s, p: float(m.parallel_attention) == 1,
    "tensor_parallel": lambda m, s, p: float(p.tp) > 1,
    "pipeline": lambda m, s, p: float(p.pp) > 1,
    "interleaved_pipeline": lambda m, s, p: float(p.pp) > 1 and float(p.vp) > 1,
    "context_parallel": lambda m, s, p: float(p.cp) > 1,
    "zero1": lambda m, s, p: float(p.zero) == 1,
    "zero3": lambda m, s, p: float(p.zero) == 3,
    "offload": lambda m, s, p: float(p.offload_layers) > 0,
    "selective_recompute": lambda m, s, p: float(p.recompute) == 1,
    "full_recompute": lambda m, s, p: float(p.recompute) == 2,
    "block_recompute": lambda m, s, p: float(p.recompute_layers) > 0,
    "no_flash_attention": lambda m, s, p: float(p.flash_attention) == 0,
    "overlap_ep": lambda m, s, p: float(p.overlap_ep) == 1 and float(p.ep) > 1,
    "fp32": lambda m, s, p: float(p.precision) == 0,
    "bf16": lambda m, s, p: float(p.precision) == 1,
    "fp8": lambda m, s, p: float(p.precision) == 2,
    "fp4": lambda m, s, p: float(p.precision) == 3,
    "multi_domain": lambda m, s, p: float(p.tp * p.pp * p.dp * p.cp) > float(
        s.network.nvlink_domain),
}

INFER_FEATURES = {
    "dense": lambda m, s, p: float(m.num_experts) == 1,
    "bf16": lambda m, s, p: float(p.weight_precision) == 1 and float(p.activation_precision) == 1,
    "fp8": lambda m, s, p: float(p.activation_precision) == 2,
    "fp4": lambda m, s, p: float(p.activation_precision) == 3,
    "weight_only": lambda m, s, p: float(p.weight_precision) > float(p.activation_precision),
    "kv_fp8": lambda m, s, p: float(p.kv_precision) == 2,
    "chunked_prefill": lambda m, s, p: 0 < float(p.prefill_tokens) < float(
        p.batch * p.input_len),
    "moe_expert_parallel": lambda m, s, p: float(m.num_experts) > 1 and float(p.ep) > 1,
    "mla": lambda m, s, p: float(m.kv_lora_rank) > 0,
    "sliding_window": lambda m, s, p: 0 < float(m.sliding_window) < float(
        p.input_len + p.output_len),
    "parallel_block": lambda m, s, p: float(m.parallel_attention) == 1,
    "tensor_parallel": lambda m, s, p: float(p.tp) > 1,
    "pipeline": lambda m, s, p: float(p.pp) > 1,
}


@dataclasses.dataclass(frozen=True)
class Case:
    """`features`: space-separated names, exactly the features of the spec (checked below)."""

    features: str
    model: str
    system: str
    plan: dict

    @property
    def labels(self) -> set[str]:
        return set(self.features.split())


TRAIN_CASES = {
    "dense-llama3-8b": Case(
        "dense tensor_parallel pipeline zero1 bf16", "llama3-8b", "dgx-h100",
        dict(tp=2, pp=2, dp=2, micro_batch=1, global_batch=16, sequence_parallel=1)),
    "interleaved-gpt-22b": Case(
        "dense tensor_parallel pipeline interleaved_pipeline selective_recompute zero1 bf16 "
        "multi_domain", "gpt-22b", "dgx-a100",
        dict(tp=8, pp=4, dp=1, vp=2, global_batch=32, sequence_parallel=1,
             recompute="selective")),
    "full-recompute-llama2-13b": Case(
        "dense tensor_parallel pipeline full_recompute zero1 bf16 no_flash_attention "
        "multi_domain", "llama2-13b", "dgx-a100",
        dict(tp=4, pp=2, dp=2, micro_batch=2, global_batch=32, recompute="full", zero=1,
             flash_attention=0)),
    "moe-expert-tp-mixtral": Case(
        "moe expert_parallel expert_tp overlap_ep tensor_parallel selective_recompute zero1 "
        "bf16 multi_domain", "mixtral-8x7b", "dgx-h100",
        dict(tp=4, dp=4, ep=4, expert_tp=2, global_batch=32, sequence_parallel=1,
             recompute="selective", overlap_ep=1, zero=1)),
    "moe-fine-grained-qwen3": Case(
        "moe expert_parallel expert_tp tensor_parallel selective_recompute block_recompute "
        "zero1 bf16 multi_domain", "qwen3-30b-a3b", "dgx-h100",
        dict(tp=2, dp=8, ep=8, expert_tp=1, global_batch=64, sequence_parallel=1,
             recompute="selective", recompute_layers=4, fused_expert_gemm=1, zero=1)),
    # DeepSeek-V3's own recipe shape (pp 16, ep 64, fp8) on H800s, at tp 2 so that it fits
    "mla-moe-fp8-deepseek-v3": Case(
        "mla moe expert_parallel expert_tp overlap_ep tensor_parallel pipeline "
        "selective_recompute zero1 fp8 multi_domain", "deepseek-v3", "hgx-h800",
        dict(tp=2, pp=16, dp=64, ep=64, expert_tp=1, global_batch=2048, precision="fp8",
             recompute="selective", zero=1, overlap_ep=1, sequence_parallel=1)),
    "sliding-window-gpt-oss-20b": Case(
        "sliding_window moe expert_parallel expert_tp tensor_parallel selective_recompute "
        "zero1 bf16", "gpt-oss-20b", "dgx-h100",
        dict(tp=2, dp=4, ep=4, expert_tp=1, global_batch=32, sequence_parallel=1,
             recompute="selective")),
    "parallel-block-fp32-gpt-j": Case(
        "parallel_block dense tensor_parallel selective_recompute zero1 fp32 multi_domain",
        "gpt-j-6b", "dgx-a100",
        dict(tp=4, dp=4, global_batch=64, sequence_parallel=1, recompute="selective",
             precision="fp32")),
    "context-parallel-llama3-70b": Case(
        "context_parallel dense tensor_parallel pipeline selective_recompute zero1 bf16 "
        "multi_domain", "llama3-70b", "dgx-h100",
        dict(tp=8, cp=2, pp=4, dp=1, global_batch=16, sequence_parallel=1,
             recompute="selective")),
    "zero3-llama2-13b": Case(
        "zero3 dense full_recompute bf16 multi_domain", "llama2-13b", "dgx-a100",
        dict(tp=1, dp=32, global_batch=64, zero=3, recompute="full", zero3_per_matrix=1)),
    # Megatron-core offloads only without pipelining and recomputation; with ZeRO-3 the
    # offload copies, the parameter gathers and the gradient reduce-scatters share one window.
    # (Issue 41 item 3, faster hardware slower with ZeRO-3 + offload, needs an LM head as
    # costly as several layers: `tests/test_training_monotonic.py`, HEAD_HEAVY_ZERO3_OFFLOAD.)
    "offload-zero3-llama2-7b": Case(
        "offload zero3 dense tensor_parallel bf16", "llama2-7b", "dgx-h100",
        dict(tp=2, dp=4, global_batch=32, recompute="none", offload_layers=8, zero=3,
             sequence_parallel=1)),
    "fp8-interleaved-llama3-70b": Case(
        "fp8 dense tensor_parallel pipeline interleaved_pipeline selective_recompute zero1 "
        "multi_domain", "llama3-70b", "dgx-h100",
        dict(tp=8, pp=4, dp=2, vp=5, global_batch=64, precision="fp8", sequence_parallel=1,
             recompute="selective")),
    "fp4-nvl72-llama3-70b": Case(
        "fp4 dense tensor_parallel pipeline selective_recompute zero1", "llama3-70b",
        "gb200-nvl72",
        dict(tp=4, pp=2, dp=8, global_batch=128, precision="fp4", sequence_parallel=1,
             recompute="selective", zero=1)),
}

INFER_CASES = {
    "dense-bf16-llama3-8b": Case(
        "dense bf16", "llama3-8b", "dgx-h100",
        dict(tp=1, batch=16, input_len=2048, output_len=256)),
    "fp8-llama3-70b": Case(
        "dense fp8 kv_fp8 tensor_parallel", "llama3-70b", "dgx-h100",
        dict(tp=4, batch=32, input_len=1024, output_len=512, weight_precision="fp8",
             activation_precision="fp8", kv_precision="fp8")),
    "fp4-blackwell-llama3-70b": Case(
        "dense fp4 kv_fp8 tensor_parallel", "llama3-70b", "dgx-b200",
        dict(tp=2, batch=64, input_len=1024, output_len=1024, weight_precision="fp4",
             activation_precision="fp4", kv_precision="fp8")),
    "int4-weight-only-llama2-70b": Case(
        "dense weight_only tensor_parallel", "llama2-70b", "dgx-a100",
        dict(tp=2, batch=8, input_len=512, output_len=256, weight_precision="int4",
             activation_precision="bf16")),
    "int8-weight-only-pp-llama2-13b": Case(
        "dense weight_only pipeline", "llama2-13b", "dgx-a100",
        dict(tp=1, pp=2, batch=4, input_len=512, output_len=256, weight_precision="int8",
             activation_precision="bf16")),
    "chunked-prefill-llama3-70b": Case(
        "dense chunked_prefill fp4 kv_fp8", "llama3-70b", "dgx-b200",
        dict(tp=1, batch=256, input_len=128, output_len=2048, weight_precision="fp4",
             activation_precision="fp4", kv_precision="fp8", prefill_tokens=8192)),
    "moe-ep-mixtral": Case(
        "moe_expert_parallel tensor_parallel bf16", "mixtral-8x7b", "dgx-h100",
        dict(tp=4, ep=4, batch=16, input_len=1024, output_len=256)),
    "mla-deepseek-v3": Case(
        "mla moe_expert_parallel fp8 tensor_parallel", "deepseek-v3", "hgx-h200",
        dict(tp=8, ep=8, batch=16, input_len=2048, output_len=512, weight_precision="fp8",
             activation_precision="fp8")),
    "sliding-window-gpt-oss-120b": Case(
        "sliding_window moe_expert_parallel fp8 weight_only kv_fp8 tensor_parallel",
        "gpt-oss-120b", "dgx-h100",
        dict(tp=2, ep=2, batch=32, input_len=4096, output_len=1024, weight_precision="fp4",
             activation_precision="fp8", kv_precision="fp8")),
    "parallel-block-falcon-180b": Case(
        "parallel_block dense tensor_parallel bf16", "falcon-180b", "dgx-h100",
        dict(tp=8, batch=8, input_len=1024, output_len=128)),
}

TRAIN_IDS = list(TRAIN_CASES)
INFER_IDS = list(INFER_CASES)

RTOL_VMAP = 1e-5
#: float32 noise allowed when comparing two step times / latencies (nothing else is allowed)
RTOL_MONO = 1e-6


def _specs(case: Case, plan_cls):
    return dp.model(case.model), dp.system(case.system), plan_cls(**case.plan), dp.Efficiency()


@pytest.fixture(scope="module")
def train_specs():
    return [_specs(TRAIN_CASES[k], dp.TrainingPlan) for k in TRAIN_IDS]


@pytest.fixture(scope="module")
def infer_specs():
    return [_specs(INFER_CASES[k], dp.InferencePlan) for k in INFER_IDS]


def _stacked(specs):
    return tuple(stack(list(col)) for col in zip(*specs))


# Compiled once each; every spec leaf is a float32 scalar, so the stacked table of any length
# shares one trace structure (the batch size is the only thing that may recompile).
_train_batch = eqx.filter_jit(jax.vmap(dp.train_step))
_infer_batch = eqx.filter_jit(jax.vmap(dp.infer))
_infer_one = eqx.filter_jit(dp.infer)


@pytest.fixture(scope="module")
def train_reports(train_specs):
    return jax.device_get(_train_batch(*_stacked(train_specs)))


@pytest.fixture(scope="module")
def infer_reports(infer_specs):
    return jax.device_get(_infer_batch(*_stacked(infer_specs)))


def _row(tree, i):
    return jax.tree.map(lambda x: np.asarray(x)[i], tree)


# --------------------------------------------------------------------------------------------
# The table itself
# --------------------------------------------------------------------------------------------


def _check_table(cases, specs, features, reports):
    covered = set()
    for i, (cid, (m, s, p, _)) in enumerate(zip(cases, specs)):
        case = cases[cid]
        unknown = case.labels - set(features)
        assert not unknown, (cid, unknown)
        has = {f for f, pred in features.items() if pred(m, s, p)}
        # the labels are exactly the features the spec has: none claimed that it lacks, none
        # that it has left unnamed
        assert case.labels == has, (cid, sorted(case.labels ^ has))
        covered |= case.labels
        reason = int(np.asarray(reports.reason)[i])
        assert reason == 0, (cid, reason, dp.REASONS.get(reason))
        assert bool(np.asarray(reports.feasible)[i]) and bool(np.asarray(reports.fits)[i]), cid
    missing = set(features) - covered
    assert not missing, f"features no case covers: {sorted(missing)}"


def test_training_table_is_feasible_and_covers_every_feature(train_specs, train_reports):
    _check_table(TRAIN_CASES, train_specs, TRAIN_FEATURES, train_reports)


def test_inference_table_is_feasible_and_covers_every_feature(infer_specs, infer_reports):
    _check_table(INFER_CASES, infer_specs, INFER_FEATURES, infer_reports)


# --------------------------------------------------------------------------------------------
# (a) every report field finite, and physically sensible
# --------------------------------------------------------------------------------------------


def _assert_all_finite(report, ids):
    for path, leaf in jax.tree_util.tree_flatten_with_path(report)[0]:
        leaf = np.asarray(leaf)
        bad = [ids[i] for i in np.flatnonzero(~np.isfinite(leaf.astype(np.float64)))]
        assert not bad, (jax.tree_util.keystr(path), bad)


def test_every_training_report_field_is_finite(train_specs, train_reports):
    r = train_reports
    _assert_all_finite(r, TRAIN_IDS)
    assert len(jax.tree.leaves(r)) >= 25  # the memory breakdown is in there too
    for name in ("step_time", "compute_time", "model_flops", "hardware_flops", "tokens_per_s",
                 "mfu"):
        assert np.all(np.asarray(getattr(r, name)) > 0), name
    for name in ("recompute_time", "tp_comm_time", "cp_comm_time", "ep_comm_time",
                 "pp_comm_time", "dp_comm_time", "bubble_time", "optimizer_time",
                 "offload_time"):
        assert np.all(np.asarray(getattr(r, name)) >= 0), name
    assert np.all(np.asarray(r.mfu) <= np.asarray(r.hfu) * (1 + RTOL_VMAP))
    assert np.all(np.asarray(r.hfu) < 1)
    capacity = np.array([float(s.accelerator.hbm_capacity) for _, s, _, _ in train_specs])
    assert np.all(np.asarray(r.memory.total) <= capacity)
    for name in ("weights", "gradients", "optimizer", "activations", "total"):
        assert np.all(np.asarray(getattr(r.memory, name)) > 0), name
    # each case's own feature leaves a trace in the report
    for i, cid in enumerate(TRAIN_IDS):
        row, feats = _row(r, i), TRAIN_CASES[cid].labels
        assert (row.cp_comm_time > 0) == ("context_parallel" in feats), cid
        assert (row.ep_comm_time > 0) == ("expert_parallel" in feats), cid
        assert (row.offload_time > 0 or row.memory.host > 0) == ("offload" in feats), cid
        # (selective recompute with flash attention adds no work: the fused kernel already
        # rebuilds the scores in its backward pass, so only the other two modes must show)
        if any(f in feats for f in ("full_recompute", "block_recompute")):
            assert row.recompute_time > 0, cid
        if not any(f in feats for f in ("selective_recompute", "full_recompute",
                                        "block_recompute")):
            assert row.recompute_time == 0, cid
        assert (row.bubble_time > 0) == ("pipeline" in feats), cid


def test_every_inference_report_field_is_finite(infer_specs, infer_reports):
    r = infer_reports
    _assert_all_finite(r, INFER_IDS)
    assert len(jax.tree.leaves(r)) >= 20  # prefill / decode breakdowns and memory included
    for name in ("ttft", "tpot", "e2e_latency", "output_tok_s_per_gpu", "throughput"):
        assert np.all(np.asarray(getattr(r, name)) > 0), name
    assert np.all(np.asarray(r.e2e_latency) >= np.asarray(r.ttft))
    batch = np.array([float(p.batch) for _, _, p, _ in infer_specs])
    assert np.all(np.asarray(r.max_batch) >= batch)
    capacity = np.array([float(s.accelerator.hbm_capacity) for _, s, _, _ in infer_specs])
    assert np.all(np.asarray(r.memory.total) <= capacity)
    for name in ("weights", "kv_cache", "activations", "total"):
        assert np.all(np.asarray(getattr(r.memory, name)) > 0), name


# --------------------------------------------------------------------------------------------
# (b) one vmap over the mixed table == a loop
# --------------------------------------------------------------------------------------------


def _assert_batch_equals_loop(batched, single_fn, specs, ids):
    flat_b, tree_b = jax.tree_util.tree_flatten(batched)
    n = 0
    for i, args in enumerate(specs):
        flat_s, tree_s = jax.tree_util.tree_flatten(jax.device_get(single_fn(*args)))
        assert tree_b == tree_s
        for b, s in zip(flat_b, flat_s):
            np.testing.assert_allclose(np.asarray(b)[i], np.asarray(s), rtol=RTOL_VMAP, atol=0,
                                       err_msg=ids[i])
            n += 1
    return n


def test_vmap_over_the_training_table_equals_a_loop(train_specs, train_reports, step):
    n = _assert_batch_equals_loop(train_reports, step, train_specs, TRAIN_IDS)
    assert n >= 25 * len(TRAIN_IDS)
    # the batch is not degenerate: every case has its own step time
    t = np.asarray(train_reports.step_time)
    assert len(set(np.round(np.log(t), 4))) == len(t), t


def test_vmap_over_the_inference_table_equals_a_loop(infer_specs, infer_reports):
    n = _assert_batch_equals_loop(infer_reports, _infer_one, infer_specs, INFER_IDS)
    assert n >= 20 * len(INFER_IDS)
    t = np.asarray(infer_reports.e2e_latency)
    assert len(set(np.round(np.log(t), 4))) == len(t), t


# --------------------------------------------------------------------------------------------
# (d) monotonicity in every resource
# --------------------------------------------------------------------------------------------

#: hardware leaf -> the factor that makes the machine better: 2 for rates, capacities and the
#: NVLink domain size, 1/2 for latencies and per-kernel overheads. `num_sms` alone is not a
#: resource: at a fixed chip FLOP/s twice the SMs are each half as fast, and wave quantisation
#: of small GEMMs then rightly costs time (2x num_sms alone makes the fp32 GPT-J case ~11 %
#: slower); "accelerator.sms" below doubles the SMs *with* their FLOP/s.
HW_RESOURCES = {
    **{f"accelerator.{n}": 2.0 for n in (
        "flops_fp32", "flops_bf16", "flops_fp8", "flops_fp4", "vector_flops", "hbm_bandwidth",
        "l2_bandwidth", "host_bandwidth", "hbm_capacity", "host_memory", "l2_capacity")},
    "accelerator.launch_overhead": 0.5,
    "network.nvlink_bandwidth": 2.0, "network.scaleout_bandwidth": 2.0,
    "network.nvlink_latency": 0.5, "network.scaleout_latency": 0.5,
    "network.nvlink_domain": 2.0,
}
SM_LEAVES = ("num_sms", "flops_fp32", "flops_bf16", "flops_fp8", "flops_fp4", "vector_flops")
CAPACITIES = ("accelerator.hbm_capacity", "accelerator.host_memory", "accelerator.l2_capacity")
#: efficiency fractions in (0, 1]: "better" halves the distance to 1; overheads halve
EFF_FRACTIONS = ("matmul_peak", "matmul_lowp", "attention", "vector", "hbm", "l2", "nvlink",
                 "all_to_all", "scaleout", "tp_overlap", "dp_overlap", "pp_overlap",
                 "cp_overlap", "zero3_overlap")
EFF_OVERHEADS = ("kernel_overhead", "collective_overhead")


def _improve(system, eff, resource):
    """The same system / efficiency with one resource better (or all of them, 'everything')."""
    if resource == "everything":
        for r in RESOURCES[:-1]:
            system, eff = _improve(system, eff, r)
        return system, eff
    if resource == "accelerator.sms":
        where = lambda s: [getattr(s.accelerator, n) for n in SM_LEAVES]
        return eqx.tree_at(where, system, [2.0 * x for x in where(system)]), eff
    kind, name = resource.split(".")
    if kind == "efficiency":
        x = getattr(eff, name)
        new = 0.5 * x if name in EFF_OVERHEADS else x + 0.5 * (1 - x)
        return system, eqx.tree_at(lambda e: getattr(e, name), eff, new)
    where = lambda s: getattr(getattr(s, kind), name)
    return eqx.tree_at(where, system, where(system) * HW_RESOURCES[resource]), eff


RESOURCES = [*HW_RESOURCES, "accelerator.sms",
             *(f"efficiency.{f}" for f in EFF_FRACTIONS + EFF_OVERHEADS), "everything"]


def _improved_batch(specs, resource):
    out = []
    for m, s, p, e in specs:
        s2, e2 = _improve(s, e, resource)
        out.append((m, s2, p, e2))
    return _stacked(out)


def _not_slower(base, better, ids, resource, fields):
    bad = []
    for field in fields:
        t0, t1 = np.asarray(getattr(base, field)), np.asarray(getattr(better, field))
        for i in np.flatnonzero(~(t1 <= t0 * (1 + RTOL_MONO))):
            bad.append(f"{ids[i]}: {field} {t0[i]:.9g} -> {t1[i]:.9g} "
                       f"(+{(t1[i] / t0[i] - 1) * 100:.4g} %) with better {resource}")
    return bad


@pytest.mark.parametrize("resource", RESOURCES)
def test_better_resource_never_slows_a_training_case(train_specs, train_reports, resource):
    better = jax.device_get(_train_batch(*_improved_batch(train_specs, resource)))
    bad = _not_slower(train_reports, better, TRAIN_IDS, resource, ["step_time"])
    assert not bad, "\n".join(bad)
    # and never turns a feasible case infeasible
    assert np.all(np.asarray(better.reason) == 0), (resource, np.asarray(better.reason))


@pytest.mark.parametrize("resource", RESOURCES)
def test_better_resource_never_slows_an_inference_case(infer_specs, infer_reports, resource):
    better = jax.device_get(_infer_batch(*_improved_batch(infer_specs, resource)))
    bad = _not_slower(infer_reports, better, INFER_IDS, resource,
                      ["ttft", "tpot", "e2e_latency"])
    assert not bad, "\n".join(bad)
    assert np.all(np.asarray(better.reason) == 0), (resource, np.asarray(better.reason))
    # more memory (or anything else) never lowers the largest batch that fits
    mb0, mb1 = np.asarray(infer_reports.max_batch), np.asarray(better.max_batch)
    assert np.all(mb1 >= mb0), (resource, mb0, mb1)


def test_more_hbm_raises_the_max_batch(infer_specs, infer_reports):
    """Non-vacuity of the capacity resource: 2x the HBM strictly raises every max batch."""
    better = jax.device_get(
        _infer_batch(*_improved_batch(infer_specs, "accelerator.hbm_capacity")))
    assert np.all(np.asarray(better.max_batch) > np.asarray(infer_reports.max_batch))


def test_each_resource_matters_somewhere(train_specs, train_reports, infer_specs,
                                         infer_reports):
    """Non-vacuity of the monotonicity property: every resource but the capacities strictly
    shortens at least one training or inference case of the table (by > 0.01 %)."""
    idle = []
    for resource in RESOURCES:
        if resource in CAPACITIES:
            continue
        t0 = np.asarray(train_reports.step_time)
        t1 = np.asarray(_train_batch(*_improved_batch(train_specs, resource)).step_time)
        l0 = np.asarray(infer_reports.e2e_latency)
        l1 = np.asarray(_infer_batch(*_improved_batch(infer_specs, resource)).e2e_latency)
        if not (np.any(t1 < t0 * (1 - 1e-4)) or np.any(l1 < l0 * (1 - 1e-4))):
            idle.append(resource)
    assert not idle, idle


# --------------------------------------------------------------------------------------------
# (c) gradients vs float64 central finite differences (subprocess: x64 is global JAX state)
# --------------------------------------------------------------------------------------------

#: Continuous leaves whose finite difference is well defined at the presets: bandwidths, FLOP/s,
#: latencies and efficiency factors enter through smooth maxima (log-sum-exp rooflines) and
#: products. Left out on purpose: `num_sms` and the model / plan shapes (wave and tile
#: quantisation: exact ceilings forward, straight-through gradient backward, so a central
#: difference sees a step function), `hbm_capacity` / `host_memory` / `l2_capacity` (capacities
#: switch feasibility or cache hits, with zero or undefined derivatives), `nvlink_domain` (an
#: integer placement). Leaves that are 0 at a preset (flops_fp4 before Blackwell) are skipped.
FD_LEAVES = [
    ("accelerator", "flops_fp32"), ("accelerator", "flops_bf16"), ("accelerator", "flops_fp8"),
    ("accelerator", "flops_fp4"), ("accelerator", "vector_flops"),
    ("accelerator", "hbm_bandwidth"), ("accelerator", "l2_bandwidth"),
    ("accelerator", "host_bandwidth"), ("accelerator", "launch_overhead"),
    ("network", "nvlink_bandwidth"), ("network", "nvlink_latency"),
    ("network", "scaleout_bandwidth"), ("network", "scaleout_latency"),
    ("efficiency", "matmul_peak"), ("efficiency", "matmul_size_scale"),
    ("efficiency", "matmul_lowp"), ("efficiency", "attention"), ("efficiency", "vector"),
    ("efficiency", "hbm"), ("efficiency", "nvlink"), ("efficiency", "all_to_all"),
    ("efficiency", "scaleout"), ("efficiency", "kernel_overhead"),
    ("efficiency", "collective_overhead"), ("efficiency", "tp_overlap"),
    ("efficiency", "dp_overlap"), ("efficiency", "pp_overlap"), ("efficiency", "cp_overlap"),
    ("efficiency", "zero3_overlap"),
]

_FD_SCRIPT = textwrap.dedent(r"""
    import json, sys
    import jax
    jax.config.update("jax_enable_x64", True)
    import equinox as eqx
    import jax.numpy as jnp
    import numpy as np
    import diffperf as dp
    from diffperf.validation import stack

    cfg = json.loads(sys.stdin.read())
    leaves = [tuple(x) for x in cfg["leaves"]]

    def leaf(hw, kind, name):  # hw = (system, efficiency), batched or not
        s, e = hw
        return getattr(e if kind == "efficiency" else getattr(s, kind), name)

    out = {}
    for kind, fn, plan_cls, outputs in (
            ("train", dp.train_step, dp.TrainingPlan, ["step_time"]),
            ("infer", dp.infer, dp.InferencePlan, ["ttft", "tpot", "e2e_latency"])):
        specs = [(dp.model(m), dp.system(s), plan_cls(**p), dp.Efficiency())
                 for m, s, p in cfg[kind]]
        models, systems, plans, effs = (stack(list(c)) for c in zip(*specs))
        assert systems.accelerator.hbm_bandwidth.dtype == jnp.float64

        def f(hw, m, p):
            r = fn(m, hw[0], p, hw[1])
            return jnp.stack([getattr(r, o) for o in outputs])

        hw0 = (systems, effs)
        # two compilations per kind: the Jacobian of the whole table, and its values
        jac = jax.jit(jax.vmap(jax.jacrev(f)))(hw0, models, plans)
        value = jax.jit(jax.vmap(f))
        y0 = value(hw0, models, plans)  # (B, O)
        x0 = np.stack([np.asarray(leaf(hw0, k, n)) for k, n in leaves], -1)  # (B, K)
        grad = np.stack([np.asarray(leaf(jac, k, n)) for k, n in leaves], -1)  # (B, O, K)
        fd = np.zeros(grad.shape)
        for j, (k, n) in enumerate(leaves):
            h = cfg["rel_step"] * np.abs(x0[:, j])
            at = lambda d: value(
                eqx.tree_at(lambda hw: leaf(hw, k, n), hw0, jnp.asarray(x0[:, j] + d)),
                models, plans)
            fd[:, :, j] = np.asarray(at(h) - at(-h)) / (2 * np.where(h > 0, h, 1.0))[:, None]
        out[kind] = {"x": x0.tolist(), "y": np.asarray(y0).tolist(), "grad": grad.tolist(),
                     "fd": fd.tolist(), "outputs": outputs}
    print(json.dumps(out))
""")

#: relative central-difference step. In float64 the rounding error of the difference quotient is
#: ~ 1e-16 |f| / h = 1e-10 of the elasticity scale |f / x|; the truncation error
#: ~ (h x)^2 |f'''| / 6 is far smaller for these smooth functions.
FD_REL_STEP = 1e-6
#: |grad - fd| <= FD_RTOL |fd| + FD_ATOL_ELASTICITY |f / x|: relative to the derivative, with a
#: floor at 1e-8 of the output's elasticity scale (100x the rounding error above) for leaves the
#: output hardly depends on. Measured when written: median relative error ~1e-9, worst 1.3e-5
#: (training) and 6e-5 (inference: a leaf of elasticity 3e-6, i.e. rounding), all inside.
FD_RTOL = 1e-4
FD_ATOL_ELASTICITY = 1e-8


@pytest.fixture(scope="module")
def fd_result():
    cfg = {"leaves": FD_LEAVES, "rel_step": FD_REL_STEP,
           "train": [(c.model, c.system, c.plan) for c in TRAIN_CASES.values()],
           "infer": [(c.model, c.system, c.plan) for c in INFER_CASES.values()]}
    proc = subprocess.run([sys.executable, "-c", _FD_SCRIPT], input=json.dumps(cfg),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["train", "infer"])
def test_gradients_match_float64_finite_differences(fd_result, kind):
    res = fd_result[kind]
    ids = TRAIN_IDS if kind == "train" else INFER_IDS
    x, y = np.array(res["x"]), np.array(res["y"])        # (B, K), (B, O)
    g, fd = np.array(res["grad"]), np.array(res["fd"])   # (B, O, K)
    assert np.all(np.isfinite(g)) and np.all(np.isfinite(fd))
    scale = np.abs(y[:, :, None] / np.where(x == 0, 1.0, x)[:, None, :])
    tol = FD_RTOL * np.abs(fd) + FD_ATOL_ELASTICITY * scale
    active = np.broadcast_to((x != 0)[:, None, :], g.shape)  # a leaf at 0 has no relative step
    bad = [f"{ids[b]} d{res['outputs'][o]}/d{'.'.join(FD_LEAVES[k])}: grad {g[b, o, k]:.9g} "
           f"fd {fd[b, o, k]:.9g}"
           for b, o, k in zip(*np.nonzero(active & ~(np.abs(g - fd) <= tol)))]
    assert not bad, "\n".join(bad)
    # not vacuous: most (case, leaf) pairs move the output
    moved = active & (np.abs(fd) > 1e-6 * scale)
    assert moved.sum() >= 0.4 * active.sum(), (moved.sum(), active.sum())
    # every case depends on at least eight of the leaves (tp 1 on one GPU: no network ones)
    assert np.all(moved.any(axis=1).sum(axis=1) >= 8), moved.any(axis=1).sum(axis=1)
