"""Published serving-under-load rows (`serving_trtllm_published.csv`, `serving_published.csv`:
docs/benchmark-format.md, "Serving under load") as `diffperf.serving` deployments, and their
predictions: nothing is fitted, every choice below is fixed in advance.

**Row -> specs** (`serving_case`):

- model: the architecture columns (`row_model`; an empty vocabulary the source leaves
  ambiguous between releases that predict alike: `AMBIGUOUS_VOCAB`); system: the `gpu_preset`
  column's preset (rows without one are skipped); plan: `tp`, `pp`, `ep` (empty: 1; with
  attention DP and an empty `ep`, `ep = tp` when it divides the experts: trtllm-bench `--ep` =
  `--tp` in those commands), `precision` for weights and GEMMs, `kv_precision` (empty: the
  row's precision, except an fp4 row whose KV is stored in fp8: NVFP4 checkpoints keep an FP8
  KV cache; and bf16 for the fp8 / fp4 rows of vLLM, SGLang and trtllm-serve on checkpoints
  without a KV-cache quantization, whose default cache dtype is the model's:
  `default_kv_precision`).
  gpt-oss rows run the checkpoint's MXFP4 MoE weights whatever the precision column says:
  4-bit weights, bf16 activations (fp8 for TensorRT-LLM on Blackwell), `gpt_oss_precisions`.
  `attention_dp` 1 -> `InferencePlan.attention_dp` (each of the tp GPUs an attention rank
  with its own scheduler and KV cache, the experts split over them).
- replicas: `num_gpus / (tp * pp)` where that is a whole number > 1 (requests go round robin,
  `serve`'s convention); with attention DP the stream is split over replicas x tp ranks.
- engine preset (`ENGINE_RULES`): TensorRT-LLM 0.14 behind Triton -> `trtllm-0.14-triton`;
  trtllm-bench / trtllm-serve 0.17+ -> `trtllm`, on the `trtllm-bench` runtime for
  trtllm-bench's PyTorch-backend rows (decode CUDA graphs padded as the tool configures
  them; the preset's `source`). trtllm-bench picks max_batch_size /
  max_num_tokens by its own heuristics, printed in no row: for the PyTorch backend (0.19+)
  they are computed as the tool does (`diffperf.serving.trtllm_bench_limits`: sized from the
  KV cache, the budget raised to the longest prompt + the batch without chunked prefill); for
  the 0.17 TensorRT engines the preset's 2048 / 8192 are kept (the engine build uses the same
  sizing, but how its C++ scheduler, which stops at the first context that does not fit,
  then ran prompts as long as the budget next to generating requests is not settled); the
  `kv_cache_free_gpu_mem_fraction` 0.95 the notes state replaces 0.9;
  vLLM -> `vllm` (`vllm-a100` on an A100, vLLM's own A100 branch); SGLang -> `sglang`;
  LMDeploy TurboMind v0.1 -> `trtllm-0.14-triton`: TurboMind is a C++ engine with persistent
  (in-flight) batching that runs running decodes with new whole prompts (no chunked prefill in
  v0.1) and blocked KV, which is that preset's scheduler (decode first, no chunking, large
  blocks), with the changes below; the table prints no batch limit or cache size.
  Its KV cache is not reserved per request: `kv_output_reserve` 0 (LMDeploy
  docs/en/inference/turbomind.md, "KV Cache Manager": sequences take cache memory as
  needed and the least recently used one is evicted and later re-decoded from its token
  IDs, so "the system has access to infinite device memory"). v0.1.0a1's iteration
  (src/turbomind/models/llama/LlamaBatch.cc, InternalThreadEntry): every waiting request
  the free slots take joins, `ContextDecode` runs all their prompts but the last token
  ('subtract input/context len by 1 to skip last input token (will process with decoder
  later)'), in sub-batches within the iteration (each with at most max_context_token_num x
  session_len tokens, and its longest context times its size within that too: 2,048-token
  prompts go at most 8 to a pass; each sub-batch's reading of the weights is not charged,
  small beside those compute-bound passes), then `Generate` runs one decode pass over every
  active request: `context_pass` 1, no budget across iterations (a budget every slot's
  longest prompt fits in), no chunking. Slots and KV blocks: the benchmark scripts' config
  (`LMDEPLOY_CONFIG`), the cache as `kv_cache_tokens`, 128-token blocks.
  Row columns `max_num_seqs`, `max_num_batched_tokens`, `chunked_prefill` override the preset.
- runtime preset: TensorRT-LLM's TensorRT engines (0.14 behind Triton, trtllm-bench's 0.17)
  -> `trtllm-engine` (C++ runtime without CUDA graphs, the host never binds; the engine's own
  all-reduce kernels; FP8 context attention in FP8 engines, as trtllm-bench's build sets: the
  0.14 rows are bf16); LMDeploy's C++ TurboMind -> `megatron-core` (the same host, NCCL's
  all-reduce: v0.1's LlamaTritonModel reads `enable_custom_all_reduce` with default 0 and
  never hands FasterTransformer's custom all-reduce to the model); TensorRT-LLM PyTorch
  backend -> `trtllm`; vLLM -> `vllm`;
  SGLang -> `sglang`, except SGLang 0.4.1 serving DeepSeek-V3 -> `sglang-0.4-deepseek-eager`
  (that release turns CUDA graphs off for DeepseekV3ForCausalLM, and the 2-node rows pass
  --disable-cuda-graph).
- traffic: `request_rate_qps` (Poisson; inf: all at t = 0), `concurrency` (closed loop),
  `num_requests` (empty: `DEFAULT_REQUESTS`; offline rows are capped at `max_requests`,
  `DEFAULT_MAX_REQUESTS`: the throughput at saturation converges, see
  calibration/serving_validation.md). Lengths: the notes' measured token totals when given
  (`vllm bench serve` / `sglang.bench_serving` print them; outputs stop early at EOS), else
  `input_len` / `output_len`. Distribution by `length_distribution`: fixed (exact or
  'not stated', lengths taken as printed); ShareGPT -> prompts uniform with range ratio 1 at
  the measured mean (`SHAREGPT_SPREAD`: a uniform on [0, 2 mean] keeps the mean and a
  coefficient of variation 0.58), replies exponential at the measured mean within vLLM's
  2,048-token cut (`sharegpt_outputs`: the long replies set an all-at-once run's length);
  'uniform in [1, len]' -> uniform on [1, 2 mean - 1] (ratio (mean - 1) / mean); '+-15%' ->
  uniform with ratio 0.15. LMDeploy's `profile_generation` rows: `concurrency` threads each
  running `LMDEPLOY_ROUNDS` requests.
- `itl_median_ms` below `BURST_GAP_MS` (1 ms) is dropped from the comparison: tokens that
  arrived in one burst, not a decode step (two trtllm-serve rows: 0.07 and 0.12 ms medians
  against 52 and 85 ms means).
- skipped, with the reason counted: no `gpu_preset`, a precision the GPU lacks, lengths
  missing (ShareGPT rows without token totals), an infeasible plan, or a request that can
  never be admitted / a prompt over the budget without chunked prefill.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._paths import BENCHMARKS_DATA
from ..feasibility import explain
from ..inference import infer
from ..presets import (
    check_precision_names,
    engine as engine_preset,
    gpu_info,
    gpu_names,
    resolve_efficiency,
    runtime as runtime_preset,
    runtime_plan_defaults,
    system,
)
from ..serving import Requests, Traffic, requests as traffic_requests, reservation, simulate
from ..serving._kv_dtype import keeps_model_dtype_kv
from ..serving._report import binned_percentile
from ..serving._serve import _cost_and_capacity, eqx_replace
from ..serving._simulate import held
from ..serving._trtllm_bench import trtllm_bench_engine_limits
from ..specs._engine import ENGINE_FIELDS, Engine
from ..specs._hardware import WEIGHT_SCALE_BLOCK, weight_scale_block
from ..specs._inference_plan import InferencePlan
from ..specs._runtime import Runtime
from ..specs._transformer import Transformer
from ._data import MODEL_OPTIONAL_COUNTS, MODEL_OPTIONAL_FLAGS, row_model

#: The two published tables: TensorRT-LLM's own (a copy of the project's shared file) and the
#: other engines'.
SERVING_FILES = (BENCHMARKS_DATA / "serving_trtllm_published.csv",
                 BENCHMARKS_DATA / "serving_published.csv")
#: Requests simulated at most for an offline (rate inf) row.
DEFAULT_MAX_REQUESTS = 2000
#: Requests of a row that leaves `num_requests` empty (trtllm-bench's table of request counts
#: lists 3000 for the 1000/1000 and 1024/1024 cases it prints).
DEFAULT_REQUESTS = 3000
#: Uniform range ratio standing for ShareGPT's spread of lengths.
SHAREGPT_SPREAD = 1.0
#: vLLM's ShareGPT sampling keeps a conversation only when its prompt has at most 1,024
#: tokens and prompt + reply at most 2,048 (`benchmark_serving`'s sample_sharegpt_requests:
#: "Prune too long sequences"; later `ShareGPTDataset` / `is_valid_sequence`).
SHAREGPT_MAX_TOTAL = 2048
#: A median inter-token gap below this (ms) counts tokens that reached the client together
#: (several per network read: the streaming server sends them in bursts), not decode steps:
#: the shortest per-token time any row measures otherwise is 5.0 ms (Llama-3.1 8B at
#: 2 req/s on one H200, mean ITL); such `itl_median_ms` values are not compared.
BURST_GAP_MS = 1.0
#: LMDeploy v0.1 profile_generation: each client thread runs this many requests.
LMDEPLOY_ROUNDS = 10
#: The TurboMind config of LMDeploy's A100 benchmark, by model as printed: (max_batch_size,
#: cache_max_entry_count), as benchmark/benchmark_{7b,13b,20b,70b}.sh set them ("update
#: recommended config to config.ini", InternLM/lmdeploy @3e391df4, the commit of the table).
#: A cache_max_entry_count above 1 is a count of KV blocks (src/turbomind/models/llama/
#: BlockManager.cc at v0.1.0a1), each of cache_block_seq_len = `LMDEPLOY_BLOCK` tokens
#: (LlamaTritonModel.cc's default; the scripts leave it unset).
LMDEPLOY_CONFIG = {"llama2-7b": (128, 1000), "llama2-13b": (128, 500),
                   "internlm-20b": (128, 700), "llama2-70b": (256, 4000)}
LMDEPLOY_BLOCK = 128
#: The `ENGINE_RULES` key of trtllm-bench's PyTorch-backend rows: their limits are the tool's
#: (`trtllm_bench_engine_limits`) and their runtime `trtllm-bench`, the decode CUDA graphs as
#: the tool configures them, padded up to its max_batch_size (the preset's `source` in
#: diffperf/presets/runtimes.json; benchmarks_data/SOURCES.md).
TRTLLM_BENCH_RULE = "TRT-LLM PyTorch backend (trtllm-bench)"

#: (measured column, prediction key, unit factor to the measured unit).
METRICS = (("ttft_mean_ms", "ttft_mean", 1e3), ("ttft_median_ms", "ttft_p50", 1e3),
           ("ttft_p99_ms", "ttft_p99", 1e3), ("itl_mean_ms", "itl_mean", 1e3),
           ("itl_median_ms", "itl_p50", 1e3), ("tpot_mean_ms", "tpot_mean", 1e3),
           ("tpot_median_ms", "tpot_p50", 1e3), ("e2e_mean_ms", "e2e_mean", 1e3),
           ("output_tok_s_total", "output_tok_s", 1.0),
           ("output_tok_s_per_gpu", "output_tok_s_per_gpu", 1.0),
           ("total_tok_s_total", "total_tok_s", 1.0), ("request_tput_rps", "request_rate", 1.0))

_ARCH = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "gated_mlp",
         "num_experts", "experts_per_token")
#: Vocabulary of a model whose published rows leave it empty because the source does not say
#: which release ran, where every candidate gives the same prediction, by (model, engine
#: version) of the rows: TensorRT-LLM 0.17's
#: "Mistral 7B" is v0.1 (vocab 32,000, 4,096-token sliding window) or v0.3 (32,768, full
#: attention). The vocabularies differ by 3.1 M of 7.2 B weights (0.04 %); the window binds
#: only past 4,096 tokens (the 128 x 4,096 rows' last 128 tokens). v0.1's vocabulary is
#: taken, without its window; the choice moves a prediction by less than 0.1 %.
AMBIGUOUS_VOCAB = {("Mistral-7B", "0.17"): 32000.0}


class SkipRow(ValueError):
    """A row the model cannot represent; the message is the reason (counted by its class)."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


