"""Shapley attribution of the A100 -> B200 speed-up: efficiency axiom and consistency."""

import math

import numpy as np
import pytest

from diffperf.explore import Grid
from diffperf.internal import attribution as A
from diffperf.presets import model, system


def test_shapley_of_an_additive_game_is_each_players_value():
    F = 4
    masks = np.array([[(i >> k) & 1 for k in range(F)] for i in range(2 ** F)], bool)
    w = np.array([0.5, -0.2, 1.0, 0.0])
    phi = A.shapley(masks, masks @ w)
    assert np.allclose(phi, w)


def test_shapley_splits_a_pure_interaction_equally():
    masks = np.array([[0, 0], [0, 1], [1, 0], [1, 1]], bool)
    phi = A.shapley(masks, np.array([0.0, 0.0, 0.0, 1.0]))
    assert np.allclose(phi, [0.5, 0.5])


@pytest.fixture(scope="module")
def a100_to_b200():
    m = model("gpt3-175b")
    grid = Grid({"tp": [4, 8], "pp": [8, 16], "vp": [1, 3], "micro_batch": [1],
                 "recompute": [0, 1]})
    return A.attribute(m, system("dgx-a100"), system("dgx-b200"), 1024, 1536,
                       target_precision="fp8", grid=grid)


def test_attribution_sums_to_total_log_speedup(a100_to_b200):
    r = a100_to_b200
    total = sum(f["shapley_log"] for f in r["factors"].values())
    assert math.isclose(total, r["log_speedup"], rel_tol=1e-6, abs_tol=1e-9)
    assert math.isclose(math.exp(r["log_speedup"]), r["speedup"], rel_tol=1e-6)
    prod = np.prod([f["speedup"] for f in r["factors"].values()])
    assert math.isclose(prod, r["speedup"], rel_tol=1e-5)


def test_attribution_is_dominated_by_compute_and_precision(a100_to_b200):
    f = a100_to_b200["factors"]
    assert r_speed(a100_to_b200) > 3.0
    assert f["tensor_flops"]["speedup"] > 2.0 and f["precision"]["speedup"] > 1.2
    # the NVLink domain is 8 on both systems: a null player gets exactly zero
    assert f["nvlink_domain"]["shapley_log"] == pytest.approx(0.0, abs=1e-9)


def r_speed(r):
    return r["speedup"]


def test_moe_candidates_include_expert_parallelism():
    """A MoE model's candidate plans also vary ep (powers of two dividing the expert count),
    so a coalition's best plan can use expert parallelism; a dense model's grid has no ep."""
    moe = A.candidate_plans(model("mixtral-8x7b"), 64, 512)
    assert list(moe.axes["ep"]) == [1, 2, 4, 8]
    assert "ep" not in A.candidate_plans(model("gpt3-175b"), 64, 512).axes


def test_inference_attribution_multiplies_to_the_total_and_matches_a_single_swap():
    """Llama-2 70B batch-1 decode, A100 -> B200 in fp8: the Shapley factors multiply to the
    end-to-end speed-up, and `hbm_bandwidth` alone equals the latency ratio of the base system
    with only its HBM bandwidth replaced by the target's (built here independently)."""
    import equinox as eqx

    import diffperf as dp
    from diffperf.presets import default_efficiency
    m, base, tgt = model("llama2-70b"), system("dgx-a100"), system("dgx-b200")
    plan = dp.InferencePlan(tp=8, batch=1, input_len=128, output_len=128)
    r = A.attribute_inference(m, base, tgt, plan, target_precision="fp8")
    prod = math.prod(f["speedup"] for f in r["factors"].values())
    assert prod == pytest.approx(r["speedup"], rel=1e-5)
    assert r["speedup"] > 1.5 and r["factors"]["hbm_bandwidth"]["speedup"] > 1.2
    swapped = eqx.tree_at(lambda s: s.accelerator.hbm_bandwidth, base,
                          tgt.accelerator.hbm_bandwidth)
    eff = default_efficiency()
    t0 = float(dp.infer(m, base, plan, eff).e2e_latency)
    t1 = float(dp.infer(m, swapped, plan, eff).e2e_latency)
    assert r["factors"]["hbm_bandwidth"]["alone"] == pytest.approx(t0 / t1, rel=1e-5)
    assert r["base_e2e_s"] == pytest.approx(t0, rel=1e-5)


def test_inference_attribution_cli(capsys):
    from diffperf.cli import main
    assert main(["attribution", "--workload", "infer", "--targets", "dgx-h100"]) == 0
    out = capsys.readouterr().out
    assert "llama2-70b inference" in out and "hbm_bandwidth" in out and "TPOT base/tgt" in out
    assert main(["attribution", "--workload", "infer", "--plot", "x.png"]) == 2
    assert "--plot is for --workload train" in capsys.readouterr().err


def test_inference_attribution_names_an_infeasible_plan():
    import diffperf as dp
    with pytest.raises(ValueError, match="infeasible on the base system: tp does not divide"):
        A.attribute_inference(model("llama2-70b"), system("dgx-a100"), system("dgx-h100"),
                              dp.InferencePlan(tp=3, batch=1))


def test_inference_attribution_carries_the_target_host_cpu():
    """B200 -> GB200 with TensorRT-LLM's runtime at 512 sequences (host-bound on Grace): the
    all-factors coalition is `infer` on the target itself (its Grace host_time_factor
    included), and the host CPU factor is a slowdown; with the default runtime (no host
    times) it is exactly 1x."""
    import diffperf as dp
    from diffperf.presets import default_efficiency, runtime
    m, base, tgt = model("llama3-8b"), system("dgx-b200"), system("gb200-nvl72")
    plan = dp.InferencePlan(tp=1, batch=512, input_len=128, output_len=64)
    rt = runtime("trtllm")
    r = A.attribute_inference(m, base, tgt, plan, target_precision="bf16", runtime=rt)
    want = dp.infer(m, tgt, plan, default_efficiency(), rt).e2e_latency
    assert r["target_e2e_s"] == pytest.approx(float(want), rel=1e-5)
    assert r["coalitions"] == 32
    assert r["factors"]["host_cpu"]["speedup"] < 0.9
    plain = A.attribute_inference(m, base, tgt, plan, target_precision="bf16")
    assert plain["factors"]["host_cpu"]["speedup"] == pytest.approx(1.0, abs=1e-6)
