"""Sweep engine and plan search: exhaustive search = brute force, blocked = unblocked,
sharded = unsharded, infeasible plans never win."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffperf as dp
from diffperf.explore import (
    Grid,
    evaluate_all,
    pareto_front,
    plan_from_values,
    run_sweep,
    search_training,
)
from diffperf.explore._search_training import _BREAKDOWN
from diffperf.internal import REASON_GPUS

GPUS, GBS = 32, 64
AXES = {"tp": [1, 2, 4, 8], "pp": [1, 2, 3, 4], "micro_batch": [1, 2, 4], "recompute": [0, 1, 2],
        "zero": [0, 1, 3], "vp": [1, 2], "flash_attention": [0, 1]}


@pytest.fixture(scope="module")
def setup():
    model = dp.model("gpt-7.5b")
    system = dp.system("a100-sxm4-40gb")  # 40 GB: many plans do not fit
    return model, system, dp.Efficiency(), Grid(AXES)


def _evaluate(model, system, eff):
    def evaluate(values):
        r = dp.train_step(model, system, plan_from_values(values, GPUS, GBS), eff)
        reason = jnp.where(jnp.mod(GPUS, values["tp"] * values["pp"]) == 0, r.reason, REASON_GPUS)
        return r.step_time, r.memory.total, reason
    return evaluate


@pytest.fixture(scope="module")
def brute_force(setup):
    """Every plan evaluated one at a time with the scalar API (a Python loop)."""
    model, system, eff, grid = setup
    step = jax.jit(lambda p: dp.train_step(model, system, p, eff))
    rows = []
    for combo in itertools.product(*AXES.values()):
        v = dict(zip(AXES, combo))
        if GPUS % (v["tp"] * v["pp"]):
            rows.append((np.inf, np.nan, REASON_GPUS))
            continue
        r = step(plan_from_values({k: float(x) for k, x in v.items()}, GPUS, GBS))
        rows.append((float(r.step_time) if bool(r.feasible) else np.inf, float(r.memory.total),
                     int(r.reason)))
    return np.array(rows)


def test_grid_decode_matches_numpy(setup):
    grid = setup[3]
    flat = np.arange(grid.size)
    host = grid.decode_host(flat)
    dev = jax.jit(grid.decode)(jnp.asarray(flat, dtype=jnp.int32))
    for name in grid.names:
        np.testing.assert_array_equal(np.asarray(dev[name]), host[name])
    # last axis fastest, like itertools.product
    first = [dict(zip(AXES, c)) for c in itertools.islice(itertools.product(*AXES.values()), 5)]
    for i, v in enumerate(first):
        assert {k: host[k][i] for k in AXES} == v


def test_grid_rejects_bad_axes():
    with pytest.raises(ValueError, match="'tp' has no values"):
        Grid({"tp": []})
    with pytest.raises(ValueError, match="non-finite"):
        Grid({"tp": [1, float("nan")]})


@pytest.mark.slow
def test_search_equals_brute_force(setup, brute_force):
    model, system, eff, grid = setup
    res = run_sweep(grid, _evaluate(model, system, eff), k=5, progress=False)
    times = brute_force[:, 0]
    order = np.argsort(times, kind="stable")[:5]
    np.testing.assert_allclose(res.top_value, times[order], rtol=1e-6)
    # the best plan is the brute-force argmin (ties broken by equal time)
    assert times[res.top_index[0]] == pytest.approx(times.min(), rel=1e-6)
    assert res.feasible == int(np.isfinite(times).sum())
    hist = np.bincount(brute_force[:, 2].astype(int), minlength=res.reasons.size)
    np.testing.assert_array_equal(res.reasons, hist)


def test_infeasible_plans_never_win(setup):
    model, system, eff, grid = setup
    import equinox as eqx
    small = eqx.tree_at(lambda s: s.accelerator.hbm_capacity, system, jnp.float32(16e9))

    def raw(v):
        r = dp.train_step(model, small, plan_from_values(v, GPUS, GBS), eff)
        ok = jnp.mod(GPUS, v["tp"] * v["pp"]) == 0
        return {"t": r.step_time, "reason": jnp.where(ok, r.reason, REASON_GPUS)}
    out = evaluate_all(grid, raw, progress=False)
    feasible_best = out["t"][out["reason"] == 0].min()
    # with 16 GB, the fastest plans do not fit: they must not be chosen
    assert (out["t"][out["reason"] == 10] < feasible_best).any()
    res = run_sweep(grid, _evaluate(model, small, eff), k=10, progress=False)
    chosen = res.top_index[np.isfinite(res.top_value)]
    assert chosen.size == 10 and (out["reason"][chosen] == 0).all()
    assert res.top_value[0] == pytest.approx(feasible_best, rel=1e-6)


def test_blocked_equals_unblocked(setup):
    model, system, eff, grid = setup
    f = _evaluate(model, system, eff)
    big = run_sweep(grid, f, k=8, progress=False)
    small = run_sweep(grid, f, k=8, progress=False, max_block=16)
    np.testing.assert_array_equal(big.top_index, small.top_index)
    np.testing.assert_allclose(big.top_value, small.top_value, rtol=1e-6)
    np.testing.assert_array_equal(big.reasons, small.reasons)
    np.testing.assert_array_equal(big.front_index, small.front_index)


def test_pareto_front_is_not_dominated(setup, brute_force):
    model, system, eff, grid = setup
    res = run_sweep(grid, _evaluate(model, system, eff), k=3, progress=False,
                    secondary_bounds=(1e9, 1e11))
    ok = res.front_index >= 0
    front = res.front_index[ok][pareto_front(res.front_value[ok], res.front_secondary[ok])]
    t, mem = brute_force[:, 0], brute_force[:, 1]
    for i in front:
        dominated = (t < t[i]) & (mem < mem[i]) & np.isfinite(t)
        # binned front: nothing is strictly better in both by more than one bin width (~7 %)
        assert not np.any(dominated & (mem < mem[i] / 1.08)), i
    # the overall fastest plan is on the front
    assert np.argmin(t) in set(front) or t[front].min() == pytest.approx(t.min(), rel=1e-6)


def test_pareto_front_helper():
    v = np.array([5.0, 3.0, 4.0, 1.0, 2.0])
    s = np.array([1.0, 2.0, 3.0, 4.0, 4.0])
    assert pareto_front(v, s).tolist() == [0, 1, 3]


def test_evaluate_all_equals_loop(setup):
    model, system, eff, _ = setup
    grid = Grid({"tp": [1, 2, 4], "micro_batch": [1, 2], "recompute": [0, 2]})

    def f(v):
        r = dp.train_step(model, system, plan_from_values(v, GPUS, GBS), eff)
        return {"t": r.step_time, "m": r.memory.total}
    out = evaluate_all(grid, f, progress=False, max_block=4)
    values = grid.decode_host(np.arange(grid.size))
    for i in range(grid.size):
        want = f({k: jnp.float32(v[i]) for k, v in values.items()})
        assert out["t"][i] == pytest.approx(float(want["t"]), rel=1e-5)
        assert out["m"][i] == pytest.approx(float(want["m"]), rel=1e-5)


def test_search_training_reports(setup):
    model, system, eff, grid = setup
    r = search_training(model, system, GPUS, GBS, grid=grid, efficiency=eff, top_k=3,
                        progress=False)
    assert r["evaluated"] == grid.size and 0 < r["feasible"] < grid.size
    top = r["top"]
    assert len(top) == 3 and top["feasible"].all()
    assert list(top["step_time_s"]) == sorted(top["step_time_s"])
    # the second plan's note gives its gap and names the term that grew most, as "mostly <term>"
    # or, when another term wins some back, "<term> +x s, <other> -y s"
    best, second = top.iloc[0], top.iloc[1]
    growth = {name: second[f.replace("_time", "_s")] - best[f.replace("_time", "_s")]
              for f, name in _BREAKDOWN.items()}
    note = top["vs_best"].iloc[1]
    assert top["vs_best"].iloc[0] == "best"
    assert note.startswith(f"+{second['step_time_s'] - best['step_time_s']:.3f} s; ")
    assert note.split("; ", 1)[1].removeprefix("mostly ").startswith(
        max(growth, key=growth.get))
    assert (top["tp"] * top["pp"] * top["dp"] * top["cp"] == GPUS).all()
    assert "does not fit in HBM" in r["reasons"]
    # The table's reports (a separately compiled vmap with the model as a constant) agree with
    # the sweep's objective and with train_step called on each plan alone.
    best = r["result"].top_value[np.isfinite(r["result"].top_value)]
    assert np.allclose(top["step_time_s"].iloc[0], best[0], rtol=1e-6)
    for _, row in top.iterrows():
        plan = dp.TrainingPlan(**{k: int(row[k]) for k in (
            "tp", "pp", "dp", "cp", "ep", "vp", "micro_batch", "zero", "sequence_parallel",
            "flash_attention", "overlap_tp", "overlap_dp", "fp32_gradients", "offload_layers")},
            recompute=row["recompute"], precision=row["precision"], global_batch=GBS)
        alone = dp.train_step(model, system, plan, eff)
        assert np.isclose(float(alone.step_time), row["step_time_s"], rtol=1e-5)
        assert np.isclose(float(alone.memory.total) / 1e9, row["memory_gb"], rtol=1e-5)


@pytest.mark.slow
def test_search_skips_uneven_pipeline_layouts_unless_asked():
    """pp * vp must divide the layer count by default; with `even_layouts=False` exactly those
    plans come back (the model itself treats them as perfectly balanced)."""
    model, system = dp.model("gpt-7.5b"), dp.system("a100-sxm4-80gb")  # 36 layers
    grid = Grid({"tp": [8], "pp": [1, 2, 4, 8], "vp": [1, 2, 3], "micro_batch": [1],
                 "recompute": [1]})
    even = search_training(model, system, 64, 64, grid=grid, top_k=12, progress=False)
    loose = search_training(model, system, 64, 64, grid=grid, top_k=12, progress=False,
                            even_layouts=False)
    uneven = "pp * vp does not divide the layer count (uneven layout)"
    # uneven: pp 8 with any vp, pp 4 with vp 2 (36 layers)
    n_uneven = sum(1 for p in (1, 2, 4, 8) for v in (1, 2, 3) if 36 % (p * v))
    assert even["reasons"].get(uneven) == n_uneven and uneven not in loose["reasons"]
    assert loose["feasible"] - even["feasible"] == n_uneven
    top = even["top"]
    assert (36 % (top["pp"] * top["vp"]) == 0).all()
    assert (36 % (loose["top"]["pp"] * loose["top"]["vp"]) != 0).any()


_SHARDED = r"""
import json, jax, numpy as np, diffperf as dp
from diffperf.explore import Grid, plan_from_values, run_sweep
m, s, e = dp.model("gpt-7.5b"), dp.system("a100-sxm4-40gb"), dp.Efficiency()
grid = Grid({"tp": [1, 2, 4, 8], "pp": [1, 2, 4], "micro_batch": [1, 2, 4],
             "recompute": [0, 1, 2], "zero": [0, 1, 3], "vp": [1, 2], "flash_attention": [0, 1]})
