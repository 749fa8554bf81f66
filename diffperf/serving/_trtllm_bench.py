"""The request-slot and token-budget limits `trtllm-bench throughput` picks when it is not
given `--max_batch_size` / `--max_num_tokens`: sized from the KV cache the GPUs can hold.

TensorRT-LLM's benchmark tool (`tensorrt_llm/bench/build/tuning.py`, `calc_engine_setting` and
`finetune_setting`; `tensorrt_llm/bench/benchmark/utils/general.py`, `get_settings`, for the
PyTorch backend) estimates how many requests of the dataset's mean lengths fit in the KV cache
and derives both limits from that count. Re-derived here from that code (NVIDIA/TensorRT-LLM,
stored versions of those files; the formulas are unchanged between the 0.17 TensorRT-engine
build and the 1.x PyTorch backend, except for the last step, which only the PyTorch path has):

    KV per token  g = 2 L max(tp, n_kv) d b_kv / 2^30          GiB (all layers, whole TP group)
    weights       W = P b_w / 2^30                              GiB
    requests      R = (M tp pp - W) f / (g (ISL + OSL))         M = the GPU's memory, GiB
    raw batch     B = min(R, 4096) / pp
    raw tokens    T = min(B (1 + ISL / OSL), 32768)
    max_batch_size = max(64, 32 ceil(B / 32))  if B < 256
                     128 ceil(B / 128)         if B < 1024
                     256 ceil(B / 256)         otherwise
    max_num_tokens = max(2048, 256 ceil(T / 256))  if T < 4096
                     512 ceil(T / 512)            if T < 8192
                     1024 ceil(T / 1024)          otherwise

with L the layers, n_kv the KV heads and d the head size of the Hugging Face config (a config
without `head_dim` gives hidden / heads: so an MLA model is sized as if it cached full heads),
b_kv the KV-cache element bytes (1 for FP8 and NVFP4 checkpoints, whose KV cache is FP8), P
the parameter count, b_w the weight bytes (2 / 1 / 0.5 for 16 bit / FP8 / NVFP4), f the
`--kv_cache_free_gpu_mem_fraction` (0.95 by default), ISL / OSL the dataset's mean lengths.
The PyTorch backend without chunked prefill (trtllm-bench's default) then raises the budget
so that the longest prompt fits next to a full batch of decoding requests:

    max_num_tokens = max(max_num_tokens, max ISL + max_batch_size)

Approximations: P is the model's parameter count at the precision's width (trtllm-bench reads
the checkpoint's stored element count); M is the GPU preset's HBM capacity (trtllm-bench reads
NVML's total). Both only move R by the few GiB of weights or of capacity rounding.
"""

from __future__ import annotations

import math

#: trtllm-bench's default `--kv_cache_free_gpu_mem_fraction`.
KV_FRACTION = 0.95
#: Weight bytes per element by precision name, as trtllm-bench counts them (`BYTES_PER_ELEM`).
WEIGHT_BYTES = {"fp4": 0.5, "fp8": 1.0}
GIB = 1024.0 ** 3


#: trtllm-bench's caps: requests (before / pp) and tokens of one forward pass.
MAX_REQUESTS = 4096.0
MAX_TOKENS = 32768.0
#: `finetune_setting`'s rounding: (below this raw value, round up to a multiple of this), the
#: last row for everything above; and the floor of each limit.
BATCH_STEPS = ((256, 32), (1024, 128), (math.inf, 256))
TOKEN_STEPS = ((4096, 256), (8192, 512), (math.inf, 1024))
MIN_BATCH, MIN_TOKENS = 64, 2048


def _round_up(raw: float, steps, floor: int) -> int:
    """`raw` rounded up to the step of the first band it lies below, at least `floor`."""
    step = next(st for limit, st in steps if raw < limit)
    return max(floor, step * math.ceil(raw / step))


