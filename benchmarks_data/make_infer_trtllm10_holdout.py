"""Write `infer_trtllm10_holdout.csv`: TensorRT-LLM 1.0's published maximum-throughput tables
for the dense Llama 3 models and the single-GPU Qwen3-30B-A3B (MoE) runs, as infer rows that
are held out of the calibration.

Source: github NVIDIA/TensorRT-LLM `docs/source/performance/perf-overview.md` at commit
00f37686aa854010d68bcbd0f4ab000221541ca6 (the version that introduces the RTX 6000 Pro data
"NEW for v1.0"). Measured with `trtllm-bench throughput` (PyTorch backend, in-flight batching,
requests queued at an infinite rate, every request ISL in / OSL out). The page's metric is
"Total Output Throughput (tokens/sec)", so the per-GPU value is the printed one / tp (a later
version of the page prints per-GPU values, and its Llama 3.3 70B H100 TP 2 1000/1000 value,
2,209, is about half of this version's 4,205).

The page does not print the batch. trtllm-bench sizes it itself (`calc_engine_setting` and
`finetune_setting` in `tensorrt_llm/bench/build/tuning.py`): the requests whose KV cache fits
in 95 % of the memory left after the weights, at most 4,096, with the weights at
`param_count` x bytes per element and the KV cache at 2 x layers x max(tp, kv_heads) x
head_dim x bytes x (ISL + OSL) per request. Under an infinite request rate that many requests
are in flight at once, so that count is the `batch` of each row; the in-flight schedule does
the same prefill and decode work per request as a static batch of that size. trtllm-bench also
caps the tokens of one forward pass (`max_num_tokens`, 2,048-32,768 here), so prompts are
prefilled in chunks: the rows' `prefill_tokens` (it bounds the prefill activations that diffperf's
memory estimate counts). The GPU memory
is what trtllm-bench reads, NVML's total (`get_device_memory` in
`tensorrt_llm/bench/build/utils.py`), in GiB: nvidia-smi's totals, 81,559 MiB (H100 SXM),
143,771 MiB (H200), 183,359 MiB (B200), 189,471 MiB (GB200).

Runtime: `trtllm` (the 1.x PyTorch backend's preset, as the serving validation maps the same
pages' rows: CUDA graphs in decode up to 128 sequences, TensorRT-LLM's per-request host work
per running sequence, which a Grace host (GB200) pays 2.75x). Until 2026-11-28 these rows had
no runtime, i.e. the calibration set's TensorRT-LLM 0.x engine without graphs or per-request
host work.

Precisions: FP8 rows are `nvidia/Llama-3.x-...-FP8` (weights and GEMM inputs fp8), FP4 rows
`...-FP4` (NVFP4 weights and GEMM inputs). The KV cache is fp8: the page's commands set no
KV-cache dtype for the dense models, so the checkpoint's own applies, and ModelOpt, which made
these checkpoints, quantises the KV cache to fp8 unless told otherwise (`--kv_cache_qformat`,
"default to fp8 if not provided", NVIDIA/TensorRT-Model-Optimizer examples/llm_ptq/hf_ptq.py).
Caveat: the Llama 3.1 405B FP8 model card (ModelOpt 0.15.1, 2024) says only the linear
operators' weights and activations are quantised; with a 16-bit KV cache those rows would run
fewer requests at once.

MoE: the page's MoE tables ran with attention data parallelism (`enable_attention_dp`) and an
unprinted expert-parallel size, which diffperf cannot express, except where one GPU runs the
whole model: Qwen3-30B-A3B on one B200 / GB200 (FP4). Those 20 rows are included, with the
architecture of Qwen/Qwen3-30B-A3B's config.json (48 layers, hidden 2048, 32 query heads of
128, 4 KV heads, 128 experts of width 768, top 8, vocabulary 151,936, untied embeddings) and
its Hugging Face parameter count, 30.53 B, for trtllm-bench's estimate (which takes the KV
width from `head_dim`, 128). Its 128/128 rows reach trtllm-bench's 4,096-request cap; the others
hold 155-1,772 requests.

    python benchmarks_data/make_infer_trtllm10_holdout.py     # rewrites the CSV
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from diffperf.serving import kv_cache_requests, trtllm_bench_limits
from diffperf.serving._trtllm_bench import MAX_REQUESTS

HERE = Path(__file__).resolve().parent
OUT = HERE / "infer_trtllm10_holdout.csv"
SOURCE = ("github NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md @00f37686 "
          "(TensorRT-LLM 1.0 perf overview, trtllm-bench throughput, PyTorch backend)")
SEQUENCES = ["128/128", "128/2048", "128/4096", "500/2000", "1000/1000", "1000/2000",
             "2048/128", "2048/2048", "5000/500", "20000/2000"]

#: Hugging Face parameter counts (trtllm-bench's engine-size estimate uses them).
PARAMS = {"llama3-8b": 8.03e9, "llama3-70b": 70.55e9, "llama3-405b": 405.85e9,
          "qwen3-30b-a3b": 30.53e9}
LABEL = {"llama3-8b": "Llama-3.1-8B", "llama3-70b": "Llama-3.3-70B",
         "llama3-405b": "Llama-3.1-405B", "qwen3-30b-a3b": "Qwen3-30B-A3B"}
#: Architectures that are not diffperf presets (config.json of Qwen/Qwen3-30B-A3B).
EXTRA_MODELS = {"qwen3-30b-a3b": {"layers": 48, "hidden": 2048, "heads": 32, "kv_heads": 4,
                                  "head_dim": 128, "ffn_hidden": 768, "vocab": 151936,
                                  "num_experts": 128, "experts_per_token": 8}}

#: (model preset, gpu preset, tp, precision, printed total output tokens/s per SEQUENCES row)
TABLES = [
    ("llama3-70b", "b200", 1, "fp4",
     [11147, 9922, 6831, 7762, 7007, 6271, 1339, 4783, 1459, 665]),
    ("llama3-70b", "gb200", 1, "fp4",
     [12189, 11309, 7849, 9028, 7326, 6513, 1450, 5646, 1602, 755]),
    ("llama3-70b", "h200-sxm-141gb", 1, "fp8",
     [3803, 4336, 2872, 3666, 2909, 2994, 442, 2003, 566, 283]),
    ("llama3-70b", "h100-sxm5-80gb", 2, "fp8",
     [6378, 6651, 4199, 5222, 4205, 4146, 762, 3082, 898, 437]),
    ("llama3-405b", "b200", 4, "fp4",
     [6281, 8020, 6345, 6244, 5209, 4933, 749, 4212, 1048, 672]),
    ("llama3-405b", "gb200", 4, "fp4",
     [6740, 8151, 6608, 6540, 5389, 5135, 797, 4407, 1112, 739]),
    ("llama3-405b", "h200-sxm-141gb", 8, "fp8",
     [3814, 5348, 4741, 4724, 3330, 3722, 456, 2948, 650, 505]),
    ("llama3-405b", "h100-sxm5-80gb", 8, "fp8",
     [3627, 4340, 3116, 3994, 2919, 2895, 453, 2296, 610, 345]),
    ("llama3-8b", "h200-sxm-141gb", 1, "fp8",
     [27911, 26221, 18027, 20770, 17744, 16828, 3538, 12194, 3902, 1804]),
    ("llama3-8b", "h100-sxm5-80gb", 1, "fp8",
     [28312, 22714, 14325, 17660, 15220, 13899, 3450, 9305, 3459, 1351]),
    ("qwen3-30b-a3b", "b200", 1, "fp4",
     [39827, 37844, 24953, 27817, 25828, 22051, 6251, 17554, 6142, 2944]),
    ("qwen3-30b-a3b", "gb200", 1, "fp4",
     [24107, 31311, 26337, 20604, 17481, 17177, 6595, 14719, 5908, 3203]),
]
BYTES = {"fp8": 1.0, "fp4": 0.5}
#: NVML's total memory per GPU (nvidia-smi), MiB.
NVML_TOTAL_MIB = {"h100-sxm5-80gb": 81559, "h200-sxm-141gb": 143771, "b200": 183359,
                  "gb200": 189471}
KV_BYTES = 1.0  # fp8 KV cache
MEMORY_FRACTION = 0.95  # --kv_cache_free_gpu_mem_fraction 0.95


def _limits_args(m: dict, params: float, total_mib: float, tp: int, precision: str,
                 isl: int, osl: int) -> dict:
    """The arguments of trtllm-bench's sizing (`diffperf.serving.trtllm_bench_limits`, whose
    docstring has the formulas) for one row, with `total_mib` the GPU's NVML total memory."""
    return dict(params=params, layers=m["layers"], kv_heads=m["kv_heads"],
                head_size=m.get("head_dim") or m["hidden"] / m["heads"], tp=tp, pp=1,
                weight_bytes=BYTES[precision], kv_bytes=KV_BYTES,
                device_bytes=total_mib * 1024.0 ** 2, isl=isl, osl=osl,
                kv_fraction=MEMORY_FRACTION)


