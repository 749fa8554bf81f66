"""`diffperf serve`: one deployment under load, its JSON, the SLO search and bad input."""

from __future__ import annotations

import json

import pytest
from cli_run import run

BASE = ("serve", "--model", "llama3-8b", "--gpu", "h100-sxm5-80gb", "--num-requests", "60",
        "--input", "300", "--output", "40", "--engine", "vllm")


def test_serve_json_is_consistent(capsys):
    code, out, err = run(capsys, *BASE, "--rate", "5", "--json")
    assert code == 0, err
    s = json.loads(out)
    ttft, tpot = s["ttft_ms"], s["tpot_ms"]
    assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"]
    assert 0 < tpot["p50"] <= tpot["p90"] <= tpot["p99"]
    # light load (5 req/s against thousands of tokens/s): the output rate follows the offered
    # 5 x 40 tokens/s, within the Poisson sample's spread over 60 requests
    assert 100 < s["output_tok_s"] < 400
    assert s["engine"]["max_num_seqs"] == 1024  # vLLM V1's default on an H100
    # cost = price x GPUs / tokens per s
    want = s["price_per_gpu_hour_usd"] / 3600 / s["output_tok_s"] * 1e6
    assert s["cost_per_million_tokens_usd"] == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_more_load_queues_more(capsys):
    """At a rate beyond what one GPU sustains, the queue and TTFT grow; in the closed loop at
    concurrency 1 no request ever queues."""
    _, light, _ = run(capsys, *BASE, "--rate", "2", "--json")
    _, heavy, _ = run(capsys, *BASE, "--rate", "1000", "--json")
    light, heavy = json.loads(light), json.loads(heavy)
    assert heavy["ttft_ms"]["p90"] > 3 * light["ttft_ms"]["p90"]
    assert heavy["tpot_ms"]["mean"] > light["tpot_ms"]["mean"]  # bigger batches
    code, one, err = run(capsys, *BASE, "--concurrency", "1", "--json")
    assert code == 0, err
    assert json.loads(one)["queue_ms"]["p99"] == 0.0


def test_text_report(capsys):
    code, out, err = run(capsys, *BASE, "--rate", "5")
    assert code == 0, err
    assert "TTFT" in out and "per million output tokens" in out


@pytest.mark.slow
def test_slo_search_picks_fewest_gpus_meeting_targets(capsys):
    code, out, err = run(capsys, *BASE, "--rate", "20", "--slo",
                         "ttft_p90=0.5,tpot_p90=0.05", "--max-gpus", "4", "--json")
    assert code == 0, err
    r = json.loads(out)
    best = r["best"]
    assert best is not None and best["meets"]
    assert best["ttft_p90_ms"] <= 500 and best["tpot_p90_ms"] <= 50
    fewer = [c for c in r["candidates"] if c["meets"] and c["num_gpus"] < best["num_gpus"]]
    assert not fewer


@pytest.mark.parametrize("argv,needle", [
    (("--rate", "0"), "--rate"),
    (("--num-requests", "0"), "--num-requests"),
    (("--rate", "5", "--concurrency", "4"), "exclude each other"),
    (("--slo", "ttft_p90=x"), "not a number"),
    (("--slo", "latency=1"), "METRIC=SECONDS"),
    (("--rate", "5", "--slo", "ttft_p90=-1"), "> 0 s"),
    (("--slo", "ttft_p90=1"), "finite --rate"),
    (("--power", "700,100"), "--power"),
    (("--price-per-hour", "-1"), "--price-per-hour"),
    (("--max-num-seqs", "0"), "--max-num-seqs"),
    (("--input", "20000", "--chunked-prefill", "off"), "chunked_prefill is off"),
    (("--engine", "nope"), "nope"),
    (("--kv-cache-tokens", "-5"), "--kv-cache-tokens"),
    (("--kv-cache-tokens", "10000000"), "kv_cache_tokens 1e+07 does not fit"),
])
def test_bad_input_one_line_error(capsys, argv, needle):
    code, out, err = run(capsys, *BASE, *argv)
    assert code == 2
    lines = [x for x in err.strip().splitlines() if x]
    assert len(lines) == 1 and needle in lines[0], err


def test_overload_is_flagged(capsys):
    """Offered 100 req/s of 1,000 + 200 tokens to one H100 (it sustains about 25): the note
    says the backlog grows; at 5 req/s it does not appear."""
    argv = ("serve", "--model", "llama3-8b", "--gpu", "h100-sxm5-80gb", "--num-requests",
            "300", "--input", "1000", "--output", "200")
    code, _, err = run(capsys, *argv, "--rate", "100")
    assert code == 0 and "backlog grows" in err
    code, _, err = run(capsys, *argv, "--rate", "5")
    assert code == 0 and "backlog" not in err


