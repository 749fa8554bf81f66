"""Published serving rows -> deployments (`diffperf.validation._serving_rows`), and one slow
end-to-end check of the simulator against TensorRT-LLM 0.14's online table."""

import math

import equinox as eqx
import jax.numpy as jnp
import pytest

from diffperf.inference import infer
from diffperf.validation._serving_rows import (
    SERVING_FILES,
    SkipRow,
    compare,
    error_table,
    measured_lengths,
    predict_cases,
    read_serving_rows,
    serving_case,
)


def test_serving_files_ship():
    assert all(p.exists() for p in SERVING_FILES)


@pytest.fixture(scope="module")
def rows():
    return {r["id"]: r for r in read_serving_rows()}


def test_trtllm014_online_row(rows):
    c = serving_case(rows["trtllm014-serve-h100-llama-3.1-70b-tp4-467x256-qps2.0"])
    assert float(c.plan.tp) == 4 and c.replicas == 1
    assert c.engine_name == "trtllm-0.14-triton" and c.regime == "online at a rate"
    t = c.traffic
    assert (t.rate, t.num_requests, t.input_len, t.output_len, t.distribution) == (
        2.0, 500, 467.0, 256.0, "fixed")
    assert c.measured["ttft_mean_ms"] == 62.0 and c.measured["itl_mean_ms"] == 21.0


def test_offline_row_capped_and_kv_fraction(rows):
    c = serving_case(rows["trtllm017-h200-llama-3.1-8b-tp1-128x128"], max_requests=2000)
    assert c.engine_name == "trtllm" and c.regime == "offline saturation"
    assert math.isinf(c.traffic.rate) and c.traffic.num_requests == 2000
    assert c.num_requests_row == 30000
    assert float(c.engine.kv_memory_fraction) == pytest.approx(0.95)  # trtllm-bench's


def test_sharegpt_lengths_from_totals(rows):
    rid = next(i for i in rows if i.startswith("datacrunch-h200-llama-3.3-70b-tp4-sharegpt-qps4"))
    c = serving_case(rows[rid])
    mi, mo, n = measured_lengths(rows[rid]["notes"])
    assert (c.traffic.input_len, c.traffic.output_len) == (mi, mo)
    assert c.traffic.distribution == "uniform" and c.traffic.input_spread == 1.0
    assert c.engine_name == "sglang" and c.runtime_name == "sglang"


def test_closed_loop_and_vllm_a100(rows):
    c = serving_case(rows["lmdeploy010-a100-llama2-7b-tp1-bs16-128x128"])
    assert c.regime == "closed loop" and c.traffic.concurrency == 16
    assert c.traffic.num_requests == 160 and c.engine_name == "trtllm-0.14-triton"
    # TurboMind v0.1: a context pass then a decode pass per iteration, the benchmark script's
    # slots and KV blocks (128 and 1000 x 128 tokens for Llama-2-7B), every prompt at once
    e = c.engine
    assert float(e.context_pass) == 1 and float(e.max_num_seqs) == 128
    assert float(e.kv_cache_tokens) == 128000 and float(e.chunked_prefill) == 0
    assert float(e.max_num_batched_tokens) >= 128 * 128
    a100 = next(r for r in rows.values() if r["engine"].startswith("vLLM")
                and r["gpu_preset"].startswith("a100") and r["input_len"])
    assert serving_case(a100).engine_name == "vllm-a100"


def test_kv_cache_in_the_engines_default_dtype(rows):
    """vLLM / SGLang / trtllm-serve on FP8 checkpoints without a KV-cache quantization keep
    their cache in the model's bf16 ("auto"); TensorRT-LLM's own tables (ModelOpt FP8 / NVFP4
    checkpoints) keep FP8; an explicit kv_precision wins."""
    kv = lambda rid: float(serving_case(rows[rid]).plan.kv_precision)
    assert kv("gpustack-qwen3-235b-a22b-h100-optimized-vllm-tp4-fp8-32000x100") == 1  # bf16
    assert kv("gpustack-qwen3-14b-h100-optimized-sglang-tp1-fp8-4000x200") == 1
    assert kv("gpustack-qwen3-32b-h100-optimized-tensorrt-llm-tp1-fp8-2000x100") == 1
    fp8_bench = next(i for i, r in rows.items() if r["precision"].lower() == "fp8"
                     and not r["kv_precision"] and i.startswith("trtllm"))
    assert kv(fp8_bench) == 2  # fp8
    fp8_kv = next(i for i, r in rows.items() if r["kv_precision"].lower() == "fp8"
                  and "vllm" in r["engine"].lower())
    assert kv(fp8_kv) == 2


