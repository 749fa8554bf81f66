"""Benchmark CSV loading (the format of docs/benchmark-format.md) and rows to specs."""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .._checks import MAX_EXACT_COUNT
from ..presets import (
    DEFAULT_RUNTIME,
    check_precision_names,
    gpu_names,
    runtime,
    runtime_names,
    runtime_plan_defaults,
    system,
)
from ..specs._hardware import PRECISION_CODES, System, weight_scale_block, weight_storage
from ..specs._runtime import Runtime
from ..specs._training_plan import RECOMPUTE_CODES, TrainingPlan, layer_count_error
from ..specs._transformer import Transformer

COMMON = ("id", "kind", "source", "model", "layers", "hidden", "heads", "kv_heads", "ffn_hidden",
          "vocab", "gated_mlp", "num_experts", "experts_per_token", "gpu", "num_gpus",
          "gpus_per_node", "tp", "pp", "precision")
TRAIN = ("seq_len", "dp", "cp", "ep", "vp", "sequence_parallel", "global_batch", "micro_batch",
         "recompute", "zero", "flash_attention")
INFER = ("batch", "input_len", "output_len")
#: diffperf extension columns of train rows (optional; the schema lets other readers ignore them):
#: 0/1 flags for overlapping TP communication with GEMMs, the backward TP reduction with the
#: weight-gradient GEMMs and the gradient reduction with the backward pass (empty or absent = 1,
#: what current Megatron-core / NeMo recipes do), and for
#: ZeRO-3 gathering weight matrix by weight matrix (DeepSpeed; empty or absent = 0, FSDP units),
#: for fp32 gradient buffers (empty or absent = 1, Megatron-LM for bf16; 0 = 16-bit), for
#: counting the embedding and the loss as pipeline layers (empty or absent = 0), for fp32
#: Adam moments (empty or absent = 1; 0 = bf16 moments, Megatron's precision-aware optimizer),
#: for overlapping the expert-parallel all-to-alls with another micro-batch (empty or
#: absent = 0), and for one kernel per grouped expert GEMM (empty or absent = 0: one per local
#: expert).
TRAIN_OPTIONAL_FLAGS = {"overlap_tp": 1.0, "overlap_tp_backward": 1.0, "overlap_dp": 1.0,
                        "zero3_per_matrix": 0.0, "fp32_gradients": 1.0,
                        "account_embedding_loss": 0.0, "fp32_optimizer_moments": 1.0,
                        "overlap_ep": 0.0, "fused_expert_gemm": 0.0, "recompute_norms": 0.0,
                        "recompute_moe_act": 0.0, "recompute_mla_up": 0.0, "recompute_mlp": 0.0}
#: diffperf extension columns of rows of both kinds: 0/1, a parallel attention + MLP block
#: (GPT-J, Falcon; empty or absent = 0, the sequential block), whether training applies
#: dropout (empty or absent = 1, Korthikanti's GPT; 0 for Llama-style models), and whether the
#: output head is tied to the embedding (empty or absent = 0), and whether the routed experts
#: carry biases and clamp their gated activation's inputs (gpt-oss; empty or absent = 0); see
#: `Transformer`.
MODEL_OPTIONAL_FLAGS = {"parallel_attention": 0.0, "dropout": 1.0, "tied_embeddings": 0.0,
                        "expert_bias": 0.0, "glu_clamp": 0.0}
#: diffperf extension columns of rows of both kinds (empty or absent = 0): the per-head width
#: where it is not hidden / heads (Gemma, Qwen3; 0 = hidden / heads; `Transformer.head_width`),
#: the sliding-window attention of Mistral 7B v0.1 / Gemma (`Transformer.sliding_window`,
#: 0 = none, and `Transformer.global_layers`), and a MoE model's dense-MLP layers
#: (`Transformer.dense_layers` and `dense_ffn_hidden`, 0 = ffn_hidden) and shared expert
#: (`Transformer.shared_ffn_hidden`, 0 = none), and multi-head latent attention
#: (`Transformer.kv_lora_rank`, 0 = standard attention, and its other widths).
MODEL_OPTIONAL_COUNTS = {"head_dim": 0.0, "sliding_window": 0.0, "global_layers": 0.0,
                         "dense_layers": 0.0, "dense_ffn_hidden": 0.0, "shared_ffn_hidden": 0.0,
                         "kv_lora_rank": 0.0, "q_lora_rank": 0.0, "rope_head_dim": 0.0,
                         "v_head_dim": 0.0}