@dataclasses.dataclass(frozen=True)
class ServingCase:
    """One row as a deployment under a traffic, with its measured values."""

    id: str
    source_kind: str
    engine_name: str  # the engine preset used
    runtime_name: str  # the runtime preset used
    engine_label: str  # the row's engine column, shortened (vLLM, SGLang, TRT-LLM, LMDeploy)
    regime: str  # "offline saturation", "online at a rate" or "closed loop"
    model: Transformer
    system: object
    plan: InferencePlan
    engine: Engine
    runtime: Runtime
    traffic: Traffic
    replicas: int
    measured: dict
    notes: tuple = ()  # modelling caveats of this row (attention DP, capped requests, ...)
    num_requests_row: int = 0  # requests of the measured run (before any cap)
    sharegpt: bool = False  # output lengths drawn as `sharegpt_outputs` does


def read_serving_rows(paths=SERVING_FILES) -> list[dict]:
    """The rows of the serving CSVs as dicts of stripped strings."""
    out = []
    for p in paths:
        with open(p, newline="", encoding="utf-8") as fh:
            for rec in csv.DictReader(fh):
                out.append({k: (v or "").strip() for k, v in rec.items()})
    return out


def _num(rec: dict, col: str) -> float | None:
    s = rec.get(col, "")
    if s == "":
        return None
    try:
        return float(s)
    except ValueError:
        return None


