"""Expert parallelism in inference (`InferencePlan.ep`): the experts of a MoE layer split into
ep groups within the tp GPUs, TensorRT-LLM style (moe_ep_size x moe_tp_size = tp)."""

from __future__ import annotations

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffperf as dp
from diffperf.cli import main
from diffperf.inference import busiest_gpu_experts, experts_touched

H100 = dp.system("h100-sxm5-80gb")


def _monte_carlo_busiest(experts: int, top_k: int, tokens: int, ep: int, trials: int,
                         seed: int) -> float:
    """Mean over trials of the most distinct experts one of `ep` contiguous groups runs when
    `tokens` tokens each pick `top_k` distinct experts uniformly at random."""
    rng = np.random.default_rng(seed)
    best = []
    for _ in range(trials):
        picked = np.zeros(experts, bool)
        for _ in range(tokens):
            picked[rng.choice(experts, top_k, replace=False)] = True
        best.append(picked.reshape(ep, -1).sum(axis=1).max())
    return float(np.mean(best))


@pytest.mark.parametrize("name, tokens, ep", [
    ("mixtral-8x7b", 1, 2), ("mixtral-8x7b", 1, 4), ("mixtral-8x7b", 4, 2),
    ("mixtral-8x7b", 1, 8), ("deepseek-v3", 1, 8), ("deepseek-v3", 4, 4),
    ("deepseek-v3", 16, 8), ("deepseek-v3", 64, 2)])
def test_busiest_gpu_experts_matches_a_simulation_of_uniform_routing(name, tokens, ep):
    model = dp.model(name)
    e, k = int(model.num_experts), int(model.experts_per_token)
    simulated = _monte_carlo_busiest(e, k, tokens, ep, trials=600, seed=tokens * 100 + ep)
    approx = float(busiest_gpu_experts(model, float(tokens), float(ep)))
    assert approx == pytest.approx(simulated, rel=0.08)


@pytest.mark.parametrize("n", [1, 2, 3, 8, 24, 64, 256])
def test_expected_maximum_of_normals_matches_numerical_integration(n):
    from diffperf.inference import expected_max_of_normals
    x = np.linspace(-10.0, 10.0, 200_001)
    pdf = np.exp(-0.5 * x * x) / np.sqrt(2.0 * np.pi)
    cdf = np.cumsum(pdf) * (x[1] - x[0])
    exact = np.trapezoid(x * n * pdf * cdf ** (n - 1), x)
    assert float(expected_max_of_normals(float(n))) == pytest.approx(exact, abs=2e-3)


def test_one_expert_group_is_exactly_the_touched_experts():
    for name in ("mixtral-8x7b", "deepseek-v3", "llama2-7b"):
        model = dp.model(name)
        for tokens in (1.0, 7.0, 300.0, 1e5):
            assert float(busiest_gpu_experts(model, tokens, 1.0)) == float(
                experts_touched(model, tokens))


def test_batch_one_decode_is_slower_with_more_expert_parallelism():
    """At one token two Mixtral experts run: split over 8 GPUs each GPU reads a quarter of
    them; with one expert per GPU the busiest reads a whole expert, four times as much."""
    model = dp.model("mixtral-8x7b")
    tpots = [float(dp.infer(model, H100, dp.InferencePlan(tp=8, ep=ep, batch=1)).tpot)
             for ep in (1, 2, 4, 8)]
    assert tpots == sorted(tpots) and tpots[-1] > 1.2 * tpots[0]


def test_large_prefill_is_not_slower_with_expert_parallelism():
    """When every expert gets tokens, each GPU reads the same weight bytes whatever ep is, and
    its expert GEMMs only get wider: a long prefill cannot get slower."""
    model = dp.model("mixtral-8x7b")
    ttft = {ep: float(dp.infer(model, H100, dp.InferencePlan(
        tp=8, ep=ep, batch=16, input_len=2048, output_len=1)).ttft) for ep in (1, 8)}
    assert ttft[8] <= ttft[1]


def test_expert_parallelism_leaves_a_dense_model_alone():
    """ep only regroups experts: on a dense model a (traced) ep changes nothing, not even the
    gradient, and the plan is refused as reason 8."""
    model = dp.model("llama2-7b")
    tpot = lambda ep: dp.infer(model, H100, dp.InferencePlan(tp=2, ep=ep, batch=4)).tpot  # noqa
    assert float(tpot(2.0)) == float(tpot(1.0))
    assert float(jax.grad(tpot)(1.0)) == 0.0
    assert int(dp.infer(model, H100, dp.InferencePlan(tp=2, ep=2, batch=4)).reason) == 8