#: diffperf extension columns of train rows holding layer counts (empty or absent = 0): layers
#: per pipeline chunk fully recomputed (Megatron's block method) and with activations offloaded
#: to host memory, and the expert MLPs' tensor-parallel degree (0 = tp); see
#: `TrainingPlan.recompute_layers` / `offload_layers` / `expert_tp`.
TRAIN_OPTIONAL_COUNTS = {"recompute_layers": 0.0, "offload_layers": 0.0, "expert_tp": 0.0}
#: diffperf extension column of infer rows: 0/1, whether decode attention runs a grouped
#: tensor-core kernel (empty or absent = 1) or TensorRT-LLM's per-query-head masked MHA (0); see
#: `InferencePlan.grouped_decode_attention`.
INFER_OPTIONAL_FLAGS = {"grouped_decode_attention": 1.0}
#: diffperf extension column of infer rows: the share of the tensor-core peak the weight GEMMs
#: can issue, in (0, 1] (empty or absent = 1); see `InferencePlan.gemm_peak_fraction`.
INFER_OPTIONAL_FRACTIONS = {"gemm_peak_fraction": 1.0}
#: diffperf extension column of infer rows: the most prompt tokens one prefill pass processes
#: (chunked prefill; empty or absent = 0, the whole batch at once); see
#: `InferencePlan.prefill_tokens`.
INFER_OPTIONAL_COUNTS = {"prefill_tokens": 0.0}
#: The measured columns of a train row that time the step (what calibration fits) ...
TRAIN_TIME_METRICS = ("step_time_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu")
#: ... and every measured column of a train row.
TRAIN_METRICS = (*TRAIN_TIME_METRICS, "peak_memory_gb")
#: The measured columns of an infer row.
INFER_METRICS = ("e2e_latency_s", "ttft_s", "tpot_s", "output_tok_s_per_gpu")
#: Documented defaults for empty plan cells (docs/benchmark-format.md).
TRAIN_DEFAULTS = {"vp": 1, "micro_batch": 1, "zero": 1, "flash_attention": 1, "recompute": "none",
                  "cp": 1, "ep": 1}
#: Columns that must hold a number in every row of a kind (others may be empty).
_REQUIRED_NUMBERS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "gated_mlp",
                     "num_experts", "experts_per_token", "num_gpus", "gpus_per_node", "tp", "pp")


#: Columns holding counts (sizes, lengths, degrees, GPUs, batches): at most `MAX_EXACT_COUNT`.
_COUNTS = frozenset(_REQUIRED_NUMBERS + ("seq_len", "dp", "global_batch", "cp", "ep", "vp",
                                         "micro_batch") + INFER + tuple(TRAIN_OPTIONAL_COUNTS)
                     + tuple(MODEL_OPTIONAL_COUNTS))


class BenchmarkError(ValueError):
    """A malformed benchmark CSV: the message names the file, row (1-based) and column."""


@dataclass
class BenchmarkRow:
    """One parsed row: its specs (for train rows) and the defaults it relied on."""

    id: str
    kind: str
    source: str
    measured: dict[str, float]
    values: dict
    defaults_used: list[str] = field(default_factory=list)


def _err(path, row, column, msg) -> BenchmarkError:
    return BenchmarkError(f"{path}: row {row}, column '{column}': {msg}")