def test_goodput(capsys):
    """Goodput counts the requests meeting their own targets: loose targets keep every request
    (goodput = the request rate), a TTFT target below any prefill's time keeps none."""
    code, out, err = run(capsys, *BASE, "--rate", "5", "--goodput", "100,100", "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["slo_attainment"] == 1.0
    assert s["goodput_rps"] == pytest.approx(s["request_rate"], rel=1e-6)
    _, out, _ = run(capsys, *BASE, "--rate", "5", "--goodput", "1e-6,100", "--json")
    s = json.loads(out)
    assert s["slo_attainment"] == 0.0 and s["goodput_rps"] == 0.0
    code, _, err = run(capsys, *BASE, "--goodput", "0,1")
    assert code == 2 and "--goodput" in err


@pytest.mark.slow
def test_trtllm_bench_limits_let_a_budget_long_prompt_run_beside_decodes(capsys):
    """8,192-token prompts on TensorRT-LLM without chunked prefill: with the preset's 8,192-
    token budget a prompt never fits next to a decoding request, so requests run one at a
    time; trtllm-bench's own limits (the budget >= the longest prompt + max_batch_size) batch
    them. The limits in the report are the function's."""
    import diffperf as dp
    from diffperf.serving import trtllm_bench_engine_limits

    args = ("serve", "--model", "qwen3-30b-a3b", "--gpu", "b200", "--precision", "fp4",
            "--kv-precision", "fp8", "--input", "8192", "--output", "256", "--num-requests",
            "64", "--json")
    code, out, err = run(capsys, *args)
    assert code == 0, err
    preset = json.loads(out)
    code, out, err = run(capsys, *args, "--trtllm-bench-limits")
    assert code == 0, err
    sized = json.loads(out)
    assert "trtllm-bench limits" in err
    want = trtllm_bench_engine_limits(
        dp.model("qwen3-30b-a3b"), dp.system("b200").accelerator, tp=1, pp=1,
        weight_precision="fp4", kv_precision="fp8", isl=8192, osl=256, max_isl=8192,
        kv_fraction=float(sized["engine"]["kv_memory_fraction"]))
    assert (sized["engine"]["max_num_seqs"], sized["engine"]["max_num_batched_tokens"]) == want
    assert want[1] >= 8192 + want[0]
    assert preset["engine"]["max_num_batched_tokens"] == 8192
    assert sized["output_tok_s"] > 3 * preset["output_tok_s"]
    # explicit limits win
    code, out, err = run(capsys, *args, "--trtllm-bench-limits", "--max-num-seqs", "16")
    assert code == 0, err
    assert json.loads(out)["engine"]["max_num_seqs"] == 16


def test_fp8_weights_keep_a_bf16_cache_on_vllm_and_sglang(capsys):
    """vLLM's and SGLang's default KV-cache dtype is the model's (bf16) with fp8 weights: a
    note says so; --kv-precision fp8 gives the fp8 cache, which holds about twice the tokens;
    TensorRT-LLM follows --precision."""
    fp8 = BASE + ("--precision", "fp8", "--rate", "5")
    code, out, err = run(capsys, *fp8, "--json")
    assert code == 0, err
    bf16_kv = json.loads(out)["kv_capacity_tokens"]
    code, out, err = run(capsys, *fp8)
    assert code == 0 and "KV cache in bf16" in err
    code, out, err = run(capsys, *fp8, "--kv-precision", "fp8", "--json")
    assert code == 0, err
    fp8_kv = json.loads(out)["kv_capacity_tokens"]
    assert 1.9 < fp8_kv / bf16_kv < 2.1  # one byte a value instead of two
    trt = tuple("trtllm" if a == "vllm" else a for a in fp8)
    code, out, err = run(capsys, *trt)
    assert code == 0 and "KV cache in bf16" not in err



@pytest.mark.slow
def test_grace_host_makes_a_host_bound_deployment_slower_than_b200(capsys):
    """400 short requests at once on TensorRT-LLM: a step of ~400 sequences spends 12.5 us of
    host time per sequence on an x86 B200 host and 2.75x that on GB200's Grace CPU, which the
    report names; the GB200 step is then the host's, slower than B200's although its GPU is
    faster (NVIDIA's Qwen3-30B-A3B 1k / 1k tables show GB200 below B200)."""
    args = ("serve", "--model", "llama3-8b", "--engine", "trtllm", "--num-requests", "400",
            "--input", "128", "--output", "64")
    code, text, err = run(capsys, *args, "--gpu", "gb200")
    assert code == 0, err
    assert "host CPU times x2.75: host_time_factor" in text.splitlines()[0]
    _, grace, _ = run(capsys, *args, "--gpu", "gb200", "--json")
    _, x86, _ = run(capsys, *args, "--gpu", "b200", "--json")
    grace, x86 = json.loads(grace), json.loads(x86)
    assert grace["host_time_factor"] == 2.75 and x86["host_time_factor"] == 1.0
    assert grace["tpot_ms"]["mean"] > 1.3 * x86["tpot_ms"]["mean"]
    assert grace["output_tok_s"] < x86["output_tok_s"]


def test_context_pass_and_kv_cache_tokens(capsys):
    """`--context-pass on` (TurboMind v0.1): at one client with short prompts, the first token
    waits for a context pass and a decode pass, each reading the weights, so TTFT grows by
    about a decode step (TPOT unchanged: decode-only iterations are one pass either way);
    `--kv-cache-tokens` sets the cache the report and JSON give."""
    args = ("serve", "--model", "llama2-7b", "--gpu", "a100-sxm4-80gb", "--num-requests", "8",
            "--input", "128", "--output", "32", "--concurrency", "1", "--json")
    _, off, _ = run(capsys, *args)
    code, on, err = run(capsys, *args, "--context-pass", "on", "--kv-cache-tokens", "128000")
    assert code == 0, err
    off, on = json.loads(off), json.loads(on)
    assert on["engine"]["context_pass"] == 1.0 and off["engine"]["context_pass"] == 0.0
    assert on["kv_capacity_tokens"] == 128000
    step = off["tpot_ms"]["mean"]
    assert on["tpot_ms"]["mean"] == pytest.approx(step, rel=1e-3)
    assert 0.7 * step < on["ttft_ms"]["mean"] - off["ttft_ms"]["mean"] < 1.3 * step