def f(v):
    r = dp.train_step(m, s, plan_from_values(v, 32, 64), e)
    return r.step_time, r.memory.total, r.reason
one = run_sweep(grid, f, k=6, progress=False, devices=jax.devices()[:1])
four = run_sweep(grid, f, k=6, progress=False)
print(json.dumps({"devices": jax.device_count(),
                  "same_top": one.top_index.tolist() == four.top_index.tolist(),
                  "max_rel": float(np.max(np.abs(one.top_value - four.top_value) / one.top_value)),
                  "same_reasons": one.reasons.tolist() == four.reasons.tolist(),
                  "same_front": one.front_index.tolist() == four.front_index.tolist()}))
"""


def test_sharded_equals_unsharded():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    out = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["devices"] == 4
    assert r["same_top"] and r["same_reasons"] and r["same_front"]
    assert r["max_rel"] < 1e-6


def test_search_infer_meets_latency_target_and_front():
    from diffperf.explore import search_inference
    from diffperf.internal import latency_throughput_front as _latency_throughput_front
    df = search_inference(dp.model("llama2-7b"), dp.system("h100-sxm5-80gb"), 512, 64,
                          max_gpus=4)
    ok = df[df["feasible"]]
    assert len(ok) > 10 and (ok["tp"] * ok["pp"] <= 4).all()
    target = 2.0
    meets = ok[ok["e2e_latency_s"] <= target]
    best = meets.sort_values("output_tok_s_per_gpu").iloc[-1]
    assert best["e2e_latency_s"] <= target
    # nothing meeting the target has more throughput per GPU
    assert (meets["output_tok_s_per_gpu"] <= best["output_tok_s_per_gpu"] + 1e-9).all()
    front = ok.iloc[_latency_throughput_front(ok)]
    for _, p in front.iterrows():
        better = ok[(ok["e2e_latency_s"] < p["e2e_latency_s"])
                    & (ok["output_tok_s_per_gpu"] > p["output_tok_s_per_gpu"])]
        assert better.empty


def test_search_infer_per_head_decode_is_slower_for_gqa():
    """`search infer --per-head-decode`: a GQA model's decode attention runs on the CUDA cores
    (physical default efficiencies), so no plan gets faster and large batches get slower."""
    from diffperf.explore import search_inference
    args = (dp.model("mistral-7b"), dp.system("h100-sxm5-80gb"), 2048, 256)
    grouped = search_inference(*args, max_gpus=2, efficiency=dp.Efficiency())
    per_head = search_inference(*args, max_gpus=2, efficiency=dp.Efficiency(),
                                grouped_decode_attention=0)
    assert (per_head["tpot_s"] >= grouped["tpot_s"] * (1 - 1e-6)).all()
    assert (per_head["tpot_s"] > 1.1 * grouped["tpot_s"]).any()


@pytest.mark.slow
def test_search_infer_weight_only_on_a_gpu_without_narrow_tensor_cores(capsys):
    """A100 has no fp4 tensor cores: fp4 math is infeasible everywhere, but 4-bit weights with
    16-bit GEMMs (weight-only) are feasible, hold less memory than bf16 weights and decode
    faster at batch 1 (a quarter of the weight bytes to stream)."""
    from diffperf.cli import main
    from diffperf.explore import search_inference
    args = (dp.model("llama2-70b"), dp.system("a100-sxm4-80gb"), 512, 64)
    fp4 = search_inference(*args, max_gpus=4, precision="fp4")
    w4 = search_inference(*args, max_gpus=4, precision="fp4", activation_precision="bf16",
                          kv_precision="bf16")
    bf16 = search_inference(*args, max_gpus=4)
    assert not fp4["feasible"].any()
    assert (w4["memory_gb"] < bf16["memory_gb"]).all()
    one = (w4["batch"] == 1) & (w4["tp"] == 4) & (w4["pp"] == 1)
    assert (w4.loc[one, "tpot_s"] < bf16.loc[one, "tpot_s"]).all()
    code = main(["search", "infer", "--model", "llama2-70b", "--gpu", "a100-sxm4-80gb",
                 "--max-gpus", "4", "--input", "512", "--output", "64", "--precision", "int4",
                 "--activation-precision", "bf16", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] == int(w4["feasible"].sum())


_MULTIHOST = r"""
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
pid, port = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid)
""" + _SHARDED.split("one = run_sweep")[0] + r"""
res = run_sweep(grid, f, k=6, progress=False, max_block=64)
print(json.dumps({"procs": jax.process_count(), "top": res.top_index.tolist(),
                  "reasons": res.reasons.tolist(), "front": res.front_index.tolist()}))