def _number(path, i, col, value, required=True):
    if value is None or (isinstance(value, float) and np.isnan(value)) or value == "":
        if required:
            raise _err(path, i, col, "is empty but required")
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise _err(path, i, col, f"{value!r} is not a number") from None
    if not np.isfinite(x):
        raise _err(path, i, col, f"{value!r} is not a finite number")
    if col in _COUNTS and (x < 0 or x != round(x)):
        raise _err(path, i, col, f"must be a whole number >= 0, got {value}")
    if col in _COUNTS and x > MAX_EXACT_COUNT:
        raise _err(path, i, col, f"must be <= {MAX_EXACT_COUNT} (2^24: larger counts are not "
                                 f"exact in float32), got {value}")
    return x


def _flags(path, i, rec, flags: dict[str, float]) -> dict[str, float]:
    """Optional 0/1 extension columns of row `i`: their value, or the default when empty."""
    out = {}
    for c, default in flags.items():
        x = _number(path, i, c, rec.get(c, ""), required=False)
        if x not in (None, 0.0, 1.0):
            raise _err(path, i, c, f"must be 0 or 1, got {rec[c]!r}")
        out[c] = default if x is None else x
    return out


def _fractions(path, i, rec, fractions: dict[str, float]) -> dict[str, float]:
    """Optional extension columns holding a share in (0, 1] (empty or absent = the default)."""
    out = {}
    for c, default in fractions.items():
        x = _number(path, i, c, rec.get(c, ""), required=False)
        if x is not None and not 0.0 < x <= 1.0:
            raise _err(path, i, c, f"must lie in (0, 1], got {rec[c]!r}")
        out[c] = default if x is None else x
    return out


def _weight_precision(path, i, rec, precision: str) -> str:
    """The optional `weight_precision` column (weight-only quantisation): the precision name of
    the weights' storage width (`diffperf.specs.weight_storage`); empty = the row's `precision`."""
    name = rec.get("weight_precision", "")
    if not name:
        return precision
    try:
        return weight_storage(name, precision)
    except ValueError as e:
        raise _err(path, i, "weight_precision", str(e)) from None


def _kv_precision(path, i, rec, precision: str) -> str:
    """The optional `kv_precision` column: the precision name the KV cache is stored in;
    empty = the row's `precision`."""
    name = (rec.get("kv_precision") or "").lower()
    if not name:
        return precision
    if name not in PRECISION_CODES:
        raise _err(path, i, "kv_precision", f"must be one of {sorted(PRECISION_CODES)}, got "
                                            f"{rec['kv_precision']!r}")
    return name


def _optional_counts(path, i, rec, counts: dict[str, float]) -> dict[str, float]:
    """Optional whole-number columns (>= 0; empty or absent = their default)."""
    out = {}
    for c, default in counts.items():
        x = _number(path, i, c, rec.get(c, ""), required=False)
        if x is not None and (x < 0 or x != round(x)):
            raise _err(path, i, c, f"must be a whole number >= 0, got {rec[c]!r}")
        out[c] = default if x is None else x
    return out


def read_benchmark_files(paths, require_measured: bool = True) -> list[BenchmarkRow]:
    """`read_benchmarks` of each path, in order; raises `BenchmarkError` when two files use
    the same row id (results are reported by id)."""
    rows, first = [], {}
    for p in paths:
        for i, r in enumerate(read_benchmarks(p, require_measured), start=1):
            if r.id in first:
                raise _err(p, i, "id", f"{r.id!r} is also an id in {first[r.id]}: ids must be "
                                       f"unique across the files given")
            first[r.id] = p
            rows.append(r)
    return rows


def _leading_comments(path: Path) -> int:
    """Lines starting with '#', and blank lines, before the header (skipped; comments elsewhere
    are not)."""
    n = 0
    try:
        with open(path, encoding="utf-8-sig", errors="replace") as fh:
            for line in fh:
                if line.strip() and not line.lstrip().startswith("#"):
                    break
                n += 1
    except OSError:
        pass  # pandas reports the missing file
    return n