def kv_cache_requests(*, params: float, layers: float, kv_heads: float, head_size: float,
                      tp: float, pp: float, weight_bytes: float, kv_bytes: float,
                      device_bytes: float, isl: float, osl: float,
                      kv_fraction: float = KV_FRACTION) -> float:
    """R: requests of ISL + OSL tokens trtllm-bench expects the KV cache to hold (module
    docstring), count."""
    gib_per_token = 2.0 * layers * max(tp, kv_heads) * head_size * kv_bytes / GIB
    weights = params * weight_bytes / GIB
    free = device_bytes / GIB * tp * pp - weights
    return free * kv_fraction / (gib_per_token * (isl + osl))


def trtllm_bench_limits(*, params: float, layers: float, kv_heads: float, head_size: float,
                        tp: float, pp: float, weight_bytes: float, kv_bytes: float,
                        device_bytes: float, isl: float, osl: float, max_isl: float,
                        kv_fraction: float = KV_FRACTION, pytorch_backend: bool = True,
                        chunked_prefill: bool = False) -> tuple[int, int]:
    """(max_batch_size, max_num_tokens) trtllm-bench picks for a model, a TP x PP mapping and
    a dataset of mean lengths `isl` / `osl` (longest prompt `max_isl`), tokens; the formulas
    are in the module docstring. Raises ValueError when the weights leave no KV cache."""
    for name, x in (("params", params), ("layers", layers), ("kv_heads", kv_heads),
                    ("head_size", head_size), ("tp", tp), ("pp", pp),
                    ("weight_bytes", weight_bytes), ("kv_bytes", kv_bytes),
                    ("device_bytes", device_bytes), ("isl", isl), ("osl", osl),
                    ("max_isl", max_isl), ("kv_fraction", kv_fraction)):
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"trtllm_bench_limits: {name} must be a positive number, got {x!r}")
    r = kv_cache_requests(params=params, layers=layers, kv_heads=kv_heads,
                          head_size=head_size, tp=tp, pp=pp, weight_bytes=weight_bytes,
                          kv_bytes=kv_bytes, device_bytes=device_bytes, isl=isl, osl=osl,
                          kv_fraction=kv_fraction)
    if r < 1:
        raise ValueError(f"trtllm_bench_limits: the KV cache holds {r:.2f} requests of "
                         f"{isl + osl:g} tokens (trtllm-bench refuses below 1)")
    raw_bs = min(r, MAX_REQUESTS) / pp
    raw_tokens = min(raw_bs * (1.0 + isl / osl), MAX_TOKENS)
    max_bs = _round_up(raw_bs, BATCH_STEPS, MIN_BATCH)
    max_tokens = _round_up(raw_tokens, TOKEN_STEPS, MIN_TOKENS)
    if pytorch_backend and not chunked_prefill:
        max_tokens = max(max_tokens, int(math.ceil(max_isl)) + max_bs)
    return max_bs, max_tokens


def trtllm_bench_engine_limits(model, accelerator, *, tp: float, pp: float,
                               weight_precision: str, kv_precision: str, isl: float,
                               osl: float, max_isl: float, kv_fraction: float = KV_FRACTION,
                               chunked_prefill: bool = False) -> tuple[int, int]:
    """`trtllm_bench_limits` for a `Transformer` on an `Accelerator`, with the Hugging Face
    config's fields as trtllm-bench reads them: the model's parameter count, layers and KV heads,
    and its head width, or hidden / heads where the config has no `head_dim` (a model whose
    `head_width` is 0, and every MLA model: so MLA is sized as if it cached full heads).
    Precisions by name (fp4 / fp8 / else 16 bit)."""
    hidden, heads = float(model.hidden), float(model.heads)
    head = float(model.head_width)
    if float(model.kv_lora_rank) > 0 or head <= 0:
        head = hidden / heads
    return trtllm_bench_limits(
        params=float(model.num_params()), layers=float(model.layers),
        kv_heads=float(model.kv_heads), head_size=head, tp=tp, pp=pp,
        weight_bytes=WEIGHT_BYTES.get(weight_precision, 2.0),
        kv_bytes=WEIGHT_BYTES.get(kv_precision, 2.0),
        device_bytes=float(accelerator.hbm_capacity), isl=isl, osl=osl, max_isl=max_isl,
        kv_fraction=kv_fraction, chunked_prefill=chunked_prefill)