"""


@pytest.mark.slow
def test_two_processes_with_jax_distributed_equal_one():
    """The multi-host path (jax.distributed on loopback, CPU collectives over gloo): two
    processes split the blocks, merge their reductions, and agree with a single process."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, "-c", _MULTIHOST, str(i), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    for r in results:
        assert r["procs"] == 2
        assert r == results[0]
    # the reference: one process, one device (from the sharded-test script's first sweep)
    ref = _single_reference(env)
    assert results[0]["top"] == ref["top"]
    assert results[0]["reasons"] == ref["reasons"]
    assert results[0]["front"] == ref["front"]


def _single_reference(env) -> dict:
    script = _SHARDED.split("one = run_sweep")[0] + r"""
res = run_sweep(grid, f, k=6, progress=False)
print(json.dumps({"top": res.top_index.tolist(), "reasons": res.reasons.tolist(),
                  "front": res.front_index.tolist()}))
"""
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_default_efficiency_built_inside_a_trace_does_not_leak_into_later_jits():
    """Regression: `train_step(..., efficiency=None)` builds the shipped efficiency while being
    traced; a cached object from that trace used to break the next compiled sweep."""
    from diffperf.explore import default_training_grid
    system = dp.system("a100-sxm4-80gb")
    jax.jit(dp.train_step)(dp.model("gpt3-175b"), system,
                           dp.TrainingPlan(tp=8, pp=1, dp=1, global_batch=8))
    model = dp.model("gpt-1.7b")
    grid = default_training_grid(model, 8, 32, precisions=(1,))
    r = search_training(model, system, 8, 32, grid=grid, top_k=2, progress=False)
    assert r["evaluated"] == grid.size and len(r["top"]) == 2


