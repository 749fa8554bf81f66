"""trtllm-bench's own sizing of max_batch_size / max_num_tokens from the KV cache
(`diffperf.serving.trtllm_bench_limits`), checked against values worked by hand from its
formulas (TensorRT-LLM `bench/build/tuning.py`, `bench/benchmark/utils/general.py`), and its
use for the published PyTorch-backend rows."""

import pytest

from diffperf.serving import trtllm_bench_limits
from diffperf.validation._serving_rows import read_serving_rows, serving_case

GIB = 1024.0 ** 3
#: Qwen3-30B-A3B (48 layers, 4 KV heads of 128) NVFP4 with an FP8 KV cache on one B200.
QWEN3_30B_B200 = dict(params=30.5e9, layers=48, kv_heads=4, head_size=128, tp=1, pp=1,
                      weight_bytes=0.5, kv_bytes=1.0, device_bytes=179.0615234375 * GIB)


def test_long_prompt_budget_by_hand():
    # KV per token 2*48*4*128*1 B = 49,152 B; a request of 8192 + 1024 tokens 0.421875 GiB;
    # weights 30.5e9 * 0.5 B = 14.2027 GiB; (179.0615 - 14.2027) * 0.95 / 0.421875 = 371.24
    # requests -> batch 128 * ceil(371.24 / 128) = 384; tokens 371.24 * (1 + 8) = 3341
    # -> 256 * ceil(3341 / 256) = 3584; no chunked prefill: max(3584, 8192 + 384) = 8576
    lim = trtllm_bench_limits(**QWEN3_30B_B200, isl=8192, osl=1024, max_isl=8192)
    assert lim == (384, 8576)
    chunked = trtllm_bench_limits(**QWEN3_30B_B200, isl=8192, osl=1024, max_isl=8192,
                                  chunked_prefill=True)
    assert chunked == (384, 3584)


def test_caps_and_floors_by_hand():
    # Llama-3.1-8B fp8 on an H100, 128 / 128: 8.03e9 B of weights leave 72.17 GiB, 64 KiB
    # per token -> (72.17 * 0.95) / (256 * 64 KiB) = 4,388 requests, capped at 4096 -> batch
    # 4096; tokens
    # min(4096 * 2, 32768) = 8192 -> 1024 * 8; the guard 128 + 4096 stays below
    h100 = dict(params=8.03e9, layers=32, kv_heads=8, head_size=128, tp=1, pp=1,
                weight_bytes=1.0, kv_bytes=1.0, device_bytes=79.6474609375 * GIB)
    assert trtllm_bench_limits(**h100, isl=128, osl=128, max_isl=128) == (4096, 8192)
    # two pipeline stages: twice the memory, R still capped at 4096, then / 2 -> 2048;
    # tokens 2048 * 2 = 4096 -> 512 * ceil(4096 / 512) = 4096; the guard 128 + 2048 is lower
    assert trtllm_bench_limits(**{**h100, "pp": 2}, isl=128, osl=128, max_isl=128) == (
        2048, 4096)
    # 20,000 + 2,000 tokens at 64 KiB: 1.3428 GiB per request; (79.647 - 7.479) * 0.95 /
    # 1.3428 = 51.1 requests -> the floors: batch 64, tokens 2048 (51.1 * 11 = 562); the
    # guard raises the budget to 20,000 + 64
    assert trtllm_bench_limits(**h100, isl=20000, osl=2000, max_isl=20000) == (64, 20064)


def test_more_memory_never_fewer_slots():
    prev = (0, 0)
    for gib in (40, 80, 141, 180, 280):
        lim = trtllm_bench_limits(**{**QWEN3_30B_B200, "device_bytes": gib * GIB},
                                  isl=1024, osl=1024, max_isl=1024)
        assert lim[0] >= prev[0] and lim[1] >= prev[1]
        prev = lim


def test_bad_input_named():
    with pytest.raises(ValueError, match="isl"):
        trtllm_bench_limits(**QWEN3_30B_B200, isl=0, osl=1024, max_isl=1)
    with pytest.raises(ValueError, match="holds"):
        trtllm_bench_limits(**{**QWEN3_30B_B200, "device_bytes": 14.3 * GIB}, isl=8192,
                            osl=1024, max_isl=8192)


def test_pytorch_rows_use_it_and_tensorrt_rows_keep_the_preset():
    rows = {r["id"]: r for r in read_serving_rows()}
    c = serving_case(rows["trtllmpost-A-b200-qwen3-30b-a3b-tp1-8192x1024"])
    assert (float(c.engine.max_num_seqs), float(c.engine.max_num_batched_tokens)) == (
        384.0, 8576.0)
    assert any("trtllm-bench limits" in n for n in c.notes)
    old = serving_case(rows["trtllm017-h100-llama-3.1-8b-tp1-2048x2048"])
    assert (float(old.engine.max_num_seqs), float(old.engine.max_num_batched_tokens)) == (
        2048.0, 8192.0)


def test_engine_limits_read_the_config_as_trtllm_bench_does():
    """From a `Transformer`: its own head width where it has one (Qwen3: 128), hidden / heads
    for an MLA model (DeepSeek-V3: 7168 / 128 = 56, trtllm-bench's reading of a config without
    `head_dim`), and the same numbers as the plain formula."""
    import diffperf as dp
    from diffperf.serving import trtllm_bench_engine_limits

    b200 = dp.system("b200").accelerator
    for name, head in (("qwen3-30b-a3b", 128.0), ("deepseek-v3", 7168 / 128)):
        m = dp.model(name)
        got = trtllm_bench_engine_limits(m, b200, tp=8, pp=1, weight_precision="fp4",
                                         kv_precision="fp8", isl=1024, osl=1024,
                                         max_isl=1024)
        want = trtllm_bench_limits(params=float(m.num_params()), layers=float(m.layers),
                                   kv_heads=float(m.kv_heads), head_size=head, tp=8, pp=1,
                                   weight_bytes=0.5, kv_bytes=1.0,
                                   device_bytes=float(b200.hbm_capacity), isl=1024,
                                   osl=1024, max_isl=1024)
        assert got == want