def test_bad_expert_parallel_degrees_are_reason_8():
    mixtral, llama = dp.model("mixtral-8x7b"), dp.model("llama2-7b")
    for model, tp, ep in ((mixtral, 8, 3), (mixtral, 4, 8), (llama, 2, 2)):
        r = dp.infer(model, H100, dp.InferencePlan(tp=tp, ep=ep))
        assert int(r.reason) == 8, (tp, ep)
    with pytest.raises(ValueError, match="InferencePlan.ep must be a whole number"):
        dp.InferencePlan(ep=0)


def test_vmap_over_ep_equals_a_loop_and_gradients_are_finite():
    model = dp.model("deepseek-v3")
    eps = jnp.array([1.0, 2.0, 4.0, 8.0])

    def tpot(ep, hbm):
        s = eqx.tree_at(lambda t: t.accelerator.hbm_bandwidth, H100, hbm)
        return dp.infer(model, s, dp.InferencePlan(tp=8, pp=2, ep=ep, batch=4,
                                                   weight_precision="fp8")).tpot

    hbm = H100.accelerator.hbm_bandwidth
    batched = jax.jit(jax.vmap(tpot, in_axes=(0, None)))(eps, hbm)
    looped = [float(tpot(e, hbm)) for e in eps]
    np.testing.assert_allclose(np.asarray(batched), looped, rtol=1e-5)
    grads = jax.vmap(jax.grad(tpot, argnums=(0, 1)), in_axes=(0, None))(eps, hbm)
    assert np.isfinite(np.asarray(grads[0])).all() and np.isfinite(np.asarray(grads[1])).all()
    assert (np.asarray(grads[1]) < 0).all()  # more bandwidth is faster


def test_infer_command_takes_ep_and_names_a_bad_one(capsys):
    code = main(["infer", "--model", "mixtral-8x7b", "--gpu", "h100-sxm5-80gb", "--tp", "8",
                 "--ep", "4", "--json"])
    out = capsys.readouterr()
    r = json.loads(out.out)
    ref = dp.infer(dp.model("mixtral-8x7b"), H100, dp.InferencePlan(tp=8, ep=4),
                   dp.default_efficiency("h100-sxm5-80gb"))
    assert code == 0 and r["tpot_s"] == pytest.approx(float(ref.tpot), rel=1e-6)
    code = main(["infer", "--model", "mixtral-8x7b", "--gpu", "h100-sxm5-80gb", "--tp", "8",
                 "--ep", "3"])
    err = capsys.readouterr().err
    assert code == 2 and "ep=3, num_experts=8, tp=8" in err and "Traceback" not in err


def test_csv_rows_read_an_optional_ep_column(tmp_path):
    from diffperf.validation import predict_infer_rows, read_benchmarks
    header = ("id,kind,source,model,layers,hidden,heads,kv_heads,ffn_hidden,vocab,gated_mlp,"
              "num_experts,experts_per_token,gpu,num_gpus,gpus_per_node,tp,pp,precision,batch,"
              "input_len,output_len,ep,tpot_s\n")
    row = ("{id},infer,test,Mixtral,32,4096,32,8,14336,32000,1,8,2,h100-sxm5-80gb,8,8,8,1,bf16,"
           "1,128,128,{ep},0.01\n")
    path = tmp_path / "ep.csv"
    path.write_text(header + row.format(id="tp", ep="") + row.format(id="ep8", ep=8))
    preds, failed = predict_infer_rows(read_benchmarks(path))
    assert not failed
    tpot = {r.id: p["tpot_s"] for r, p, _ in preds}
    direct = dp.infer(dp.model("mixtral-8x7b"), H100, dp.InferencePlan(tp=8, ep=8)).tpot
    assert tpot["ep8"] > 1.2 * tpot["tp"]
    assert tpot["ep8"] == pytest.approx(float(direct), rel=0.02)  # preset vs row's model


@pytest.mark.slow
def test_search_infer_sweeps_ep_for_moe_models_only(capsys):
    code = main(["search", "infer", "--model", "mixtral-8x7b", "--max-gpus", "4", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["gpu"] == "h100-sxm5-80gb"
    plans = r["top"] + r["pareto_latency_vs_throughput"]
    assert plans and all(p["tp"] % p["ep"] == 0 for p in plans)
    assert "ep [1, 2, 4]" in r["grid"]
    code = main(["search", "infer", "--model", "llama2-7b", "--max-gpus", "2", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and "ep" not in r["grid"] and all(p["ep"] == 1 for p in r["top"])