def default_kv_precision(rec: dict, precision: str) -> str:
    """A row's KV-cache precision when `kv_precision` is empty: bf16 where the engine keeps
    the model's dtype (`diffperf.serving._kv_dtype.keeps_model_dtype_kv`: vLLM, SGLang) and
    for trtllm-serve, which GPUStack ran on Qwen's own FP8 checkpoints, with no KV-cache
    quantization for TensorRT-LLM to follow; else fp8 for an fp4 row (NVIDIA's NVFP4
    checkpoints keep an FP8 KV cache) and the row's precision otherwise."""
    engine_name = ENGINE_RULES[engine_rule(rec)][0]
    if keeps_model_dtype_kv(engine_name, precision) or (
            precision in ("fp8", "fp4") and "trtllm-serve" in rec["engine"].lower()):
        return "bf16"
    return "fp8" if precision == "fp4" else precision


def gpt_oss_precisions(rec: dict, gpu: str) -> tuple[str, str, str] | None:
    """(weights, GEMM activations, default KV cache) of a row serving OpenAI's gpt-oss
    checkpoints, else None. Their MoE weights are MXFP4 and "all the other weights are in
    bf16"; every engine runs them as they ship, whatever the table's precision column says
    (TensorRT-LLM's: FP8 on Hopper, FP4 on Blackwell):

    - TensorRT-LLM on Blackwell: mxfp8 activations x mxfp4 weights (CUTLASS / TRTLLM MoE),
      on Hopper bf16 x mxfp4 (TRITON) (TensorRT-LLM examples/models/core/gpt_oss/README.md,
      "MoE Support Matrix");
    - vLLM / SGLang on Ampere and Hopper: bf16 activations (vLLM's GPT-OSS recipe: Marlin
      MXFP4 MoE on an A100, where "gpt-oss-120b will fit on a single A100 (80GB)"; Triton
      MXFP4 kernels on Hopper).

    Weights are costed as MXFP4's 4.25 bits (`InferencePlan.weight_scale_block` 32; the
    experts hold 97-98 % of the parameters; the bf16 attention and embeddings are not split
    out), GEMMs at bf16 or fp8 math. KV cache, when the
    row sets none: fp8 for TensorRT-LLM on Blackwell (the perf-overview's llm_options), else
    the model's bf16 ('Hopper: use auto'; vLLM / SGLang default)."""
    name = (rec["model"] + " " + rec["model_as_printed"]).lower()
    if "gpt-oss" not in name:
        return None
    blackwell = float(gpu_info(gpu).get("flops_fp4", 0) or 0) > 0
    if blackwell and engine_label(rec) == "TRT-LLM":
        return "fp4", "fp8", "fp8"
    return "int4", "bf16", "bf16"


