"""The prefill (context) attention law against NVIDIA's measured attention kernels
(`benchmarks_data/attention_kernels_published.csv`: AIConfigurator's context-attention tables of
vLLM, SGLang and TensorRT-LLM on A100, H100 and B200; sources in `benchmarks_data/SOURCES.md`).

For each row: the measured kernel time and `diffperf.costs.prefill_attention_time` for the same
batch, prompt length, heads, head width (64, 128, 256) and sliding window (none or 128 tokens;
causal, bf16), plus the fixed cost of one call (`CALL_TIME`: the rows are CUDA-graph replays of
one attention call). Prints measured / model by GPU, engine, head width, window and prompt
length, and with `--fit` the least-squares fit of the law's constants (the tile time's fixed
and per-width parts, the wave loss, the exponentials' share, one peak fraction per engine and
GPU) that the module's constants come from. Rows under `MIN_TIME_US` are left out of both (a
call's fixed cost dominates them).

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
    EXP_PER_VECTOR_FLOP,
    PREFILL_SFU_SHARE,
    PREFILL_SFU_SHARPNESS,
    PREFILL_TILE_TIME_FIXED,
    PREFILL_TILE_TIME_PER_WIDTH,
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
        for k in ("batch", "isl", "num_heads", "num_kv_heads", "head_dim", "window"):
            r[k] = int(r[k])
        r["time_us"] = float(r["time_us"])
    return rows


def keys(r: dict) -> float:
    """Keys per query of a row in the full-square convention: s, or w (2 - w / s) with a window
    w < s (`Transformer.attended_keys`)."""
    s, w = float(r["isl"]), float(r["window"])
    if 0 < w < s:
        return w * (2.0 - w / s)
    return s


def shape(r: dict) -> tuple[float, float]:
    """(FLOPs, query tiles) of a row's causal attention: 2 b a s keys d and b a ceil(s / 128)."""
    b, s, a, d = r["batch"], r["isl"], r["num_heads"], r["head_dim"]
    return 2.0 * b * a * s * keys(r) * d, b * a * np.ceil(s / ATTENTION_Q_TILE)


def model_us(r: dict, efficiency=None) -> float:
    """The law's time of a row plus `CALL_TIME`, us."""
    acc = presets.gpu(r["gpu"])
    eff = efficiency or presets.default_efficiency(r["gpu"])
    flops, tiles = shape(r)
    t = prefill_attention_time(acc, eff, 1.0, flops, tiles, float(r["isl"]), keys(r),
                               float(r["head_dim"]))
    return (float(t) + CALL_TIME) * 1e6


def fit(rows: list[dict]) -> dict:
    """Least squares of log(model / measured) over the tile time's fixed and per-width parts,
    the wave loss, the exponentials' share and e per (GPU, engine)."""
    from scipy.optimize import least_squares

    pairs = sorted({(r["gpu"], r["engine"]) for r in rows})
    cols = {}
    for k in pairs:
        sel = [r for r in rows if (r["gpu"], r["engine"]) == k]
        acc = presets.gpu(k[0])
        fl, ti = np.array([shape(r) for r in sel]).T
        d = np.array([r["head_dim"] for r in sel], float)
        exp_rate = (4.0 * d * float(acc.vector_flops) * EXP_PER_VECTOR_FLOP
                    * float(acc.sfu_ratio) if float(acc.flops_fp8) > 0 else np.full_like(d, np.inf))
        cols[k] = (fl, ti, d, exp_rate, float(acc.num_sms), float(acc.flops_bf16),
                   np.array([r["time_us"] for r in sel]) * 1e-6)
    p = PREFILL_SFU_SHARPNESS

    def residuals(x):
        out = []
        for i, k in enumerate(pairs):
            fl, ti, d, exp_rate, sms, peak, meas = cols[k]
            tensor = peak * x[4 + i]
            rate = tensor * (1.0 + (tensor / (exp_rate * x[3])) ** p) ** (-1.0 / p)
            w = ti / sms
            tau = (x[0] + x[1] * d / 128.0) * 1e-6
            t = (fl / rate + tau * w) * (w + x[2]) / w + CALL_TIME
            out.append(np.log(t / meas))
        return np.concatenate(out)

    res = least_squares(residuals, [8.0, 2.0, 1.0, 0.8] + [0.6] * len(pairs),
                        bounds=([0, 0, 0, 0.05] + [0.05] * len(pairs),
                                [100, 100, 10, 2.0] + [1.0] * len(pairs)))
    return {"tile_time_fixed_us": float(res.x[0]), "tile_time_per_width_us": float(res.x[1]),
            "wave_loss": float(res.x[2]), "sfu_share": float(res.x[3]),
            "prefill_attention": {f"{g} {e}": float(v) for (g, e), v in zip(pairs, res.x[4:])},
            "rms_log": float(np.sqrt(np.mean(res.fun ** 2)))}


