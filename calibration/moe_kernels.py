"""The MoE layer model against published MoE kernel benchmarks
(`benchmarks_data/moe_kernels_published.csv`, sources in `benchmarks_data/SOURCES.md`).

For each row: the measured time of one MoE layer's expert module on one GPU and
`diffperf.inference.moe_module_time` for the same layer, plan and tokens (kernels at the
CUDA-graph replay cost; `diffperf/validation/_moe_kernels.py`). Prints, per source and kernel,
measured / model by row and the summary; nothing is fitted.

    python calibration/moe_kernels.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffperf.validation._moe_kernels import (  # noqa: E402
    predict_moe_kernel_row,
    read_moe_kernel_rows,
    tokens_per_expert,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write every row's numbers to this file")
    args = parser.parse_args()
    groups: dict = defaultdict(list)
    for row in read_moe_kernel_rows():
        model_us = predict_moe_kernel_row(row)
        key = (row.source.split(" ")[0], row.kernel, row.gpu, row.model,
               f"{float(row.plan.weight_precision):g}/{float(row.plan.activation_precision):g}",
               f"{float(row.plan.tp):g}/{float(row.plan.ep):g}")
        groups[key].append(
            {"tokens": row.tokens, "tokens_per_expert": tokens_per_expert(row),
             "measured_us": row.time_us, "model_us": model_us,
             "ratio": row.time_us / model_us, "source": row.source})
    print("| source | kernel | GPU | model | precision codes (weights / activations) | tp / ep "
          "| rows | measured / model: min, median, max | MAPE |")
    print("|---|---|---|---|---|---|---:|---|---:|")
    for (source, kernel, gpu, model, prec, par), rows in groups.items():
        r = np.array([x["ratio"] for x in rows])
        print(f"| {source} | {kernel} | {gpu} | {model} | {prec} | {par} | {len(r)} | "
              f"{r.min():.2f}, {np.median(r):.2f}, {r.max():.2f} | "
              f"{100 * np.mean(np.abs(1 / r - 1)):.1f} % |")
    print()
    for (source, kernel, gpu, model, prec, par), rows in groups.items():
        print(f"{source}: {kernel} on {gpu}, {model} (precision codes {prec}, tp / ep {par}): "
              "tokens (per expert): measured / model us = ratio")
        for x in rows:
            print(f"  {x['tokens']:g} ({x['tokens_per_expert']:.3g}): {x['measured_us']:.1f} / "
                  f"{x['model_us']:.1f} = {x['ratio']:.2f}")
    if args.json:
        out = [{"kernel": k[1], "gpu": k[2], "model": k[3], "precision": k[4], "tp_ep": k[5], **x}
               for k, rows in groups.items() for x in rows]
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
