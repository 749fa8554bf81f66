"""Serving presets (presets/engines.json, presets/deployment.json): every engine preset builds a
valid Engine, every GPU preset has a price and a power range, and values pinned to the cited
engine sources."""

import math

import numpy as np
import pytest

from diffperf import presets
from diffperf.specs import POLICIES, Engine

ENGINES = presets.engine_names()


def test_engine_names():
    assert {"vllm", "sglang", "trtllm", "trtllm-0.14-triton"} <= set(ENGINES)


@pytest.mark.parametrize("name", ENGINES)
def test_engine_preset_builds(name):
    e = presets.engine(name)
    assert isinstance(e, Engine)
    assert int(e.max_num_batched_tokens) >= int(e.max_num_seqs) >= 1
    assert int(e.block_size) >= 1
    assert 0 < float(e.kv_memory_fraction) <= 1
    info = presets.engine_info(name)
    assert info["description"] and info["source"]
    assert presets.engine(name.upper()).max_num_seqs == e.max_num_seqs  # any case


# Values read from the engines' sources (cited in engines.json), not from the JSON.
PINNED = {
    # vllm 0.10.2 vllm/engine/arg_utils.py (>= 70 GiB, OPENAI_API_SERVER); platforms/cuda.py
    "vllm": dict(max_num_seqs=1024, max_num_batched_tokens=8192, chunked_prefill=1,
                 policy="decode_first", block_size=16),
    "vllm-a100": dict(max_num_seqs=256, max_num_batched_tokens=2048, block_size=16),
    # sglang 0.4.10 / 0.5.2 server_args.py: chunked_prefill_size 8192 (< 160 GiB), page_size 1
    "sglang": dict(max_num_batched_tokens=8192, policy="prefill_first", block_size=1),
    # trtllm-serve: BuildConfig 2048 / 8192, enable_chunked_prefill False, KvCacheConfig 32,
    # free_gpu_memory_fraction 0.9
    "trtllm": dict(max_num_seqs=2048, max_num_batched_tokens=8192, chunked_prefill=0,
                   block_size=32, kv_memory_fraction=0.9),
    # release notes 0.14 / 0.11; tensorrtllm_backend v0.14.0 docs/model_config.md
    "trtllm-0.14-triton": dict(max_num_seqs=2048, max_num_batched_tokens=8192,
                               chunked_prefill=0, kv_memory_fraction=0.9),
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_engine_values_pinned_to_sources(name):
    e = presets.engine(name)
    for field, want in PINNED[name].items():
        if field == "policy":
            want = POLICIES[want]
        np.testing.assert_allclose(float(getattr(e, field)), want, err_msg=f"{name}.{field}")


def test_sglang_mem_fraction_static_default():
    # server_args.py: (gpu_mem - (9.5 + tp/2) GiB) / gpu_mem on an H100 (81,559 MiB), TP1
    native = presets.engine_info("sglang")["native"]["mem_fraction_static"]
    assert native == round((81559 - 10 * 1024) / 81559, 3)


@pytest.mark.parametrize("gpu", presets.gpu_names())
def test_every_gpu_has_price_and_power(gpu):
    price = presets.gpu_price_per_hour(gpu)
    idle, tdp = presets.gpu_power(gpu)
    assert math.isfinite(price) and price > 0
    assert 0 < idle < tdp


def test_datasheet_tdp():
    assert presets.gpu_power("h100-sxm5-80gb")[1] == 700  # H100 SXM5 datasheet
    assert presets.gpu_power("a100-sxm4-80gb")[1] == 400  # A100 SXM datasheet
    assert presets.gpu_power("v100-sxm2-32gb")[1] == 300  # V100 SXM2 datasheet


@pytest.mark.parametrize("call", [presets.engine, presets.engine_info])
def test_unknown_engine_names_it(call):
    with pytest.raises(ValueError, match=r"unknown engine 'nope'.*vllm"):
        call("nope")


@pytest.mark.parametrize("call", [presets.gpu_price_per_hour, presets.gpu_power])
def test_unknown_gpu_names_it(call):
    with pytest.raises(ValueError, match=r"unknown gpu 'x100'.*h100-sxm5-80gb") as err:
        call("x100")
    assert "\n" not in str(err.value)
