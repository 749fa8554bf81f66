"""The inference GEMM model against NVIDIA's measured linear layers
(`benchmarks_data/gemm_kernels_published.csv`: AIConfigurator's GEMM tables of TensorRT-LLM 1.3
on H100 / B200 and vLLM 0.14 on A100 / H100, bf16 / fp8 / nvfp4; sources in
`benchmarks_data/SOURCES.md`).

For each row: the measured time of one `Linear` forward (CUDA-graph replay) and
`diffperf.costs.split_k_gemm_cost` for the same (m, n, k) and precision (weights at the
precision's width, NVFP4 at 4.5 bits with its block scales; activations 16 bit in bf16 and
NVFP4 rows, 8 bit in fp8 rows), plus its kernels at the CUDA-graph replay cost
(`GRAPH_NODE_TIME` + the GPU's fitted `kernel_overhead`). The fp8 rows include the dynamic
quantisation of the activations (the collectors load no input scale: amax, scale and cast
kernels) and the NVFP4 rows the activations' FP4 quantisation; the model's GEMM has neither.
Prints measured / model by GPU, engine, precision and m; nothing is fitted.

    python calibration/gemm_kernels.py [--json]
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffperf import presets  # noqa: E402
from diffperf.costs._gemm import split_k_gemm_cost  # noqa: E402

DATA = ROOT / "benchmarks_data" / "gemm_kernels_published.csv"
#: Fixed cost of one kernel node in a CUDA-graph replay beyond its fitted overhead, s (the
#: `Runtime.graph_node_time` default).
GRAPH_NODE_TIME = 0.5e-6
#: (precision code, weight bytes, activation bytes) of each measured dtype.
DTYPES = {"bfloat16": (1.0, 2.0, 2.0), "fp8": (2.0, 1.0, 1.0), "nvfp4": (3.0, 0.5625, 2.0)}


def read_rows(path: Path = DATA) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for key in ("m", "n", "k"):
            r[key] = int(r[key])
        r["time_us"] = float(r["time_us"])
    return rows


def model_us(r: dict) -> float:
    """The model's time of a row's GEMM under a CUDA-graph replay, us."""
    acc = presets.gpu(r["gpu"])
    eff = presets.default_efficiency(r["gpu"])
    math, wb, ab = DTYPES[r["dtype"]]
    c = split_k_gemm_cost(acc, eff, float(r["m"]), float(r["n"]), float(r["k"]), math, wb, ab)
    return (float(c.roofline)
            + float(c.kernels) * (GRAPH_NODE_TIME + float(eff.kernel_overhead))) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = ap.parse_args(argv)
    rows = read_rows()
    cells: dict = defaultdict(list)
    for r in rows:
        cells[(r["gpu"], r["engine"], r["dtype"], r["m"])].append(
            (r["time_us"], model_us(r)))
    groups: dict = defaultdict(dict)
    for (gpu, engine, dtype, m), v in sorted(cells.items()):
        meas, mod = np.array(v).T
        groups[(gpu, engine, dtype)][m] = {
            "median_measured_over_model": float(np.median(meas / mod)),
            "median_excess_us": float(np.median(meas - mod)), "shapes": len(v)}
    summary = {f"{g} {e} {d}": {
        "mape": float(np.mean([abs(mod / meas - 1) for m in cells
                               if m[:3] == (g, e, d) for meas, mod in cells[m]])),
        "by_m": by_m} for (g, e, d), by_m in groups.items()}
    if a.json:
        print(json.dumps(summary, indent=1))
        return 0
    ms = sorted({m for (_, _, _, m) in cells})
    print(f"{len(rows)} measured linear layers; measured / model (median over "
          f"{len({(r['n'], r['k']) for r in rows})} shapes) by m, and the median excess "
          "(measured - model, us) at m = 1")
    print("| GPU | engine | dtype | MAPE | " + " | ".join(f"m {m}" for m in ms)
          + " | excess at m 1 |")
    print("|---|---|---|---:|" + "---:|" * (len(ms) + 1))
    for (g, e, d), by_m in groups.items():
        print(f"| {g} | {e} | {d} | {100 * summary[f'{g} {e} {d}']['mape']:.0f} % | "
              + " | ".join(f"{by_m[m]['median_measured_over_model']:.2f}" if m in by_m else ""
                           for m in ms)
              + f" | {by_m.get(1, {}).get('median_excess_us', float('nan')):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