def engine_label(rec: dict) -> str:
    e = rec["engine"].lower()
    for key, label in (("tensorrt", "TRT-LLM"), ("vllm", "vLLM"), ("sglang", "SGLang"),
                       ("lmdeploy", "LMDeploy")):
        if key in e:
            return label
    return rec["engine"]


#: Engine label (+ detail) -> (engine preset, runtime preset), see the module docstring.
ENGINE_RULES = {"TRT-LLM 0.14 (Triton)": ("trtllm-0.14-triton", "trtllm-engine"),
                "TRT-LLM TensorRT engine 0.17": ("trtllm", "trtllm-engine"),
                "TRT-LLM PyTorch backend": ("trtllm", "trtllm"),
                TRTLLM_BENCH_RULE: ("trtllm", "trtllm-bench"),
                "vLLM": ("vllm", "vllm"), "vLLM A100": ("vllm-a100", "vllm"),
                "SGLang": ("sglang", "sglang"),
                "SGLang 0.4.1 DeepSeek-V3": ("sglang", "sglang-0.4-deepseek-eager"),
                "LMDeploy TurboMind": ("trtllm-0.14-triton", "megatron-core")}


def engine_rule(rec: dict) -> str:
    """The `ENGINE_RULES` key of a row."""
    label = engine_label(rec)
    e, v = rec["engine"].lower(), rec["engine_version"].lower()
    if label == "TRT-LLM":
        if "triton" in e or v.startswith("0.14"):
            return "TRT-LLM 0.14 (Triton)"
        if "tensorrt engine" in e:
            return "TRT-LLM TensorRT engine 0.17"
        return (TRTLLM_BENCH_RULE if "trtllm-bench" in rec["benchmark_tool"]
                else "TRT-LLM PyTorch backend")
    if label == "vLLM":
        return "vLLM A100" if rec["gpu_preset"].startswith("a100") else "vLLM"
    if label == "LMDeploy":
        return "LMDeploy TurboMind"
    if label == "SGLang" and v.startswith("0.4.1") and rec["model"].lower().startswith(
            "deepseek-v3"):
        return "SGLang 0.4.1 DeepSeek-V3"
    return label


def regime_of(rec: dict) -> str:
    rate = rec["request_rate_qps"].lower()
    if _num(rec, "concurrency") or rec["benchmark_tool"].startswith("lmdeploy"):
        return "closed loop"
    if rate in ("inf", ""):
        return "offline saturation"
    return "online at a rate"


_TOTALS = (re.compile(r"totals: (\d+) input / (\d+) output tokens, duration [0-9.]+ s, "
                      r"(\d+) successful requests"),
           re.compile(r"totals: (\d+) input tokens, (\d+) output tokens over (\d+) requests"))


def measured_lengths(notes: str) -> tuple[float, float, int] | None:
    """(mean input, mean output, requests) from the token totals a row's notes print."""
    for pat in _TOTALS:
        m = pat.search(notes)
        if m:
            i, o, n = (float(g) for g in m.groups())
            return i / n, o / n, int(n)
    return None


def _lengths(rec: dict) -> tuple[float, float, str, float]:
    """(mean input, mean output, distribution, spread) of a row (module docstring)."""
    dist = rec["length_distribution"].lower()
    totals = measured_lengths(rec["notes"])
    inp, out = _num(rec, "input_len"), _num(rec, "output_len")
    if "uniform in [1, len]" in dist:
        if totals is None:
            if inp is None or out is None:
                raise SkipRow("lengths missing", "uniform lengths without a maximum")
            mi, mo = (inp + 1) / 2, (out + 1) / 2
        else:
            mi, mo = totals[0], totals[1]
        return mi, mo, "uniform", (min(mi, mo) - 1) / min(mi, mo)
    if totals is not None:
        mi, mo = totals[0], totals[1]
    elif inp is not None and out is not None:
        mi, mo = inp, out
    else:
        raise SkipRow("lengths missing", "ShareGPT lengths without token totals in the notes")
    if "sharegpt" in dist:
        return mi, mo, "uniform", SHAREGPT_SPREAD
    if "+-15%" in dist:
        return mi, mo, "uniform", 0.15
    return mi, mo, "fixed", 0.0