def _mape(ratios) -> float:
    return float(np.mean([abs(1 / x - 1) for x in ratios]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="also refit the law's constants")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = ap.parse_args(argv)
    rows = [r for r in read_rows() if r["time_us"] >= MIN_TIME_US]
    groups: dict = defaultdict(list)  # (gpu, engine, head width, window, prompt) -> ratios
    for r in rows:
        groups[(r["gpu"], r["engine"], r["head_dim"], r["window"], r["isl"])].append(
            r["time_us"] / model_us(r))
    kinds: dict = defaultdict(list)
    for (gpu, engine, d, w, _), v in groups.items():
        kinds[(gpu, engine, d, w)] += v
    summary = {
        "rows": len(rows),
        "constants": {"tile_time_fixed_us": PREFILL_TILE_TIME_FIXED * 1e6,
                      "tile_time_per_width_us": PREFILL_TILE_TIME_PER_WIDTH * 1e6,
                      "wave_loss": PREFILL_WAVE_LOSS, "sfu_share": PREFILL_SFU_SHARE},
        "mape_all": _mape([x for v in kinds.values() for x in v]),
        "mape_head_128": _mape([x for (_, _, d, w), v in kinds.items() if d == 128 and w == 0
                                for x in v]),
        "by_kind": {f"{g} {e} d{d} w{w}": {"rows": len(v), "median_measured_over_model":
                                           float(np.median(v)), "mape": _mape(v)}
                    for (g, e, d, w), v in sorted(kinds.items())},
        "by_length": {f"{g} {e} d{d} w{w} {s}": float(np.median(v))
                      for (g, e, d, w, s), v in sorted(groups.items())},
    }
    if a.fit:
        summary["fit"] = fit(rows)
    if a.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"{len(rows)} measured kernels >= {MIN_TIME_US:g} us; tile time "
          f"{PREFILL_TILE_TIME_FIXED * 1e6:.2f} + {PREFILL_TILE_TIME_PER_WIDTH * 1e6:.2f} x "
          f"head width / 128 us, wave loss {PREFILL_WAVE_LOSS:.2f}, exponentials' share "
          f"{PREFILL_SFU_SHARE:.3f}; MAPE of the model (default prefill_attention) "
          f"{100 * summary['mape_all']:.1f} % (head width 128, no window: "
          f"{100 * summary['mape_head_128']:.1f} %)")
    print("| GPU | engine | head width | window | rows | measured / model, median | MAPE | "
          "by prompt length (median measured / model) |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for (g, e, d, w), v in sorted(kinds.items()):
        lengths = " ".join(f"{s}: {np.median(x):.2f}" for (g2, e2, d2, w2, s), x
                           in sorted(groups.items()) if (g2, e2, d2, w2) == (g, e, d, w))
        print(f"| {g} | {e} | {d} | {w or '-'} | {len(v)} | {np.median(v):.2f} | "
              f"{100 * _mape(v):.1f} % | {lengths} |")
    if a.fit:
        f = summary["fit"]
        print(f"fit: tile time {f['tile_time_fixed_us']:.2f} + {f['tile_time_per_width_us']:.2f} "
              f"x head width / 128 us, wave loss {f['wave_loss']:.3f}, exponentials' share "
              f"{f['sfu_share']:.3f}, RMS log error {f['rms_log']:.3f}; prefill_attention "
              + ", ".join(f"{k} {v:.2f}" for k, v in f["prefill_attention"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
