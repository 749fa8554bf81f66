"""Chunked prefill (`InferencePlan.prefill_tokens`): one forward pass holds the activations of
at most that many prompt tokens, which bounds inference memory and raises the max batch; the
time model is unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest

import diffperf as dp
from diffperf.cli import main
from diffperf.inference import infer, inference_memory, max_batch
from diffperf.validation import BenchmarkError, infer_specs, read_benchmarks


def _plan(**kw):
    base = dict(tp=1, batch=418, input_len=128, output_len=2048, weight_precision="fp4",
                activation_precision="fp4", kv_precision="fp8")
    return dp.InferencePlan(**{**base, **kw})


def test_chunk_caps_the_prompt_tokens_whose_activations_are_held():
    model = dp.model("llama3-70b")
    whole = inference_memory(model, _plan())
    chunked = inference_memory(model, _plan(prefill_tokens=8192))
    # the logits of every sequence stay; the prompt-token part shrinks from 418 x 128 tokens
    # to 8,192 of them: a 8192 / 53504 share of it
    logits = 418 * 128256 * 4.0
    per_token_part = float(whole.activations) - logits
    assert float(chunked.activations) == pytest.approx(logits + per_token_part * 8192 / 53504,
                                                       rel=1e-9)
    assert float(chunked.kv_cache) == float(whole.kv_cache)
    # a chunk at least as large as all prompts changes nothing
    assert float(inference_memory(model, _plan(prefill_tokens=53504)).activations) == \
        pytest.approx(float(whole.activations), rel=1e-12)
    # time is not changed by the chunk
    system = dp.system("dgx-b200")
    assert float(infer(model, system, _plan(prefill_tokens=8192)).e2e_latency) == \
        pytest.approx(float(infer(model, system, _plan()).e2e_latency), rel=1e-12)


@pytest.mark.parametrize("chunk", [0, 2048, 8192, 65536])
def test_max_batch_is_the_largest_batch_that_fits(chunk):
    model, system = dp.model("llama3-70b"), dp.system("dgx-b200")
    capacity = float(system.accelerator.hbm_capacity)
    b = int(max_batch(model, system, _plan(prefill_tokens=chunk)))
    total = lambda n: float(inference_memory(model, _plan(batch=n, prefill_tokens=chunk)).total)
    assert b > 0 and total(b) <= capacity < total(b + 1)


def test_prefill_tokens_column_reaches_the_plan_and_bad_values_are_named(tmp_path):
    from pathlib import Path
    src = Path(__file__).resolve().parents[1] / "benchmarks_data" / "infer_trtllm10_holdout.csv"
    import pandas as pd
    df = pd.read_csv(src).head(2)
    row = read_benchmarks(src)[0]
    assert float(infer_specs(row)[2].prefill_tokens) == float(df.loc[0, "prefill_tokens"]) > 0
    df = df.drop(columns=["prefill_tokens"])
    path = tmp_path / "no_chunk.csv"
    df.to_csv(path, index=False)
    assert float(infer_specs(read_benchmarks(path)[0])[2].prefill_tokens) == 0.0  # absent = 0
    df["prefill_tokens"] = [2048.5, 2048]
    df.to_csv(path, index=False)
    with pytest.raises(BenchmarkError, match=r"row 1, column 'prefill_tokens'"):
        read_benchmarks(path)


@pytest.mark.slow
def test_cli_prefill_tokens(capsys):
    args = ["infer", "--model", "llama3-70b", "--gpu", "b200", "--batch", "418", "--input", "128",
            "--output", "2048", "--precision", "fp4", "--kv-precision", "fp8", "--json"]
    assert main(args) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main(args + ["--prefill-tokens", "8192"]) == 0
    chunked = json.loads(capsys.readouterr().out)
    assert chunked["memory_gb"]["activations"] < whole["memory_gb"]["activations"]
    assert chunked["max_batch"] > whole["max_batch"]
    assert chunked["e2e_latency_s"] == pytest.approx(whole["e2e_latency_s"])
    assert main(args + ["--prefill-tokens", "-5"]) == 2
    assert "error: --prefill-tokens must be >= 0, got -5" in capsys.readouterr().err
    # search infer: with long prompts the activations of a whole batch's prefill rule out
    # large batches; with chunked prefill more plans fit
    search = ["search", "infer", "--model", "llama3-8b", "--gpu", "h100-sxm5-80gb",
              "--input", "2048", "--output", "16", "--max-gpus", "1", "--json"]
    assert main(search) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main(search + ["--prefill-tokens", "8192"]) == 0
    chunked = json.loads(capsys.readouterr().out)
    assert chunked["feasible"] > whole["feasible"]
    assert np.isfinite(chunked["top"][0]["output_tok_s_per_gpu"])


def test_holdout_chunk_follows_trtllm_bench_by_hand():
    """trtllm-bench's max_num_tokens (`finetune_setting`): Llama 3.3 70B FP4 on one B200 at
    1000 / 1000 holds 455.1 requests, 455.1 x (1 + 1000 / 1000) = 910 tokens, rounded up to
    the minimum 2,048; at 128 / 128 it holds 3,555.6 requests, 7,111 tokens, rounded up to a
    multiple of 512; Llama 3.1 405B on 4 B200 at 128 / 128 reaches the 4,096-request cap,
    8,192 tokens (a multiple of 1,024); Llama 3.1 8B FP8 on H200 at 2048 / 128 holds
    0.95 x (140.40 - 7.48 GiB) / (2 x 32 x 8 x 128 B x 2176) = 950.8 requests, x 17 = 16,163
    tokens, rounded up to 16,384."""
    import importlib.util
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "make_trtllm10", root / "benchmarks_data" / "make_infer_trtllm10_holdout.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    m70 = {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8}
    assert gen.max_num_tokens(m70, 70.55e9, 183359, 1, "fp4", 1000, 1000) == 2048
    assert gen.max_num_tokens(m70, 70.55e9, 183359, 1, "fp4", 128, 128) == 7168
    m405 = {"layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8}
    assert gen.max_num_tokens(m405, 405.85e9, 183359, 4, "fp4", 128, 128) == 8192
    m8 = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8}
    assert gen.max_num_tokens(m8, 8.03e9, 143771, 1, "fp8", 2048, 128) == 16384