def _check_field_counts(path: Path) -> None:
    """Raise naming the first row whose field count differs from the header's (pandas would
    silently fill a short row with empty cells)."""
    with open(path, newline="", encoding="utf-8", errors="replace") as fh:
        for _ in range(_leading_comments(path)):
            next(fh)
        reader = csv.reader(fh)
        header = [c.strip() for c in next(reader, [])]
        twice = sorted({c for c in header if header.count(c) > 1})
        if twice:
            raise BenchmarkError(f"{path}: column(s) {twice} appear more than once in the header")
        rows = (r for r in reader if r)  # blank lines are skipped, as pandas does
        for i, rec in enumerate(rows, start=1):
            if rec[0].lstrip().startswith("#"):
                raise BenchmarkError(f"{path}: row {i} starts with '#': comment lines may only "
                                     f"come before the header")
            if len(rec) < len(header):
                raise _err(path, i, header[len(rec)], f"is missing: the row has {len(rec)} "
                           f"fields, the header {len(header)}")
            if len(rec) > len(header):
                raise BenchmarkError(f"{path}: row {i} has {len(rec)} fields, the header "
                                     f"{len(header)}")


def read_benchmarks(path: str | Path, require_measured: bool = True) -> list[BenchmarkRow]:
    """Read and check a benchmark CSV of either kind (`train` / `infer`, per row).

    Raises `BenchmarkError` naming the file, row (1-based, header excluded) and column for a
    missing required column, an unknown kind, precision, recompute mode or GPU, or a bad number.
    `require_measured=False` accepts rows without any measured column (configurations to
    predict, `diffperf predict`).
    """
    import pandas as pd
    path = Path(path)
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False,
                         skiprows=_leading_comments(path))
    except FileNotFoundError:
        raise BenchmarkError(f"{path}: file not found") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise BenchmarkError(f"{path}: not a readable CSV ({e})") from None
    df.columns = [str(c).strip() for c in df.columns]  # "id, kind, ..." headers
    missing = [c for c in COMMON if c not in df.columns]
    if missing:
        header = ",".join(df.columns)
        hint = next((f" (the header holds {sep!r}: is the file comma-separated?)"
                     for sep in (";", "\t", "|") if sep in header), "")
        listed = (f"{missing}" if len(missing) <= 6 else
                  f"{missing[:6]}... ({len(missing)} of {len(COMMON)})")
        raise BenchmarkError(f"{path}: missing required column(s) {listed}{hint}; the header "
                             f"read was: {header[:120]}")
    _check_field_counts(path)
    kinds = set(df["kind"].str.strip().str.lower())
    for kind, cols in (("train", TRAIN), ("infer", INFER)):
        if kind in kinds:
            miss = [c for c in cols if c not in df.columns]
            if miss:
                raise BenchmarkError(f"{path}: '{kind}' rows need column(s) {miss}")
    known_gpus = set(gpu_names())
    rows, seen = [], set()
    for i, rec in enumerate(df.to_dict("records"), start=1):
        rec = {k: (v.strip() if isinstance(v, str) else v) for k, v in rec.items()}
        rid, kind = rec["id"], rec["kind"].lower()
        rec["gpu"] = rec["gpu"].lower()
        if not rid:
            raise _err(path, i, "id", "is empty")
        if rid in seen:
            raise _err(path, i, "id", f"duplicate id {rid!r}")
        seen.add(rid)
        if kind not in ("train", "infer"):
            raise _err(path, i, "kind", f"must be 'train' or 'infer', got {kind!r}")
        if rec["gpu"] not in known_gpus:
            raise _err(path, i, "gpu", f"unknown gpu {rec['gpu']!r}; known: "
                                       f"{', '.join(sorted(known_gpus))}")
        if rec["precision"].lower() not in PRECISION_CODES:
            raise _err(path, i, "precision", f"must be one of {sorted(PRECISION_CODES)}, got "
                                             f"{rec['precision']!r}")
        for c in ("precision", "weight_precision"):
            try:
                check_precision_names(rec["gpu"], **{c: rec.get(c) or None})
            except ValueError as e:
                raise _err(path, i, c, str(e).split(": ", 1)[1]) from None
        values = {c: _number(path, i, c, rec[c]) for c in _REQUIRED_NUMBERS}
        values["gpu"] = rec["gpu"]
        values["runtime"] = (rec.get("runtime") or DEFAULT_RUNTIME).lower()
        if values["runtime"] not in runtime_names():
            raise _err(path, i, "runtime", f"unknown runtime {rec['runtime']!r}; known: "
                                           f"{', '.join(runtime_names())}")
        values["precision"] = rec["precision"].lower()
        fixed = runtime_plan_defaults(values["runtime"])  # the runtime's software defaults
        values.update(_flags(path, i, rec, {**MODEL_OPTIONAL_FLAGS,
                                            **{k: v for k, v in fixed.items()
                                               if k in MODEL_OPTIONAL_FLAGS}}))
        values.update(_optional_counts(path, i, rec, MODEL_OPTIONAL_COUNTS))
        defaults = []
        if kind == "train":
            for c in ("seq_len", "dp", "global_batch"):
                values[c] = _number(path, i, c, rec[c])
            for c in ("cp", "ep", "vp", "micro_batch", "zero", "flash_attention",
                      "sequence_parallel"):
                values[c] = _number(path, i, c, rec[c], required=False)
            rc = rec["recompute"].lower()
            if rc and rc not in RECOMPUTE_CODES:
                raise _err(path, i, "recompute", f"must be one of {sorted(RECOMPUTE_CODES)}, "
                                                 f"got {rc!r}")
            values["recompute"] = rc or None
            for c, d in TRAIN_DEFAULTS.items():
                if values[c] is None:
                    values[c] = fixed.get(c, d)
                    defaults.append(c)
            values.update(_flags(path, i, rec, {**TRAIN_OPTIONAL_FLAGS,
                                                **{k: v for k, v in fixed.items()
                                                   if k in TRAIN_OPTIONAL_FLAGS}}))
            values.update(_optional_counts(path, i, rec, TRAIN_OPTIONAL_COUNTS))
            if values["sequence_parallel"] is None:
                values["sequence_parallel"] = 1 if values["tp"] > 1 else 0
                defaults.append("sequence_parallel")
            metrics = TRAIN_METRICS
        else:
            for c in INFER:
                values[c] = _number(path, i, c, rec[c])
            values["ep"] = _number(path, i, "ep", rec.get("ep"), required=False)
            if values["ep"] is None:
                values["ep"] = 1.0  # an extension column for infer rows: not a schema default
            elif values["ep"] < 1:
                raise _err(path, i, "ep", f"must be a whole number >= 1, got {rec['ep']}")
            values.update(_flags(path, i, rec, INFER_OPTIONAL_FLAGS))
            values.update(_fractions(path, i, rec, INFER_OPTIONAL_FRACTIONS))
            values.update(_optional_counts(path, i, rec, INFER_OPTIONAL_COUNTS))
            values["weight_precision"] = _weight_precision(path, i, rec, values["precision"])
            # int4 (group-wise) weights carry one 8-bit scale per 32, NVFP4 per 16
            values["weight_scale_block"] = weight_scale_block(
                rec.get("weight_precision", "") or values["precision"])
            values["kv_precision"] = _kv_precision(path, i, rec, values["precision"])
            metrics = INFER_METRICS
        measured = {}
        for c in metrics if require_measured else ():  # predict ignores measured columns
            if c in rec:
                x = _number(path, i, c, rec[c], required=False)
                if x is not None:
                    if x <= 0:
                        raise _err(path, i, c, f"measured value must be > 0, got {x:g}")
                    measured[c] = x
        if not measured and require_measured:
            raise _err(path, i, "/".join(metrics), "no measured column is filled")
        rows.append(BenchmarkRow(rid, kind, rec.get("source", ""), measured, values, defaults))
    return rows


