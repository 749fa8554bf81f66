"""`diffperf predict` at scale: wall time and peak memory on a large CSV of configurations.

Builds an N-row benchmark CSV (default 100,000) by sampling the shipped benchmark rows
(benchmarks_data/*.csv: training and inference, calibration and held-out tables) and varying
each sample within the schema's rules (scaling a training row's data parallelism with its GPU
count and global batch, or its sequence length; an inference row's batch and prompt / output
lengths), then runs `diffperf predict --data THAT.csv --out PRED.csv` in this process and prints
the wall time (s) and the peak resident memory (resource.getrusage, MiB).

    python benchmarks/predict_rows.py                 # 100,000 rows
    python benchmarks/predict_rows.py --rows 10000 --keep /tmp/rows10k.csv
    python benchmarks/predict_rows.py --csv-only --rows 10000 --keep /tmp/rows10k.csv

The CSV keeps each sampled row's measured columns (they belong to the unvaried row; `predict`
ignores them, `calibrate` / `validate` timing runs can use the file as is). Deterministic
(`--seed`).
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("train_calibration.csv", "infer_calibration.csv", "train_moe_holdout.csv",
           "infer_trtllm10_holdout.csv")


def _num(x: str) -> float:
    return float(x) if x not in ("", None) else float("nan")


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def varied_rows(n: int, seed: int = 0) -> pd.DataFrame:
    """`n` rows sampled from the shipped tables (all columns as strings), each varied:

    - train: data parallelism x 1, 2 or 4 (num_gpus and global_batch scaled with it, so the
      micro-batch count per replica is unchanged), and sequence length x 1/2, 1 or 2 (kept a
      multiple of what the row's tp * cp split needs by halving only even lengths);
    - infer: batch x 1/4 .. 4 (at least 1), prompt and output lengths x 1/2, 1 or 2 (at least 1);
      a chunked-prefill row keeps its `prefill_tokens`.
    Ids are `<base id>~<n>`, unique."""
    tables = [pd.read_csv(ROOT / "benchmarks_data" / f, dtype=str, keep_default_na=False,
                          comment=None) for f in SHIPPED]
    base = pd.concat(tables, ignore_index=True).fillna("")
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(base), n)
    out = base.iloc[pick].reset_index(drop=True).copy()
    train = (out["kind"].str.lower() == "train").to_numpy()
    dp_k = rng.choice([1, 2, 4], n)
    seq_k = rng.choice([0.5, 1.0, 2.0], n)
    batch_k = rng.choice([0.25, 0.5, 1.0, 2.0, 4.0], n)
    in_k, out_k = rng.choice([0.5, 1.0, 2.0], n), rng.choice([0.5, 1.0, 2.0], n)
    cols = {c: out[c].to_numpy().copy() for c in ("num_gpus", "dp", "global_batch", "seq_len",
                                                  "batch", "input_len", "output_len")}
    for i in range(n):
        if train[i]:
            k = dp_k[i]
            cols["num_gpus"][i] = _fmt(_num(cols["num_gpus"][i]) * k)
            cols["dp"][i] = _fmt(_num(cols["dp"][i]) * k)
            cols["global_batch"][i] = _fmt(_num(cols["global_batch"][i]) * k)
            s = _num(cols["seq_len"][i])
            s2 = s * seq_k[i]
            if s2 == round(s2) and s2 >= 128 and (s2 / 64).is_integer():
                cols["seq_len"][i] = _fmt(s2)
        else:
            cols["batch"][i] = _fmt(max(1.0, round(_num(cols["batch"][i]) * batch_k[i])))
            cols["input_len"][i] = _fmt(max(1.0, round(_num(cols["input_len"][i]) * in_k[i])))
            cols["output_len"][i] = _fmt(max(1.0, round(_num(cols["output_len"][i]) * out_k[i])))
    for c, v in cols.items():
        out[c] = v
    out["id"] = [f"{b}~{i}" for i, b in enumerate(out["id"])]
    return out.drop(columns=["notes"], errors="ignore")


def peak_rss_mib() -> float:
    """Peak resident set size of this process, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", default=None, help="write the generated CSV here (else a temp file)")
    ap.add_argument("--csv-only", action="store_true", help="only write the CSV (--keep)")
    ap.add_argument("--interval", action="store_true", help="predict with --interval")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    table = varied_rows(args.rows, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.keep) if args.keep else Path(tmp) / "rows.csv"
        table.to_csv(path, index=False)
        kinds = table["kind"].str.lower().value_counts().to_dict()
        print(f"wrote {len(table):,} rows ({kinds}) to {path} in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
        if args.csv_only:
            return 0
        del table
        from diffperf.cli import main as diffperf
        cmd = ["predict", "--data", str(path), "--out", str(Path(tmp) / "pred.csv")]
        cmd += ["--interval"] if args.interval else []
        rss0 = peak_rss_mib()
        t1 = time.perf_counter()
        rc = diffperf(cmd)
        wall = time.perf_counter() - t1
        pred = pd.read_csv(Path(tmp) / "pred.csv")
        ok = int((pred["status"].str.startswith("ok")).sum())
        invalid = int(pred["status"].str.startswith("invalid").sum())
    flags = " --interval" if args.interval else ""
    print(f"diffperf predict --data ROWS.csv --out PRED.csv{flags}: exit {rc}, "
          f"{args.rows:,} rows ({ok:,} ok, {invalid:,} invalid, "
          f"{args.rows - ok - invalid:,} other), wall {wall:.1f} s "
          f"({args.rows / wall:,.0f} rows/s), peak RSS {peak_rss_mib():.0f} MiB "
          f"(before predict: {rss0:.0f} MiB)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