def test_sharegpt_replies_long_tailed_within_the_cut(rows):
    """ShareGPT rows: replies exponential at the measured mean (coefficient of variation near
    1, where the uniform's is 0.58), never beyond 2,048 tokens with the prompt."""
    import numpy as np

    from diffperf.validation._serving_rows import SHAREGPT_MAX_TOTAL, sharegpt_outputs
    inp = np.random.default_rng(3).uniform(1, 434, 5000).round()
    out = sharegpt_outputs(inp, 202.0)
    assert abs(out.mean() / 202.0 - 1) < 0.02
    assert out.min() >= 1 and np.all(inp + out <= SHAREGPT_MAX_TOTAL)
    assert 0.85 < out.std() / out.mean() < 1.1
    assert out.max() > 4 * 202  # a tail beyond the uniform's 2 x mean
    c = serving_case(rows["gpustack-qwen3-14b-h100-engine-choice-vllm-tp1-sharegpt"])
    assert c.sharegpt and float(c.model.seq_len) > SHAREGPT_MAX_TOTAL


def test_skip_reasons(rows):
    with pytest.raises(SkipRow) as e:
        serving_case(rows["sglang-vllm060-a100-llama-3.1-8b-tp1-sglang-sharegpt-qps4"])
    assert e.value.kind == "lengths missing"
    bad = dict(rows["trtllm014-serve-h100-llama-3.1-8b-tp1-467x16-qps2.0"], vocab="")
    with pytest.raises(SkipRow) as e:
        serving_case(bad)
    assert e.value.kind == "architecture missing"
    bad = dict(rows["trtllm014-serve-h100-llama-3.1-8b-tp1-467x16-qps2.0"], gpu_preset="")
    with pytest.raises(SkipRow) as e:
        serving_case(bad)
    assert e.value.kind == "no gpu preset"


def test_ambiguous_mistral_vocab_predicts_alike(rows):
    """TensorRT-LLM 0.17's "Mistral 7B" leaves its release open (vocab 32,000 or 32,768): the
    row maps with 32,000 (`AMBIGUOUS_VOCAB`), and the other vocabulary moves the predicted
    throughput of its longest-output case by less than 0.1 % (the LM head's 3.1 M of 7.2 B
    weights)."""
    c = serving_case(rows["trtllm017-h100-mistral-7b-tp1-128x4096"])
    assert float(c.model.vocab) == 32000.0
    other = eqx.tree_at(lambda m: m.vocab, c.model, jnp.asarray(32768.0))
    plan = eqx.tree_at(lambda p: p.batch, c.plan, jnp.asarray(64.0))
    tput = [float(infer(m, c.system, plan, runtime=c.runtime).throughput) for m in (c.model, other)]
    assert 0.0 < tput[0] / tput[1] - 1.0 < 1e-3


@pytest.mark.slow
def test_trtllm014_online_errors(rows):
    """Nothing fitted: the errors measured on the 72 rows of TensorRT-LLM 0.14's online
    table (calibration/serving_validation.md), with 5 points of margin."""
    cases = [serving_case(r) for i, r in rows.items() if i.startswith("trtllm014")]
    preds, skipped = predict_cases(cases)
    assert not skipped and len(preds) == 72
    tab = {(r["metric"], r["regime"]): r for r in
           error_table(compare(cases, preds), ("metric", "regime"))}
    assert tab[("itl_mean_ms", "online at a rate")]["mape"] < 0.125 + 0.05
    assert tab[("ttft_mean_ms", "online at a rate")]["mape"] < 0.249 + 0.05
    assert tab[("output_tok_s_total", "online at a rate")]["mape"] < 0.079 + 0.05


