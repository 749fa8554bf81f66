"""The SLO search over disaggregated (xPyD) deployments: every pool pair enumerated once, the
decoupled pools against the coupled simulation, and disaggregation chosen exactly where
prefill interference breaks an aggregated replica's TPOT target."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_run import run

from diffperf import presets
from diffperf.serving import Traffic, requests, serve_disaggregated, slo_search
from diffperf.serving._disaggregated_search import disaggregated_candidates
from diffperf.specs import Engine, InferencePlan

MODEL, SYSTEM = presets.model("llama3-8b"), presets.system("h100-sxm5-80gb")
ENGINE = Engine(max_num_seqs=64, max_num_batched_tokens=8192)
# long prompts, short answers, at a rate one H100 sustains: chunks of 4,000-token prompts
# share iterations with the decodes of an aggregated replica
TRAFFIC = Traffic(rate=6.0, num_requests=60, input_len=4000, output_len=60)


def _candidates(max_gpus=4):
    arrival, inp, out = requests(TRAFFIC)
    eff = presets.resolve_efficiency(None)
    return disaggregated_candidates(MODEL, SYSTEM, InferencePlan(), ENGINE, arrival, inp, out,
                                    [1, 2], (1, 2, 3), (16, 64), max_gpus, eff, None)


@pytest.mark.slow
def test_every_pool_pair_once_within_the_gpu_limit():
    rows = _candidates(max_gpus=4)
    keys = [(r["prefill_tp"], r["prefill_replicas"], r["decode_tp"], r["max_num_seqs"],
             r["decode_replicas"]) for r in rows]
    want = [(tp, x, td, s, y) for tp in (1, 2) for x in (1, 2, 3) for td in (1, 2)
            for s in (16, 64) for y in (1, 2, 3) if x * tp + y * td <= 4]
    assert sorted(keys) == sorted(want)
    for r in rows:
        assert r["num_gpus"] == r["prefill_replicas"] * r["prefill_tp"] + \
            r["decode_replicas"] * r["decode_tp"]
        assert r["ttft_p50_ms"] <= r["ttft_p90_ms"] <= r["ttft_p99_ms"]
        assert r["tpot_p50_ms"] <= r["tpot_p90_ms"] <= r["tpot_p99_ms"]
        # e2e of a request = TTFT + transfer + decode, so it exceeds its TTFT by at least the
        # (output - 1) tokens' TPOT: compare the means
        assert r["e2e_mean_ms"] == pytest.approx(
            r["ttft_mean_ms"] + 59 * r["tpot_mean_ms"], rel=1e-4)  # ms rounded to 3 places
        # 4 GPUs fit in one NVLink domain of 8: the KV moves over NVLink
        assert r["link"] == "NVLink"


@pytest.mark.slow
def test_one_prefill_replica_matches_the_coupled_simulation():
    """With x = 1 the prefill pool sees the traffic's own stream in both simulations: the
    TTFTs agree exactly (the search's prefill slots never bind); with y = 1 the decode pool
    differs only by its arrival times (each request's arrival in the decoupled search, its
    transfer's end in the coupled one), so the TPOTs agree closely at this load."""
    rows = [r for r in _candidates(max_gpus=2) if r["prefill_tp"] == 1
            and r["decode_tp"] == 1 and r["max_num_seqs"] == 64]
    assert len(rows) == 1
    r = rows[0]
    coupled = serve_disaggregated(MODEL, SYSTEM, InferencePlan(), InferencePlan(), ENGINE,
                                  ENGINE, TRAFFIC, 1, 1)["report"]
    for s in ("mean", "p50", "p90", "p99"):
        assert r[f"ttft_{s}_ms"] == pytest.approx(1e3 * float(getattr(coupled.ttft, s)),
                                                  rel=1e-4)
    assert r["tpot_p50_ms"] == pytest.approx(1e3 * float(coupled.tpot.p50), rel=0.05)
    assert r["output_tok_s"] == pytest.approx(float(coupled.output_tok_s), rel=0.05)


@pytest.mark.slow
def test_tight_tpot_target_chooses_disaggregation():
    """A TPOT target below what any aggregated deployment of at most 2 GPUs gives while
    prompts are chunked into its iterations, but above a decode-only replica's: the search
    picks a 1P1D pair, verified by the coupled simulation; the aggregated-only search finds
    nothing."""
    slo_loose = {"ttft_p90": 10.0, "tpot_p90": 10.0}
    loose = slo_search(MODEL, SYSTEM, InferencePlan(), ENGINE, TRAFFIC, slo_loose,
                       max_gpus=2, disaggregated=False)
    agg_tpot = min(c["tpot_p90_ms"] for c in loose["candidates"] if c["fits"])
    dis_tpot = min(c["tpot_p90_ms"] for c in _candidates(max_gpus=2) if c["fits"])
    assert dis_tpot < 0.8 * agg_tpot  # prefill interference, removed by disaggregation
    target = 0.5 * (agg_tpot + dis_tpot) / 1e3
    slo = {"ttft_p90": 10.0, "tpot_p90": target}
    best = slo_search(MODEL, SYSTEM, InferencePlan(), ENGINE, TRAFFIC, slo, max_gpus=2)["best"]
    assert best["mode"] == "disaggregated" and best["num_gpus"] == 2 and best["verified"]
    assert best["coupled"]["tpot_p90_ms"] <= 1e3 * target
    agg = slo_search(MODEL, SYSTEM, InferencePlan(), ENGINE, TRAFFIC, slo, max_gpus=2,
                     disaggregated=False)["best"]
    assert agg is None


def test_cli_options(capsys):
    base = ("serve", "--model", "llama3-8b", "--gpu", "h100-sxm5-80gb", "--rate", "5",
            "--num-requests", "20")
    code, _, err = run(capsys, *base, "--aggregated-only")
    assert code == 2 and "--aggregated-only goes with --slo" in err
    code, _, err = run(capsys, *base, "--slo", "ttft_p90=1", "--disaggregated", "1P1D")
    assert code == 2 and "drop --disaggregated" in err


@pytest.mark.slow
def test_cli_json_names_the_mode(capsys):
    code, out, err = run(capsys, "serve", "--model", "llama3-8b", "--gpu", "h100-sxm5-80gb",
                         "--rate", "6", "--num-requests", "40", "--input", "4000", "--output",
                         "60", "--slo", "ttft_p90=1,tpot_p90=1", "--max-gpus", "2", "--json")
    assert code == 0, err
    r = json.loads(out)
    modes = {c["mode"] for c in r["candidates"]}
    assert modes == {"aggregated", "disaggregated"}
    assert np.isfinite([c["tpot_p90_ms"] for c in r["candidates"]]).all()
