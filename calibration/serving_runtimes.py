"""Serving runtimes side by side: where the host binds, and what CUDA graphs remove.

1. Llama-2 70B, batch-1 decode on 8 A100 (TP 8, 128 + 128 tokens), under every runtime preset:
   time per output token and the decode phase's launch and host-wait shares.
2. The published check of the PyTorch presets (values not fitted to it): gpt-fast's Llama-2 7B,
   batch 1 on one A100-80GB (pytorch.org/blog/accelerating-generative-ai-2, Nov 2023): eager
   25.5 tokens/s, torch.compile with CUDA graphs 107.0 tokens/s.

    python calibration/serving_runtimes.py          # tables
    python calibration/serving_runtimes.py --json   # the same, as JSON
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import diffperf as dp  # noqa: E402

#: gpt-fast's measured tokens/s (the blog's table), by the preset that describes its runtime.
GPT_FAST = {"pytorch-eager": 25.5, "pytorch-compile": 107.0}


def llama70_decode() -> list[dict]:
    model, system = dp.model("llama2-70b"), dp.system("dgx-a100")
    plan = dp.InferencePlan(tp=8, batch=1, input_len=128, output_len=128)
    eff = dp.default_efficiency("a100-sxm4-80gb")
    rows = []
    for name in dp.runtime_names():
        r = dp.infer(model, system, plan, eff, dp.runtime(name))
        d = r.decode
        rows.append({"runtime": name, "tpot_ms": 1e3 * float(r.tpot),
                     "launch_share": float(d.launch / d.total),
                     "host_share": float(d.host / d.total), "ttft_ms": 1e3 * float(r.ttft)})
    return rows


def gpt_fast() -> list[dict]:
    model, system = dp.model("llama2-7b"), dp.system("dgx-a100")
    plan = dp.InferencePlan(tp=1, batch=1, input_len=6, output_len=200)
    eff = dp.default_efficiency("a100-sxm4-80gb")
    rows = []
    for name, measured in GPT_FAST.items():
        r = dp.infer(model, system, plan, eff, dp.runtime(name))
        tok_s = float(r.output_tok_s_per_gpu)
        rows.append({"runtime": name, "predicted_tok_s": tok_s, "measured_tok_s": measured,
                     "ratio": tok_s / measured,
                     "host_share": float(r.decode.host / r.decode.total)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args()
    out = {"llama2_70b_batch1_decode_8xA100": llama70_decode(), "gpt_fast_llama2_7b": gpt_fast()}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print("Llama-2 70B, batch 1, 128 + 128 tokens, 8x A100 TP 8 (decode phase)")
    print(f"{'runtime':25s} {'TPOT ms':>8s} {'launch':>7s} {'host':>7s} {'TTFT ms':>8s}")
    for r in out["llama2_70b_batch1_decode_8xA100"]:
        print(f"{r['runtime']:25s} {r['tpot_ms']:8.2f} {r['launch_share']:7.1%} "
              f"{r['host_share']:7.1%} {r['ttft_ms']:8.2f}")
    print("\ngpt-fast, Llama-2 7B, batch 1, one A100-80GB (tokens/s)")
    for r in out["gpt_fast_llama2_7b"]:
        print(f"{r['runtime']:25s} predicted {r['predicted_tok_s']:6.1f}  measured "
              f"{r['measured_tok_s']:6.1f}  ratio {r['ratio']:.2f}  host share "
              f"{r['host_share']:.0%}")


if __name__ == "__main__":
    main()