@pytest.mark.slow
def test_lmdeploy_static_table_errors(rows):
    """Nothing fitted: LMDeploy v0.1.0a1's A100 table (80 closed-loop rows), with 5 points of
    margin on calibration/serving_validation.md's errors (mean first-token latency 16.8 %:
    37.8 % before TurboMind's context pass and its all-prompts-at-once iteration were
    modelled, 21.8 % before closed-loop requests arrived after the iteration that freed their
    client; median per-token latency 8.8 %; output tokens/s 7.4 %)."""
    cases = [serving_case(r) for i, r in rows.items()
             if i.startswith("lmdeploy010") and "-bs" in i]
    preds, skipped = predict_cases(cases)
    assert not skipped and len(preds) == 80
    tab = {r["metric"]: r for r in error_table(compare(cases, preds), ("metric",))}
    assert tab["ttft_mean_ms"]["mape"] < 0.168 + 0.05
    assert tab["itl_median_ms"]["mape"] < 0.088 + 0.05
    assert tab["output_tok_s_total"]["mape"] < 0.074 + 0.05


def test_sglang_041_deepseek_rows_run_eager(rows):
    """SGLang 0.4.1 turned CUDA graphs off for DeepSeek-V3 (model_runner.py): its rows take the
    eager runtime; other SGLang rows keep the `sglang` preset (decode from graphs)."""
    c = serving_case(rows["sglang-dsv3-datacrunch-h200x8-fp8-1024x1024-qps1"])
    assert c.runtime_name == "sglang-0.4-deepseek-eager" and c.engine_name == "sglang"
    assert float(c.runtime.decode_graph) == 0.0 and float(c.plan.attention_dp) == 1.0
    other = next(r for i, r in rows.items() if r["engine"] == "SGLang"
                 and not i.startswith("sglang-dsv3") and r["gpu_preset"])
    assert serving_case(other).runtime_name == "sglang"
    # the README's "BF16" runs load the checkpoint's FP8 block-wise weights (no --quantization;
    # 671 B weights in bf16 would not fit 8 x 141 GB): fp8 GEMMs, a bf16 KV cache
    bf16 = serving_case(rows["sglang-dsv3-datacrunch-h200x8-bf16-1024x1024-qps1"]).plan
    assert (float(bf16.weight_precision), float(bf16.kv_precision)) == (2.0, 1.0)


def test_gpt_oss_rows_run_the_checkpoints_precisions(rows):
    """gpt-oss ships MXFP4 MoE weights (the rest bf16); TensorRT-LLM runs them with bf16
    activations on Hopper and mxfp8 on Blackwell (its gpt_oss README), vLLM with bf16 on an
    A100 (Marlin MXFP4): weights at 4 bit, GEMMs in bf16 / fp8 math, whatever the table's FP8 /
    FP4 / BF16 column says; KV bf16 ('use auto') except TensorRT-LLM on Blackwell (fp8), and a
    row's own kv_precision wins. Codes: 1 = 16 bit, 2 = fp8, 3 = 4 bit. Other models keep the
    column's precision."""
    codes = lambda p: (float(p.weight_precision), float(p.activation_precision),
                       float(p.kv_precision))
    plan = lambda rid: serving_case(rows[rid]).plan
    assert rows["trtllmpost-C-h200-gpt-oss-20b-tp1-1024x1024"]["precision"].lower() == "fp8"
    assert codes(plan("trtllmpost-C-h200-gpt-oss-20b-tp1-1024x1024")) == (3.0, 1.0, 1.0)
    assert codes(plan("trtllmpost-C-b200-gpt-oss-20b-tp1-1024x1024")) == (3.0, 2.0, 2.0)
    assert codes(plan("gpustack-gpt-oss-120b-a100-baseline-vllm-tp1-2000x100")) == (3.0, 1.0,
                                                                                      1.0)
    assert codes(plan("vllmblog-fp8kv-h100-gpt-oss-20b-kvfp8-conc8")) == (3.0, 1.0, 2.0)
    assert codes(plan("trtllmpost-C-b200-llama-3.3-70b-tp1-1024x1024")) == (3.0, 3.0, 2.0)
