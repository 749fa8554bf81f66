"""The collective model against published nccl-tests curves (benchmarks_data/nccl_tests_nvlink.csv):
mean absolute error of the time of one collective, by curve and by message-size range.

Each curve is an 8-GPU NVSwitch node's all-reduce or all-gather (A100 / H100) as printed by
nccl-tests; the model is `diffperf.costs` all_reduce / all_gather on the GPU's default system
with its shipped efficiency factors (which include a fitted per-call software overhead that
nccl-tests does not have: small messages are predicted slow). Where a row gives only the bus
bandwidth, its time is size x nccl-tests' factor (2 (n - 1)/n, (n - 1)/n) / bus bandwidth.

    python calibration/nccl_curves.py
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffperf import presets  # noqa: E402
from diffperf.costs import _collectives as coll  # noqa: E402

DATA = ROOT / "benchmarks_data" / "nccl_tests_nvlink.csv"
SYSTEMS = {"a100-sxm4-80gb": "dgx-a100", "h100-sxm5-80gb": "dgx-h100"}
RANGES = ((0, 1e4, "< 10 KB"), (1e4, 1e6, "10 KB - 1 MB"), (1e6, 1e8, "1 - 100 MB"),
          (1e8, 1e12, ">= 100 MB"))


def main() -> None:
    with DATA.open(newline="") as f:
        rows = list(csv.DictReader(f))
    curves: dict = {}
    for r in rows:
        key = (r["gpu"], r["system"], r["collective"], r["launch"].split(" ")[0])
        curves.setdefault(key, []).append(r)
    every = []
    for key, points in curves.items():
        gpu, _, collective, _ = key
        net = presets.system(SYSTEMS[gpu]).network
        eff = presets.default_efficiency(gpu)
        fn = coll.all_reduce if collective == "all_reduce" else coll.all_gather
        factor = 2 * 7 / 8 if collective == "all_reduce" else 7 / 8
        errors = []
        for r in points:
            size = float(r["size_bytes"])
            measured = (float(r["time_us"]) * 1e-6 if r["time_us"]
                        else size * factor / (float(r["busbw_gbs"]) * 1e9))
            errors.append((size, float(fn(net, eff, size, 8.0)) / measured - 1.0))
        e = np.array(errors)
        every.append(np.abs(e[:, 1]))
        mean = 100 * np.abs(e[:, 1]).mean()
        print(f"{' / '.join(key)}: {len(e)} sizes, mean |error| {mean:.1f} %")
        cells = []
        for lo, hi, label in RANGES:
            m = (e[:, 0] >= lo) & (e[:, 0] < hi)
            if m.any():
                cells.append(f"{label} {100 * np.abs(e[m, 1]).mean():.1f} % "
                             f"(mean {100 * e[m, 1].mean():+.1f} %, {int(m.sum())})")
        print("    " + "; ".join(cells))
    print(f"all: mean |error| {100 * np.concatenate(every).mean():.1f} % over "
          f"{sum(len(a) for a in every)} points")


if __name__ == "__main__":
    main()
