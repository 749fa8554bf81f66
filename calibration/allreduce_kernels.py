"""The inference engines' tensor-parallel all-reduce against NVIDIA's measured one
(`benchmarks_data/allreduce_kernels_published.csv`: AIConfigurator's `custom_allreduce_perf`
tables of TensorRT-LLM, vLLM and SGLang on A100, H100 and B200; sources in
`benchmarks_data/SOURCES.md`).

For each row: the measured time of one all-reduce (CUDA-graph replays) and
`diffperf.costs.engine_all_reduce` for the same bytes and GPUs, with NCCL's ring
(`diffperf.costs.all_reduce`, what the model charged before) beside it. Prints measured /
model by engine, GPU and group size, and with `--fit` the least-squares fit (in log) of the
law's four constants that `diffperf/costs/_engine_all_reduce.py` holds.

    python calibration/allreduce_kernels.py [--fit] [--json]
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
from diffperf.costs import (  # noqa: E402
    _engine_all_reduce as law,  # noqa: E402
    all_reduce,
    engine_all_reduce,
)

DATA = ROOT / "benchmarks_data" / "allreduce_kernels_published.csv"
#: Message sizes printed in the table, bytes.
SHOWN = (2 ** 11, 2 ** 14, 2 ** 17, 2 ** 20, 2 ** 23, 2 ** 26)


def read_rows(path: Path = DATA) -> list[dict]:
    """The CSV's rows with numbers parsed."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["num_gpus"] = int(r["num_gpus"])
        r["bytes"] = int(r["bytes"])
        r["time_us"] = float(r["time_us"])
    return rows


def _net_eff(gpu: str):
    return presets.system(gpu).network, presets.default_efficiency(gpu)


def model_us(r: dict, custom: float = 1.0) -> float:
    """`engine_all_reduce` of a row (`custom` 0: NCCL's ring), us."""
    net, eff = _net_eff(r["gpu"])
    return float(engine_all_reduce(net, eff, float(r["bytes"]), float(r["num_gpus"]),
                                   custom)) * 1e6


def fit(rows: list[dict]) -> dict:
    """Least squares of log(model / measured) over the law's four constants."""
    from scipy.optimize import least_squares

    n = np.array([r["num_gpus"] for r in rows], float)
    size = np.array([r["bytes"] for r in rows], float)
    meas = np.array([r["time_us"] for r in rows]) * 1e-6
    bw, nccl = [], []
    for r in rows:
        net, eff = _net_eff(r["gpu"])
        bw.append(float(net.nvlink_bandwidth * eff.nvlink))
        nccl.append(float(all_reduce(net, eff, float(r["bytes"]), float(r["num_gpus"]))))
    bw, nccl = np.array(bw), np.array(nccl)

    def residuals(p):
        a0, a1, f1, f2 = p
        barrier = (a0 + a1 * (n - 2.0)) * 1e-6
        one = barrier + (n - 1.0) * size / (f1 * bw)
        two = 2.0 * barrier + 2.0 * (n - 1.0) / n * size / (f2 * bw)
        t = (one ** -32 + two ** -32 + nccl ** -32) ** (-1 / 32)
        return np.log(t / meas)

    res = least_squares(residuals, [3.5, 0.25, 1.0, 0.7],
                        bounds=([0, 0, 0.1, 0.1], [20, 5, 2, 2]))
    a0, a1, f1, f2 = res.x
    return {"latency_us": float(a0), "latency_per_rank_us": float(a1),
            "one_shot_bandwidth": float(f1), "two_shot_bandwidth": float(f2),
            "rms_log": float(np.sqrt(np.mean(res.fun ** 2)))}


def _mape(pairs) -> float:
    return float(np.mean([abs(m / t - 1.0) for t, m in pairs]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="also refit the law's constants")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = ap.parse_args(argv)
    rows = read_rows()
    groups: dict = defaultdict(list)
    for r in rows:
        groups[(r["engine"], r["gpu"], r["num_gpus"])].append(
            (r["bytes"], r["time_us"], model_us(r), model_us(r, 0.0)))
    small = [(t, m) for v in groups.values() for b, t, m, _ in v if b <= 2 ** 21]
    small_nccl = [(t, m) for v in groups.values() for b, t, _, m in v if b <= 2 ** 21]
    summary = {
        "rows": len(rows),
        "constants": {"latency_us": law.ENGINE_ALL_REDUCE_LATENCY * 1e6,
                      "latency_per_rank_us": law.ENGINE_ALL_REDUCE_LATENCY_PER_RANK * 1e6,
                      "one_shot_bandwidth": law.ONE_SHOT_BANDWIDTH,
                      "two_shot_bandwidth": law.TWO_SHOT_BANDWIDTH},
        "mape_all": _mape([(t, m) for v in groups.values() for _, t, m, _ in v]),
        "mape_all_nccl_ring": _mape([(t, m) for v in groups.values() for _, t, _, m in v]),
        "mape_up_to_2MB": _mape(small), "mape_up_to_2MB_nccl_ring": _mape(small_nccl),
        "by_group": {f"{e} {g} {n}": {"mape": _mape([(t, m) for _, t, m, _ in v]),
                                      "mape_nccl_ring": _mape([(t, m) for _, t, _, m in v])}
                     for (e, g, n), v in sorted(groups.items())},
    }
    if a.fit:
        summary["fit"] = fit(rows)
    if a.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"{len(rows)} measured all-reduces; MAPE of engine_all_reduce "
          f"{100 * summary['mape_all']:.1f} % (NCCL's ring: "
          f"{100 * summary['mape_all_nccl_ring']:.1f} %), up to 2 MB "
          f"{100 * summary['mape_up_to_2MB']:.1f} % (NCCL's ring: "
          f"{100 * summary['mape_up_to_2MB_nccl_ring']:.1f} %)")
    print("| engine | GPU | GPUs | MAPE | NCCL ring's MAPE | measured / model / NCCL ring (us) by "
          "message |")
    print("|---|---|---:|---:|---:|---|")
    for (e, g, n), v in sorted(groups.items()):
        shown = " ".join(f"{b // 1024} KB: {t:.1f} / {m:.1f} / {c:.1f}"
                         for b, t, m, c in v if b in SHOWN)
        k = summary["by_group"][f"{e} {g} {n}"]
        print(f"| {e} | {g} | {n} | {100 * k['mape']:.0f} % | {100 * k['mape_nccl_ring']:.0f} % "
              f"| {shown} |")
    if a.fit:
        f = summary["fit"]
        print(f"fit: latency {f['latency_us']:.2f} us + {f['latency_per_rank_us']:.2f} us per "
              f"rank beyond 2, one-shot bandwidth {f['one_shot_bandwidth']:.2f}, two-shot "
              f"{f['two_shot_bandwidth']:.2f} (of the ring's NVLink bandwidth); RMS log error "
              f"{f['rms_log']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
