"""Disaggregated prefill / decode (xPyD): a lone request's times by hand, the KV transfer by
hand, more prefill replicas never slower, and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_run import run

from diffperf import presets
from diffperf.inference import iteration_cost, iteration_time, kv_bytes_per_token
from diffperf.serving import kv_transfer_time, serve_disaggregated
from diffperf.specs import Engine, InferencePlan

MODEL, SYSTEM = presets.model("llama3-8b"), presets.system("h100-sxm5-80gb")
ENGINE = Engine(max_num_seqs=16, max_num_batched_tokens=4096)


def test_kv_transfer_by_hand():
    plan = InferencePlan(tp=2)
    # Llama 3 8B: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 B = 131,072 B per token (all
    # GPUs); per GPU at tp 2 half of it
    assert float(kv_bytes_per_token(MODEL, plan)) == 32 * 4 * 128 * 2 * 2
    net = SYSTEM.network
    t = float(kv_transfer_time(MODEL, SYSTEM, plan, InferencePlan(tp=1), 1000.0, True))
    want = float(net.nvlink_latency) + 1000 * 131072 / (1 * float(net.nvlink_bandwidth))
    assert t == pytest.approx(want, rel=1e-5)
    rdma = float(kv_transfer_time(MODEL, SYSTEM, plan, plan, 1000.0, False))
    assert rdma == pytest.approx(float(net.scaleout_latency)
                                 + 1000 * 131072 / (2 * float(net.scaleout_bandwidth)), rel=1e-5)


def test_lone_requests_by_hand():
    """Requests 100 s apart never meet: TTFT = one prefill iteration of the prompt, and each
    later token one decode iteration at its context (after the transfer)."""
    plan = InferencePlan(tp=1, input_len=500, output_len=11)
    arrival = np.array([0.0, 100.0, 200.0])
    inp, out = np.full(3, 500.0), np.full(3, 11.0)
    r = serve_disaggregated(MODEL, SYSTEM, plan, plan, ENGINE, ENGINE, (arrival, inp, out), 1, 1)
    rep = r["report"]
    cost = iteration_cost(MODEL, SYSTEM, plan, 4096.0)
    ttft = float(iteration_time(cost, 500.0, 1.0, 0.0, 0.5 * 500 * 500, 1.0))
    decode = sum(float(iteration_time(cost, 1.0, 1.0, 500.0 + g, 0.0, 0.0)) for g in range(1, 11))
    assert float(rep.ttft.mean) == pytest.approx(ttft, rel=1e-4)
    assert float(rep.tpot.mean) == pytest.approx((r["kv_transfer_s"] + decode) / 10, rel=1e-4)
    assert r["link"] == "NVLink"


@pytest.mark.slow
def test_more_prefill_replicas_never_slower():
    plan = InferencePlan(tp=1)
    rng = np.random.default_rng(0)
    arrival = np.cumsum(rng.exponential(1 / 30.0, 240))
    arrival -= arrival[0]
    inp, out = np.full(240, 3000.0), np.full(240, 50.0)
    p90 = [float(serve_disaggregated(MODEL, SYSTEM, plan, plan, ENGINE, ENGINE,
                                     (arrival, inp, out), x, 1)["report"].ttft.p90)
           for x in (1, 2, 4)]
    assert p90[0] > p90[1] > p90[2]


def test_cli_disaggregated(capsys):
    code, out, err = run(capsys, "serve", "--model", "llama3-8b", "--gpu", "h100-sxm5-80gb",
                         "--rate", "4", "--num-requests", "40", "--input", "800", "--output",
                         "30", "--disaggregated", "2P1D", "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["disaggregated"]["prefill_replicas"] == 2 and s["num_gpus"] == 3


@pytest.mark.parametrize("value", ["2P", "0P1D", "P1D", "1x1"])
def test_cli_bad_xpyd(capsys, value):
    code, _, err = run(capsys, "serve", "--disaggregated", value, "--num-requests", "10")
    assert code == 2 and "--disaggregated" in err and len(err.strip().splitlines()) == 1