#: Optional model columns named differently from their `Transformer` field.
_FIELD_OF_COLUMN = {"head_dim": "head_width"}


def row_model(v: dict, seq_len) -> Transformer:
    """The `Transformer` of a row's values (either kind), trained or served at `seq_len`."""
    optional = {_FIELD_OF_COLUMN.get(c, c): v.get(c, default)
                for c, default in {**MODEL_OPTIONAL_FLAGS, **MODEL_OPTIONAL_COUNTS}.items()}
    return Transformer(layers=v["layers"], hidden=v["hidden"], heads=v["heads"],
                       kv_heads=v["kv_heads"], ffn_hidden=v["ffn_hidden"], vocab=v["vocab"],
                       seq_len=seq_len, gated_mlp=v["gated_mlp"],
                       num_experts=v["num_experts"], experts_per_token=v["experts_per_token"],
                       **optional)


def row_system(v: dict) -> System:
    """The `System` of a row: its GPU preset's system with `gpus_per_node` GPUs per NVLink
    domain (raises ValueError naming the column)."""
    n = v["gpus_per_node"]
    if not (n >= 1 and n == round(n)):
        raise ValueError(f"gpus_per_node must be a whole number >= 1, got {n:g}")
    return system(v["gpu"], nvlink_domain=n)