def _model_values(rec: dict, runtime_name: str) -> dict:
    v = {}
    for c in _ARCH:
        x = _num(rec, c)
        if x is None and c == "vocab":
            x = AMBIGUOUS_VOCAB.get((rec.get("model", ""), rec.get("engine_version", "")))
        if x is None:
            if c in ("num_experts", "experts_per_token"):
                x = 1.0
            else:
                raise SkipRow("architecture missing", c)
        v[c] = x
    fixed = runtime_plan_defaults(runtime_name)
    for c, d in {**MODEL_OPTIONAL_FLAGS, **MODEL_OPTIONAL_COUNTS}.items():
        x = _num(rec, c)
        v[c] = fixed.get(c, d) if x is None else x
    v["dropout"] = 0.0
    return v


def serving_case(rec: dict, max_requests: int = DEFAULT_MAX_REQUESTS) -> ServingCase:
    """The `ServingCase` of one CSV row (a dict of strings); raises `SkipRow` with the reason
    for a row the model cannot represent (`prepare` makes the checks that need the cost
    model: feasibility, admission, budget)."""
    gpu = rec["gpu_preset"].lower()
    if not gpu or gpu not in gpu_names():
        raise SkipRow("no gpu preset", rec["gpu"])
    precision = rec["precision"].lower()
    weights = activations = precision
    kv = rec["kv_precision"].lower() or default_kv_precision(rec, precision)
    gpt_oss = gpt_oss_precisions(rec, gpu)
    if gpt_oss is not None:
        weights, activations, kv_default = gpt_oss
        kv = rec["kv_precision"].lower() or kv_default
    try:
        check_precision_names(gpu, precision=precision, kv_precision=kv)
        sys_ = system(gpu)
    except ValueError as e:
        raise SkipRow("unsupported precision", str(e)) from None
    rule = engine_rule(rec)
    eng_name, rt_name = ENGINE_RULES[rule]
    notes: list[str] = []
    tp, pp = _num(rec, "tp") or 1.0, _num(rec, "pp") or 1.0
    num_gpus = _num(rec, "num_gpus") or tp * pp
    replicas = num_gpus / (tp * pp)
    if replicas != round(replicas) or replicas < 1:
        raise SkipRow("gpus not a multiple of tp*pp", f"{num_gpus:g} GPUs, tp*pp {tp * pp:g}")
    v = _model_values(rec, rt_name)
    ep = _num(rec, "ep")
    attention_dp = 1.0 if rec.get("attention_dp") == "1" else 0.0
    if attention_dp:
        if ep is None and v["num_experts"] > 1 and v["num_experts"] % tp == 0:
            ep = tp
    ep = 1.0 if ep is None or v["num_experts"] <= 1 else ep
    mi, mo, dist, spread = _lengths(rec)
    sharegpt = "sharegpt" in rec["length_distribution"].lower()
    context = math.ceil(mi * (1 + spread) + mo * (1 + spread)) + 1
    model = row_model(v, max(context, SHAREGPT_MAX_TOTAL + 1) if sharegpt else context)
    fields: dict[str, Any] = dict(tp=tp, pp=pp, ep=ep, batch=1.0, input_len=float(round(mi)),
                                  output_len=float(round(mo)), attention_dp=attention_dp,
                                  weight_precision=weights,
                                  # gpt-oss's MoE weights are MXFP4 on every engine
                                  weight_scale_block=(WEIGHT_SCALE_BLOCK["int4"] if gpt_oss
                                                      else weight_scale_block(weights)),
                                  activation_precision=activations, kv_precision=kv)
    plan = InferencePlan(**fields)
    eng = engine_preset(eng_name)
    overrides = {}
    for col, field in (("max_num_seqs", "max_num_seqs"),
                       ("max_num_batched_tokens", "max_num_batched_tokens"),
                       ("chunked_prefill", "chunked_prefill")):
        x = _num(rec, col)
        if x is not None:
            overrides[field] = x
    if rule == "LMDeploy TurboMind":
        overrides["kv_output_reserve"] = 0.0
        overrides["context_pass"] = 1.0
        config = LMDEPLOY_CONFIG.get(rec["model_as_printed"])
        if config is not None:
            seqs, blocks = config
            overrides.update(max_num_seqs=float(seqs), block_size=float(LMDEPLOY_BLOCK),
                             kv_cache_tokens=float(blocks * LMDEPLOY_BLOCK))
        # every prompt waiting joins the next iteration's context pass (sub-batched within it,
        # no budget across iterations): a budget the longest prompts of every slot fit in
        seqs = overrides.get("max_num_seqs", float(eng.max_num_seqs))
        overrides["max_num_batched_tokens"] = seqs * math.ceil(mi * (1 + spread))
        overrides["chunked_prefill"] = 0.0
    if "trtllm-bench" in rec["benchmark_tool"] and "0.95" in rec["notes"]:
        overrides["kv_memory_fraction"] = 0.95
    longest = mi * (1 + spread)
    row_budget = "max_num_batched_tokens" in overrides
    if rule == TRTLLM_BENCH_RULE and not {"max_num_seqs",
                                          "max_num_batched_tokens"} & overrides.keys():
        # at the KV fraction the engine gets (the notes' 0.95, else the preset's = the tool's)
        try:
            bs, tokens = trtllm_bench_engine_limits(
                model, sys_.accelerator, tp=tp, pp=pp,
                weight_precision="fp4" if weights == "int4" else weights,
                kv_precision=kv, isl=mi, osl=mo, max_isl=longest,
                kv_fraction=overrides.get("kv_memory_fraction", float(eng.kv_memory_fraction)))
        except ValueError as e:
            raise SkipRow("request never admitted", str(e)) from None
        overrides["max_num_seqs"], overrides["max_num_batched_tokens"] = bs, tokens
        notes.append(f"trtllm-bench limits: max_batch_size {bs}, max_num_tokens {tokens}")
    budget = overrides.get("max_num_batched_tokens", float(eng.max_num_batched_tokens))
    if eng_name == "trtllm" and not row_budget and longest > budget:
        # the run finished, so the engine took the whole prompt (a TensorRT engine built by
        # trtllm-bench without chunked context; trtllm-serve rows are taken the same way)
        budget = 2.0 ** math.ceil(math.log2(longest))
        overrides["max_num_batched_tokens"] = budget
        notes.append(f"max_num_tokens raised to {budget:g} (prompt of {longest:g} tokens)")
    if overrides:
        eng = Engine(**{f: overrides.get(f, getattr(eng, f)) for f in ENGINE_FIELDS})
    regime = regime_of(rec)
    conc = int(_num(rec, "concurrency") or 0)
    n_row = _num(rec, "num_requests")
    if regime == "closed loop" and rec["benchmark_tool"].startswith("lmdeploy") and not conc:
        conc = int(_num(rec, "max_num_seqs") or 0)
    if regime == "closed loop" and not conc:
        m = re.search(r"bs(\d+)", rec["id"])
        conc = int(m.group(1)) if m else 0
        if not conc:
            raise SkipRow("concurrency missing")
    if n_row is None:
        totals = measured_lengths(rec["notes"])
        if totals is not None:
            n_row = float(totals[2])
        elif regime == "closed loop":
            n_row = float(conc * LMDEPLOY_ROUNDS)
        else:
            n_row = float(DEFAULT_REQUESTS)
            notes.append(f"num_requests empty: {DEFAULT_REQUESTS} taken")
    n = int(n_row)
    if regime == "offline saturation" and n > max_requests:
        notes.append(f"{n} requests capped at {max_requests}")
        n = max_requests
    rate = math.inf if regime != "online at a rate" else float(rec["request_rate_qps"])
    traffic = Traffic(rate=rate, num_requests=n, input_len=mi, output_len=mo,
                      input_spread=spread, output_spread=spread, distribution=dist,
                      concurrency=conc if regime == "closed loop" else 0, seed=0)
    measured = {}
    for col, _, _ in METRICS:
        x = _num(rec, col)
        if x is not None and x > 0 and math.isfinite(x):
            measured[col] = x
    if measured.get("itl_median_ms", math.inf) < BURST_GAP_MS:
        del measured["itl_median_ms"]
        notes.append("itl_median_ms below 1 ms: tokens streamed in bursts, not compared")
    if not measured:
        raise SkipRow("nothing measured")
    case = ServingCase(id=rec["id"], source_kind=rec["source_kind"], engine_name=eng_name,
                       runtime_name=rt_name, engine_label=engine_label(rec), regime=regime,
                       model=model, system=sys_, plan=plan, engine=eng,
                       runtime=runtime_preset(rt_name), traffic=traffic,
                       replicas=int(replicas), measured=measured, notes=tuple(notes),
                       num_requests_row=int(n_row), sharegpt=sharegpt)
    return case


