"""NVIDIA's measured TensorRT-LLM MoE modules -> the routed-expert GEMM time factors of the
TensorRT-LLM runtimes (`diffperf/presets/moe_gemm_factors.json`).

AIConfigurator (ai-dynamo/aiconfigurator, NVIDIA, Apache-2.0) commits the MoE module times it
measured with TensorRT-LLM 1.3.0rc20 on each GPU
(`aic-core/src/aiconfigurator_core/systems/data/<gpu>/moe/trtllm/1.3.0rc20/moe_perf.parquet`):
every backend and precision, 27 token counts, balanced and skewed routing. This script takes the
CUTLASS backend (`moe_torch_flow_cutlass`) in NVFP4 (4-bit weights and activations, the
block-scaled kernels) on the four Blackwell GPUs, balanced routing, no expert parallelism (each
GPU holds every expert, at 1 / moe_tp of its width), and for each expert shape and token count
solves

    measured = model_other + g * model_experts

for g: the factor on the routed experts' grouped GEMMs (compute and memory time) that makes
`diffperf.inference.moe_module_time` (the CUTLASS backend's permuted copy, CUDA-graph launches,
without the router GEMM, which the benchmark leaves out: `model_module_times` in
diffperf/validation/_moe_kernels.py) equal the measured module. Where the model's GEMMs are
less than half of its module (a few tokens: fixed costs dominate, and g would carry them), g is
held at its value at the smallest token count where they are half or more. The entry is the
median of the four GPUs' log g (the model has no GPU identity inside its traced programs; the
median keeps one GPU's outlying tactic out: B200's table runs 1.5-2x the others for four
shapes, among them Qwen3-235B-A22B's and Llama 4's; the spread is written beside each entry).
Also written: the model's module and GEMM times at 1,024 tokens on B200, which
`tests/test_moe_gemm_factors.py` recomputes to catch a table left behind by a change of the
model (rerun this script then).

    python calibration/moe_gemm_tables.py [--mirror PATH] [--check]

Needs a snapshot of ai-dynamo/aiconfigurator (`fetch` in the tool library; default path below).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

import diffperf as dp
from diffperf.inference._moe_gemm_factors import FACTORS_JSON, TOKEN_GRID
from diffperf.validation._moe_kernels import model_module_times

MIRROR = Path("/work/.mirror/ai-dynamo+aiconfigurator/repo")
COMMIT = "095f58a51c4ca8e61b66ec108d86f223f8d559ce"
DATA = "aic-core/src/aiconfigurator_core/systems/data/{}/moe/trtllm/1.3.0rc20/moe_perf.parquet"
#: AIConfigurator's system directory -> (diffperf system, GPU preset).
GPUS = {"b200_sxm": ("dgx-b200", "b200"), "gb200": ("gb200-nvl72", "gb200"),
        "b300_sxm": ("hgx-b300", "b300"), "gb300": ("gb300-nvl72", "gb300")}
#: Fewest share of the model's module that its GEMMs must be for g to be read off there.
MIN_GEMM_SHARE = 0.5
#: g is clipped to this range before the median (B300 / GB300 reach 10 for the 4,096 / 2,048 /
#: 256 / 8 shape split over 32 GPUs, where its GEMMs are smallest).
CLIP = (0.1, 10.0)


def measured(mirror: Path, gpu_dir: str) -> pd.DataFrame:
    blob = subprocess.run(["git", "-C", str(mirror), "show", f"{COMMIT}:{DATA.format(gpu_dir)}"],
                          check=True, capture_output=True).stdout
    d = pd.read_parquet(io.BytesIO(blob))
    d = d[(d.framework == "TRTLLM") & (d.version == "1.3.0rc20")
          & (d.kernel_source == "moe_torch_flow_cutlass") & (d.moe_dtype == "nvfp4")
          & (d.distribution == "balanced") & (d.moe_ep_size == 1)]
    return d.groupby(["hidden_size", "inter_size", "num_experts", "topk", "moe_tp_size",
                      "num_tokens"], as_index=False).latency.median()


def model_times(system_name: str, gpu: str, h, i, e, k, tp, tokens):
    """(module, experts) of the model, s, for `tokens` (array)."""
    return model_module_times(dp.system(system_name), dp.presets.resolve_efficiency(None, gpu),
                              h, i, e, k, tp, tokens)


def factors(mirror: Path) -> dict:
    per_gpu: dict = {}
    why: dict = {}  # shape -> reasons it lacks a GPU's factors
    for gpu_dir, (system_name, gpu) in GPUS.items():
        d = measured(mirror, gpu_dir)
        for key, g in d.groupby(["hidden_size", "inter_size", "num_experts", "topk",
                                 "moe_tp_size"]):
            g = g.set_index("num_tokens").reindex(TOKEN_GRID)
            if g.latency.isna().any():
                why.setdefault(key, set()).add("token counts missing")
                continue
            total, experts = model_times(system_name, gpu, *key, TOKEN_GRID)
            meas = g.latency.to_numpy() * 1e-3
            fac = (meas - (total - experts)) / experts
            ok = experts / total >= MIN_GEMM_SHARE
            if not ok.any():
                why.setdefault(key, set()).add("the model's GEMMs under half of its module at "
                                               "every token count")
                continue
            first = int(np.argmax(ok))
            fac[:first] = fac[first]
            per_gpu.setdefault(key, {})[gpu] = np.log(np.clip(fac, CLIP[0], CLIP[1]))
        print(f"  {gpu}: {len(d)} rows", file=sys.stderr)
    entries, dropped = [], []
    for key in sorted(set(per_gpu) | set(why)):
        logs = per_gpu.get(key, {})
        h, i, e, k, tp = key
        if len(logs) < len(GPUS):
            dropped.append(f"{h} / {i} / {e} / {k} at moe_tp {tp}: "
                           f"{'; '.join(sorted(why.get(key, {'not measured on every GPU'})))} "
                           f"({len(GPUS) - len(logs)} of {len(GPUS)} GPUs)")
            continue
        stack = np.stack([logs[g] for g in sorted(logs)])
        entries.append({"hidden": int(h), "expert_width": int(i) // int(tp),
                        "num_experts": int(e), "top_k": int(k), "moe_tp": int(tp),
                        "log_factor": [round(float(v), 4) for v in np.median(stack, axis=0)],
                        "gpu_spread": [round(float(v), 3) for v in
                                       stack.max(axis=0) - stack.min(axis=0)]})
    # the check values: the model's module and experts at 1,024 tokens on each GPU for the
    # first entry, and on B200 for the first entry split over 8 GPUs
    first_tp8 = next(j for j, e in enumerate(entries) if e["moe_tp"] == 8)
    checks = []
    for j, (system_name, gpu) in [(0, g) for g in GPUS.values()] + [(first_tp8, GPUS["b200_sxm"])]:
        ref = entries[j]
        total, experts = model_times(system_name, gpu, ref["hidden"],
                                     ref["expert_width"] * ref["moe_tp"], ref["num_experts"],
                                     ref["top_k"], ref["moe_tp"], [1024.0])
        checks.append({"entry": j, "system": system_name, "gpu": gpu, "tokens": 1024,
                       "module_s": float(total[0]), "experts_s": float(experts[0])})
    return {
        "source": f"ai-dynamo/aiconfigurator @{COMMIT[:8]}, {DATA.format('<gpu>')} "
                  f"({', '.join(GPUS)}): TensorRT-LLM 1.3.0rc20's CUTLASS MoE backend "
                  "(moe_torch_flow_cutlass), NVFP4, balanced routing, moe_ep_size 1",
        "generated_by": "python calibration/moe_gemm_tables.py",
        "kernel": "trtllm-cutlass-nvfp4",
        "token_grid": [int(t) for t in TOKEN_GRID],
        "min_gemm_share": MIN_GEMM_SHARE,
        "checks": checks,
        "dropped": dropped,
        "entries": entries,
    }


def _dumps(out: dict) -> str:
    """JSON with one line per entry (and per list), for a readable diff."""
    head = {k: v for k, v in out.items() if k != "entries"}
    lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    body = ",\n".join("  " + json.dumps(e) for e in out["entries"])
    return "{\n" + "\n".join(lines) + '\n "entries": [\n' + body + "\n ]\n}\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mirror", type=Path, default=MIRROR,
                    help="git directory of an ai-dynamo/aiconfigurator snapshot")
    ap.add_argument("--check", action="store_true",
                    help="print the spread between the GPUs, write nothing")
    a = ap.parse_args(argv)
    out = factors(a.mirror)
    spread = np.array([e["gpu_spread"] for e in out["entries"]])
    print(f"{len(out['entries'])} entries; spread of g between the four GPUs (max / min): "
          f"median {np.exp(np.median(spread)):.2f}, 90th percentile "
          f"{np.exp(np.percentile(spread, 90)):.2f}")
    if not a.check:
        FACTORS_JSON.write_text(_dumps(out))
        print(f"wrote {FACTORS_JSON}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
