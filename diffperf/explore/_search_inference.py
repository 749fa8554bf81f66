"""Inference plan search: every (tp, pp, ep, batch) of a small grid evaluated in one vmapped
call (`diffperf search infer`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .. import presets
from ..inference._infer import infer
from ..specs._hardware import precision_code
from ..specs._inference_plan import InferencePlan
from ._grid import Grid
from ._sweep import evaluate_all

if TYPE_CHECKING:
    import pandas as pd


def inference_candidates(max_gpus: int, num_experts: int = 1) -> dict[str, list]:
    """The inference search grid: tp, pp (powers of two, tp * pp <= max_gpus), ep (powers of
    two dividing a MoE model's expert count; [1] for a dense model) x batch."""
    pow2 = [1, 2, 4, 8, 16, 32, 64]
    batches = sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512,
                      768, 1024, 1536, 2048})
    return {"tp": [t for t in pow2 if t <= max_gpus], "pp": [p for p in pow2 if p <= max_gpus],
            "ep": [e for e in pow2 if e <= max_gpus and num_experts % e == 0],
            "batch": batches}


def search_inference(model, system, input_len: int, output_len: int, max_gpus: int = 8,
                     precision: str = "bf16", efficiency=None,
                     grouped_decode_attention: int = 1, activation_precision: str | None = None,
                     kv_precision: str | None = None,
                     gemm_peak_fraction: float = 1.0, prefill_tokens: int = 0,
                     runtime=None, plan_defaults: dict | None = None) -> pd.DataFrame:
    """Every (tp, pp, ep, batch) of `inference_candidates` evaluated with vmap: a DataFrame
    with latency, TPOT, throughput per GPU, the time the GPU waits for the host per request
    (`host_s`), memory and feasibility (only tp * pp <= max_gpus
    and ep dividing tp). `precision` is that of the weights, `activation_precision` (default:
    `precision`) that of the GEMM inputs, `kv_precision` (default: the GEMM inputs') that of
    the KV cache; `grouped_decode_attention`, `gemm_peak_fraction` and `prefill_tokens` are
    as in `InferencePlan`. `runtime`: the serving engine's `Runtime` (default None: `infer`'s
    default, the calibration set's); `plan_defaults`: values of the `InferencePlan` fields
    neither searched nor set by the other arguments (a runtime's plan defaults)."""
    import pandas as pd
    eff = presets.resolve_efficiency(efficiency)
    grid = Grid(inference_candidates(max_gpus, int(float(model.num_experts))))
    code = float(precision_code(precision))
    act = code if activation_precision is None else float(precision_code(activation_precision))
    kv = act if kv_precision is None else float(precision_code(kv_precision))
    set_here = {"tp", "pp", "ep", "batch", "input_len", "output_len", "weight_precision",
                "activation_precision", "kv_precision", "grouped_decode_attention",
                "gemm_peak_fraction", "prefill_tokens"}
    extra = {k: v for k, v in (plan_defaults or {}).items() if k not in set_here}

    def evaluate(v):
        plan = InferencePlan(tp=v["tp"], pp=v["pp"], ep=v["ep"], batch=v["batch"],
                             input_len=input_len, output_len=output_len, weight_precision=code,
                             activation_precision=act, kv_precision=kv,
                             grouped_decode_attention=grouped_decode_attention,
                             gemm_peak_fraction=gemm_peak_fraction,
                             prefill_tokens=prefill_tokens, **extra)
        r = infer(model, system, plan, eff, runtime)
        return {"e2e_latency_s": r.e2e_latency, "ttft_s": r.ttft, "tpot_s": r.tpot,
                "output_tok_s_per_gpu": r.output_tok_s_per_gpu,
                "host_s": r.prefill.host + r.decode.host,
                "memory_gb": r.memory.total / 1e9, "feasible": r.feasible,
                "reason": r.reason}

    out = evaluate_all(grid, evaluate, progress=False)
    df = pd.DataFrame(grid.decode_host(np.arange(grid.size))).astype(int)
    for k, v in out.items():
        df[k] = v
    keep = (df["tp"] * df["pp"] <= max_gpus) & (df["tp"] % df["ep"] == 0)
    return df[keep].reset_index(drop=True)
