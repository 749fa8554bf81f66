"""The prefill (context) attention law against NVIDIA's measured attention kernels
(`benchmarks_data/attention_kernels_published.csv`: AIConfigurator's context-attention tables of
vLLM, SGLang and TensorRT-LLM on A100, H100 and B200; sources in `benchmarks_data/SOURCES.md`).

For each row: the measured kernel time and `diffperf.costs.prefill_attention_time` for the same
batch, prompt length and heads (causal, head width 128, bf16), plus the fixed cost of one call
(`CALL_TIME`: the rows are CUDA-graph replays of one attention call). Prints measured / model
by GPU, engine and prompt length, and with `--fit` the least-squares fit of the law's constants
(tile time, wave loss, one peak fraction per engine and GPU) that the module's constants come
from. Rows under `MIN_TIME_US` are left out of both (a call's fixed cost dominates them).

    python calibration/attention_kernels.py [--fit] [--json]
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
from diffperf.costs import prefill_attention_time  # noqa: E402
from diffperf.costs._attention import (  # noqa: E402
    ATTENTION_Q_TILE,
    PREFILL_TILE_TIME,
    PREFILL_WAVE_LOSS,
)

DATA = ROOT / "benchmarks_data" / "attention_kernels_published.csv"
#: Rows faster than this are left out (us): the call's fixed cost is most of them.
MIN_TIME_US = 50.0
#: Fixed cost of one attention call in a CUDA-graph replay (the kernel's launch and the
#: layer's small helpers), s: the value the constants were fitted with.
CALL_TIME = 5e-6


def read_rows(path: Path = DATA) -> list[dict]:
    """The CSV's rows with numbers parsed."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in ("batch", "isl", "num_heads", "num_kv_heads", "head_dim"):
            r[k] = int(r[k])
        r["time_us"] = float(r["time_us"])
    return rows


def shape(r: dict) -> tuple[float, float]:
    """(FLOPs, query tiles) of a row's causal attention: 2 b a s^2 d and b a ceil(s / 128)."""
    b, s, a, d = r["batch"], r["isl"], r["num_heads"], r["head_dim"]
    return 2.0 * b * a * s * s * d, b * a * np.ceil(s / ATTENTION_Q_TILE)


def model_us(r: dict, efficiency=None) -> float:
    """The law's time of a row plus `CALL_TIME`, us."""
    acc = presets.gpu(r["gpu"])
    eff = efficiency or presets.default_efficiency(r["gpu"])
    flops, tiles = shape(r)
    t = prefill_attention_time(acc, eff, 1.0, flops, tiles, float(r["isl"]), float(r["isl"]),
                               float(r["head_dim"]))
    return (float(t) + CALL_TIME) * 1e6


def fit(rows: list[dict]) -> dict:
    """Least squares of log(model / measured) over tau, w0 and e per (GPU, engine)."""
    from scipy.optimize import least_squares

    keys = sorted({(r["gpu"], r["engine"]) for r in rows})
    cols = {}
    for k in keys:
        sel = [r for r in rows if (r["gpu"], r["engine"]) == k]
        acc = presets.gpu(k[0])
        fl, ti = np.array([shape(r) for r in sel]).T
        cols[k] = (fl, ti, float(acc.num_sms), float(acc.flops_bf16),
                   np.array([r["time_us"] for r in sel]) * 1e-6)

    def residuals(p):
        out = []
        for i, k in enumerate(keys):
            fl, ti, sms, peak, meas = cols[k]
            w = ti / sms
            t = (fl / (peak * p[2 + i]) + p[0] * 1e-6 * w) * (w + p[1]) / w + CALL_TIME
            out.append(np.log(t / meas))
        return np.concatenate(out)

    res = least_squares(residuals, [8.0, 1.0] + [0.6] * len(keys),
                        bounds=([0, 0] + [0.05] * len(keys), [100, 10] + [1.0] * len(keys)))
    return {"tile_time_us": float(res.x[0]), "wave_loss": float(res.x[1]),
            "prefill_attention": {f"{g} {e}": float(v) for (g, e), v in zip(keys, res.x[2:])},
            "rms_log": float(np.sqrt(np.mean(res.fun ** 2)))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="also refit the law's constants")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = ap.parse_args(argv)
    rows = [r for r in read_rows() if r["time_us"] >= MIN_TIME_US]
    groups: dict = defaultdict(list)
    for r in rows:
        groups[(r["gpu"], r["engine"], r["isl"])].append(r["time_us"] / model_us(r))
    by_engine: dict = defaultdict(list)
    for (gpu, engine, _), v in groups.items():
        by_engine[(gpu, engine)] += v
    summary = {
        "rows": len(rows),
        "constants": {"tile_time_us": PREFILL_TILE_TIME * 1e6, "wave_loss": PREFILL_WAVE_LOSS},
        "mape_all": float(np.mean([abs(1 / x - 1) for v in by_engine.values() for x in v])),
        "by_engine": {f"{g} {e}": {"rows": len(v), "median_measured_over_model":
                                   float(np.median(v)),
                                   "mape": float(np.mean([abs(1 / x - 1) for x in v]))}
                      for (g, e), v in sorted(by_engine.items())},
        "by_length": {f"{g} {e} {s}": float(np.median(v))
                      for (g, e, s), v in sorted(groups.items())},
    }
    if a.fit:
        summary["fit"] = fit(rows)
    if a.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"{len(rows)} measured kernels >= {MIN_TIME_US:g} us; tile time "
          f"{PREFILL_TILE_TIME * 1e6:.1f} us, wave loss {PREFILL_WAVE_LOSS:.2f}; MAPE of the "
          f"model (default prefill_attention) {100 * summary['mape_all']:.1f} %")
    print("| GPU | engine | rows | measured / model, median | MAPE | by prompt length "
          "(median measured / model) |")
    print("|---|---|---:|---:|---:|---|")
    for (g, e), v in sorted(by_engine.items()):
        lengths = " ".join(f"{s}: {np.median(x):.2f}" for (g2, e2, s), x in sorted(groups.items())
                           if (g2, e2) == (g, e))
        print(f"| {g} | {e} | {len(v)} | {np.median(v):.2f} | "
              f"{100 * np.mean([abs(1 / x - 1) for x in v]):.1f} % | {lengths} |")
    if a.fit:
        f = summary["fit"]
        print(f"fit: tile time {f['tile_time_us']:.2f} us, wave loss {f['wave_loss']:.2f}, RMS "
              f"log error {f['rms_log']:.3f}; prefill_attention "
              + ", ".join(f"{k} {v:.2f}" for k, v in f["prefill_attention"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