@dataclasses.dataclass
class _Prepared:
    case: ServingCase
    cost: object
    kv: float
    engine: Engine
    arrival: np.ndarray
    inp: np.ndarray
    out: np.ndarray
    concurrency: int


def schedulers(case: ServingCase) -> int:
    """Schedulers the row's stream is split over: replicas x attention-DP ranks."""
    return case.replicas * int(round(float(case.plan.attention_ranks)))


def sharegpt_outputs(inp, mean: float, seed: int = 0) -> np.ndarray:
    """Output lengths of a ShareGPT row's requests with prompts `inp`, tokens: exponential at
    the measured `mean`, rounded, within [1, SHAREGPT_MAX_TOTAL - prompt].

    The rows print only the mean reply length (the notes' token totals). ShareGPT's replies
    are long-tailed (Kwon et al., SOSP 2023, Fig. 11: mean 338 tokens, a tail to the 2,048
    cut), and with every request sent at once the longest replies, decoding nearly alone
    after the rest have finished, set the run's duration. Of the laws of a positive length
    with a given mean, the exponential assumes the least (maximum entropy); the uniform on
    [0, 2 mean] used before ends at twice the mean. ASSUMED, not fitted: the shape is the
    mean's exponential, then the draws are scaled once to the measured mean and clipped."""
    inp = np.asarray(inp, float)
    rng = np.random.default_rng(seed + 1)
    cap = np.maximum(SHAREGPT_MAX_TOTAL - inp, 1.0)
    out = np.clip(rng.exponential(mean, inp.shape), 1.0, cap)
    out = np.clip(np.round(out * (mean / out.mean())), 1.0, cap)
    return out