def row_runtime(row: BenchmarkRow) -> Runtime:
    """The `Runtime` of a row: its `runtime` column's preset (empty: the default runtime)."""
    return runtime(row.values.get("runtime", DEFAULT_RUNTIME))


def train_specs(row: BenchmarkRow):
    """`(Transformer, System, TrainingPlan)` of a train row (raises ValueError if invalid)."""
    v = row.values
    if v["tp"] * v["pp"] * v["dp"] * v["cp"] != v["num_gpus"]:
        raise ValueError(f"tp*pp*dp*cp = {v['tp'] * v['pp'] * v['dp'] * v['cp']:g} does not "
                         f"equal num_gpus = {v['num_gpus']:g}")
    model = row_model(v, v["seq_len"])
    sys_ = row_system(v)
    plan = TrainingPlan(tp=v["tp"], pp=v["pp"], dp=v["dp"], cp=v["cp"], ep=v["ep"],
                        micro_batch=v["micro_batch"], global_batch=v["global_batch"], vp=v["vp"],
                        sequence_parallel=v["sequence_parallel"], recompute=v["recompute"],
                        zero=v["zero"], precision=v["precision"],
                        flash_attention=v["flash_attention"],
                        overlap_tp=v.get("overlap_tp", 1),
                        overlap_tp_backward=v.get("overlap_tp_backward", 1),
                        overlap_dp=v.get("overlap_dp", 1),
                        zero3_per_matrix=v.get("zero3_per_matrix", 0),
                        fp32_gradients=v.get("fp32_gradients", 1),
                        fp32_optimizer_moments=v.get("fp32_optimizer_moments", 1),
                        account_embedding_loss=v.get("account_embedding_loss", 0),
                        recompute_layers=v.get("recompute_layers", 0),
                        offload_layers=v.get("offload_layers", 0),
                        expert_tp=v.get("expert_tp", 0), overlap_ep=v.get("overlap_ep", 0),
                        fused_expert_gemm=v.get("fused_expert_gemm", 0),
                        recompute_norms=v.get("recompute_norms", 0),
                        recompute_moe_act=v.get("recompute_moe_act", 0),
                        recompute_mla_up=v.get("recompute_mla_up", 0),
                        recompute_mlp=v.get("recompute_mlp", 0))
    problem = layer_count_error(v["layers"], v["pp"], v["vp"], v["recompute"] == "full",
                                v.get("recompute_layers", 0), v.get("offload_layers", 0))
    if problem:
        raise ValueError(problem)
    return model, sys_, plan