def test_search_reason_codes_extend_the_models_without_collision():
    """Search-only reason codes must not reuse a code of the model's own (`REASONS`): a
    histogram bin would then count two different failures under one message."""
    import inspect

    from diffperf.explore import run_sweep
    from diffperf.feasibility import REASONS
    from diffperf.internal import search as search
    codes = [search.REASON_GPUS, search.REASON_DUPLICATE, search.REASON_UNEVEN,
             search.REASON_OFFLOAD]
    assert len(set(codes)) == len(codes)
    assert not set(codes) & set(REASONS), (codes, sorted(REASONS))
    n_bins = inspect.signature(run_sweep).parameters["n_reasons"].default
    assert max(codes + list(REASONS)) < n_bins


def test_search_refuses_a_grid_with_bad_codes_before_sweeping():
    """A custom grid with recompute code 3 or an unknown axis used to be swept (the bad plans
    ranked as feasible) and then crash while describing the best plans."""
    import diffperf as dp
    args = (dp.model("llama3-8b"), dp.system("h100-sxm5-80gb"), 8, 64)
    for axes, text in (({"tp": [1, 2], "recompute": [0, 3]}, "grid axis 'recompute'"),
                       ({"zero": [1, 5]}, "grid axis 'zero'"),
                       ({"tpp": [1, 2]}, "grid axis 'tpp' is not a plan field")):
        with pytest.raises(ValueError, match=text):
            dp.search_training(*args, grid=dp.Grid(axes), progress=False)


def test_search_lists_the_leaner_of_two_equally_fast_plans_first():
    """With one micro-batch per step ZeRO-2 reduce-scatters as often as ZeRO-1 (once), so the
    two tie in step time; ZeRO-2 holds a shard of the gradients and must be listed first."""
    model, system = dp.model("gpt-7.5b"), dp.system("a100-sxm4-80gb")
    grid = Grid({"tp": [8], "pp": [1], "vp": [1], "micro_batch": [8], "recompute": [1],
                 "zero": [1, 2]})
    r = search_training(model, system, 64, 64, grid=grid, top_k=2, progress=False)
    top = r["top"]
    assert len(top) == 2
    assert np.isclose(top["step_time_s"].iloc[0], top["step_time_s"].iloc[1], rtol=1e-6)
    assert list(top["zero"]) == [2, 1]
    assert top["memory_gb"].iloc[0] < top["memory_gb"].iloc[1]