def _stream(case: ServingCase):
    arrival, inp, out = traffic_requests(case.traffic)
    if case.sharegpt:
        out = sharegpt_outputs(inp, case.traffic.output_len, case.traffic.seed).astype(
            np.asarray(out).dtype)
    r = schedulers(case)
    conc = case.traffic.concurrency
    if conc:
        conc = max(1, math.ceil(conc / r))
    return arrival[::r], inp[::r], out[::r], conc


def prepare(case: ServingCase, efficiency=None) -> _Prepared:
    """Check a case as `serve` does and build its iteration cost and KV capacity; raises
    `SkipRow` (infeasible plan, request never admitted, prompt over the budget)."""
    arrival, inp, out, conc = _stream(case)
    typical = eqx_replace(case.plan, batch=1.0, input_len=float(np.round(np.mean(inp))),
                          output_len=float(np.round(np.mean(out))))
    rep = _infer_jit(case.model, case.system, typical, efficiency, case.runtime)
    if not bool(rep.feasible):
        raise SkipRow("plan infeasible", explain(int(rep.reason)))
    eng = case.engine
    cost, kv = _cost_and_capacity(case.model, case.system, typical, eng,
                                  resolve_efficiency(efficiency), case.runtime)
    kv = float(kv)
    res = np.asarray(reservation(eng, inp, out))
    if res.max() > kv:
        raise SkipRow("request never admitted",
                      f"{res.max():g} KV tokens needed, a replica holds {kv:g}")
    if float(eng.chunked_prefill) == 0 and inp.max() > float(eng.max_num_batched_tokens):
        raise SkipRow("prompt over budget without chunked prefill",
                      f"{inp.max():g} > {float(eng.max_num_batched_tokens):g}")
    # slots: at most the requests (or clients) that can ever run at once; a smaller
    # max_num_seqs with the same bound schedules identically and is cheaper to simulate
    bound = len(inp) if not conc else min(conc, len(inp))
    least = np.asarray(held(eng, inp, 0.0, out))  # what a request holds at admission
    bound = min(bound, int(kv // max(least.min(), 1.0)))
    seqs = int(min(float(eng.max_num_seqs), max(bound, 1)))
    kw: dict[str, Any] = {f: getattr(eng, f) for f in ENGINE_FIELDS}
    eng = Engine(**{**kw, "max_num_seqs": seqs})
    return _Prepared(case, cost, kv, eng, arrival, inp, out, conc)


_infer_jit = jax.jit(lambda m, s, p, e, r: infer(m, s, p, resolve_efficiency(e), r))


def _slot_bucket(s: int) -> int:
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
        if s <= b:
            return b
    return s


def _batched(slots: int, steps: int):
    key = (slots, steps)
    if key not in _PROGRAMS:
        def run(cost, eng, kv, req, conc):
            return jax.vmap(lambda c, e, k, r, cc: simulate(c, e, k, r, slots, steps, cc))(
                cost, eng, kv, req, conc)
        _PROGRAMS[key] = jax.jit(run)
    return _PROGRAMS[key]


_PROGRAMS: dict = {}


def _stack(xs):
    return jax.tree_util.tree_map(lambda *a: jnp.stack([jnp.asarray(x) for x in a]), *xs)


def _summary(p: _Prepared, arrival, first, finish, gap_count, gap_sum) -> dict:
    """The benchmark aggregates of one replica's real requests (`report`'s definitions; the
    median inter-token gap from the simulation's gap bins)."""
    n = len(p.inp)
    arrival, first, finish = arrival[:n], first[:n], finish[:n]
    out, inp = p.out, p.inp
    ttft = first - arrival
    dec = out > 1
    tpot = (finish - first)[dec] / (out[dec] - 1)
    duration = max(finish.max() - arrival.min(), 1e-12)
    r = schedulers(p.case)
    tok_s = r * out.sum() / duration
    return {"ttft_mean": ttft.mean(), "ttft_p50": np.percentile(ttft, 50),
            "ttft_p99": np.percentile(ttft, 99),
            "itl_mean": ((finish - first)[dec].sum() / max((out[dec] - 1).sum(), 1.0)),
            "tpot_mean": tpot.mean() if tpot.size else 0.0,
            "tpot_p50": np.percentile(tpot, 50) if tpot.size else 0.0,
            "itl_p50": float(binned_percentile(gap_count, gap_sum, 50.0)),
            "e2e_mean": (finish - arrival).mean(), "output_tok_s": tok_s,
            "output_tok_s_per_gpu": tok_s / (p.case.replicas * float(p.case.plan.num_gpus)),
            "total_tok_s": r * (out.sum() + inp.sum()) / duration,
            "request_rate": r * n / duration}


def predict_cases(cases: list[ServingCase], efficiency=None,
                  progress: Callable[[str], None] | None = None, group_rows: int = 64):
    """Predict every case: `(predictions, skipped)`, predictions `{id: {key: value}}` (keys of
    `METRICS`' second field, seconds and per second), skipped `[(id, reason kind, detail)]`.

    Cases are grouped by their stream size and slot count (rounded up to a power of two) and
    simulated `group_rows` at a time in one vmapped `diffperf.serving.simulate` (chunks padded
    to a power of two rows with copies of their last row)."""
    say = progress or (lambda s: None)
    skipped, ready = [], []
    for i, c in enumerate(cases):
        try:
            ready.append(prepare(c, efficiency))
        except SkipRow as e:
            skipped.append((c.id, e.kind, str(e)))
        if progress and (i + 1) % 200 == 0:
            say(f"  prepared {i + 1}/{len(cases)} rows")
    groups: dict = defaultdict(list)
    for p in ready:
        n = len(p.inp)
        size = n  # exact sizes: padding a stream would change its bound on steps
        groups[(size, bool(p.concurrency), _slot_bucket(int(p.engine.max_num_seqs)))].append(p)
    preds = {}
    done = 0
    for (size, closed, slots), members in sorted(groups.items()):
        for k in range(0, len(members), group_rows):
            chunk = members[k:k + group_rows]
            # pad the chunk to a power of two rows (reused compiled programs)
            rows = 1
            while rows < len(chunk):
                rows *= 2
            padded = chunk + [chunk[-1]] * (rows - len(chunk))
            arr = [p.arrival for p in padded]
            inp = [p.inp for p in padded]
            out = [p.out for p in padded]
            budget = np.array([float(p.engine.max_num_batched_tokens) for p in padded])
            steps = int(max(4 * size + np.ceil(i.sum() / b) + 16
                            for i, b in zip(inp, budget)))
            steps = 1 << int(math.ceil(math.log2(steps)))  # a bound: rounded up, shared
            f = jnp.result_type(float)
            req = Requests(jnp.asarray(np.stack(arr), f), jnp.asarray(np.stack(inp), f),
                           jnp.asarray(np.stack(out), f))
            sched = _batched(slots, steps)(
                _stack([p.cost for p in padded]), _stack([p.engine for p in padded]),
                jnp.asarray([p.kv for p in padded], f), req,
                jnp.asarray([float(p.concurrency) for p in padded], f))
            a, fi, fn, comp, peak, gc, gs = (np.asarray(x, float) for x in (
                sched.arrival, sched.first_token, sched.finish, sched.completed, sched.kv_peak,
                sched.gap_count, sched.gap_sum))
            for j, p in enumerate(chunk):
                if comp[j] < 1:
                    skipped.append((p.case.id, "simulation incomplete", f"{steps} steps"))
                    continue
                preds[p.case.id] = _summary(p, a[j], fi[j], fn[j], gc[j], gs[j])
                preds[p.case.id]["kv_peak_share"] = peak[j] / max(p.kv, 1.0)
            done += len(chunk)
            say(f"  simulated {done}/{len(ready)} rows (group: {size} requests, "
                f"{slots} slots, {'closed' if closed else 'open'} loop)")
    return preds, skipped


def compare(cases: list[ServingCase], preds: dict) -> list[dict]:
    """One record per (row, measured column): predicted and measured in the column's unit,
    with the row's source kind, engine, regime and ratio pred / meas."""
    out = []
    for c in cases:
        if c.id not in preds:
            continue
        for col, key, scale in METRICS:
            if col in c.measured:
                pred = float(preds[c.id][key]) * scale
                out.append({"id": c.id, "source_kind": c.source_kind, "engine": c.engine_label,
                            "engine_preset": c.engine_name, "regime": c.regime, "metric": col,
                            "predicted": pred, "measured": c.measured[col],
                            "ratio": pred / c.measured[col],
                            "kv_peak_share": float(preds[c.id].get("kv_peak_share", 0.0))})
    return out


def error_table(records: list[dict], by: tuple[str, ...]) -> list[dict]:
    """MAPE (mean |pred/meas - 1|), median pred/meas, and the share predicted too fast, per
    group of `by` fields. 'Too fast': a latency predicted below its measurement, a throughput
    above it."""
    groups: dict = defaultdict(list)
    for r in records:
        groups[tuple(r[k] for k in by)].append(r)
    out = []
    for key, rs in sorted(groups.items()):
        ratio = np.array([r["ratio"] for r in rs])
        tput = np.array([_is_throughput(r["metric"]) for r in rs])
        fast = np.where(tput, ratio > 1, ratio < 1)
        out.append({**dict(zip(by, key)), "n": len(rs),
                    "mape": float(np.mean(np.abs(ratio - 1))),
                    "median_ratio": float(np.median(ratio)),
                    "too_fast": float(np.mean(fast))})
    return out


def _is_throughput(metric: str) -> bool:
    return metric.endswith("tok_s_total") or metric.endswith("per_gpu") or metric.endswith("rps")