def concurrency(m: dict, params: float, total_mib: float, tp: int, precision: str,
                isl: int, osl: int) -> int:
    """Requests in flight: trtllm-bench's KV-cache estimate, at most 4,096."""
    requests = kv_cache_requests(**_limits_args(m, params, total_mib, tp, precision, isl, osl))
    return int(math.floor(min(requests, MAX_REQUESTS)))


def max_num_tokens(m: dict, params: float, total_mib: float, tp: int, precision: str,
                   isl: int, osl: int) -> int:
    """The most tokens one forward pass takes, as trtllm-bench sets it (`finetune_setting`):
    min(requests, 4096) x (1 + ISL / OSL), at most 32,768, rounded up (at least 2,048). It caps
    each prefill pass (chunked prefill), so the prompt guard of the non-chunked PyTorch path is
    left out."""
    args = _limits_args(m, params, total_mib, tp, precision, isl, osl)
    return trtllm_bench_limits(**args, max_isl=isl, chunked_prefill=True)[1]


def rows() -> list[dict]:
    presets = HERE.parent / "diffperf" / "presets"
    models = json.loads((presets / "models.json").read_text()) | EXTRA_MODELS
    out = []
    for name, gpu, tp, precision, values in TABLES:
        m = models[name]
        for seq, total in zip(SEQUENCES, values):
            isl, osl = (int(x) for x in seq.split("/"))
            args = (m, PARAMS[name], NVML_TOTAL_MIB[gpu], tp, precision, isl, osl)
            b, chunk = concurrency(*args), max_num_tokens(*args)
            out.append({
                "id": f"trtllm10-tput-{gpu.split('-')[0]}-{name}-tp{tp}-{isl}x{osl}",
                "kind": "infer", "source": SOURCE, "model": LABEL[name],
                "layers": m["layers"], "hidden": m["hidden"], "heads": m["heads"],
                "kv_heads": m["kv_heads"], "ffn_hidden": m["ffn_hidden"], "vocab": m["vocab"],
                "gated_mlp": 1, "num_experts": m.get("num_experts", 1),
                "experts_per_token": m.get("experts_per_token", 1), "gpu": gpu,
                "num_gpus": tp, "gpus_per_node": 72 if gpu == "gb200" else 8, "tp": tp, "pp": 1,
                "precision": precision, "kv_precision": "fp8", "batch": b,
                "input_len": isl, "output_len": osl,
                "output_tok_s_per_gpu": round(total / tp, 2), "head_dim": m.get("head_dim", 0),
                "prefill_tokens": chunk, "runtime": "trtllm",
                "notes": (f"printed total output throughput {total:,} tokens/s on {tp} GPU(s), "
                          f"per GPU = total / tp; batch = {b} requests in flight "
                          f"(trtllm-bench's KV-cache estimate at 95 % of the memory left "
                          f"after the weights, capped at 4,096); at most {chunk:,} tokens per "
                          f"forward pass (trtllm-bench's max_num_tokens); {precision.upper()} "
                          f"weights and GEMM inputs, fp8 KV cache (ModelOpt default); "
                          f"runtime trtllm: the PyTorch backend trtllm-bench runs"),
            })
    return out


def main() -> None:
    data = rows()
    with OUT.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(data[0]))
        w.writeheader()
        w.writerows(data)
    print(f"wrote {len(data)} rows to {OUT}")


if __name__ == "__main__":
    main()
