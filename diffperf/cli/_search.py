"""`diffperf search train|infer`: exhaustive plan search from the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import presets
from ..explore._search_inference import search_inference
from ..explore._search_training import default_training_grid, search_training
from ..explore._sweep import pareto_front
from ..explore._what_if import add_set_argument, parse_overrides, system_with_overrides, tag
from ..feasibility import explain
from ..plots._search_plot import front_plot
from ..specs._hardware import precision_code
from ..specs._inference_plan import InferencePlan
from ._all_plans import (
    add_all_plans_argument,
    check_all_plans,
    close_all_plans,
    open_all_plans,
    write_all_inference_plans,
)
from ._checks import CliError, check_writable
from ._common import (
    DEFAULT_INFER_GPU,
    DEFAULT_INFER_MODEL,
    DEFAULT_TRAIN_GPU,
    DEFAULT_TRAIN_MODEL,
    _load_efficiency,
    _load_model,
    _train_system,
    add_gpu_argument,
    add_model_argument,
    add_output_arguments,
    group,
    wrote,
)
from ._distributed import add_distributed_arguments, distributed
from ._infer import (
    add_per_head_decode,
    add_precision_arguments,
    add_prefill_tokens,
    precisions_of,
    precisions_text,
)
from ._runtime import add_runtime_argument, apply_plan_defaults, resolve_runtime

if TYPE_CHECKING:
    import pandas as pd

#: Exit status when the search found no plan (feasible, or meeting the target): like grep's 1
#: for "no match", distinct from 2 for invalid input.
NO_PLAN = 1


def add_search_parser(sub) -> None:
    p = sub.add_parser("search", help="exhaustive search for the best parallel plan",
                       description="Search every plan of a grid on the device and rank them. "
                                   "Exit status: 0 when a plan was found, 1 when no plan is "
                                   "feasible (or, for infer, none meets --latency / --tpot), "
                                   "2 on invalid input.")
    kinds = p.add_subparsers(dest="search_kind", required=True, metavar="{train,infer}")

    t = kinds.add_parser("train", help="fastest training plans for a model on N GPUs",
                         description="Search the training plans of a model on N GPUs. Without "
                                     f"--model / --gpu: {DEFAULT_TRAIN_MODEL} on "
                                     f"{DEFAULT_TRAIN_GPU}, as `train`.")
    add_model_argument(t, DEFAULT_TRAIN_MODEL)
    add_gpu_argument(t, None, what="GPU",
                     default_text=f"the --system's GPU, else {DEFAULT_TRAIN_GPU}")
    h, pl = group(t, "hardware"), group(t, "plan")
    h.add_argument("--system", default=None, help="system preset or system JSON file "
                                                  "(default: the GPU's)")
    pl.add_argument("--gpus", type=int, default=1024, help="GPUs in the job (default 1024)")
    pl.add_argument("--global-batch", type=int, default=1536,
                    help="sequences per optimizer step (default 1536)")
    pl.add_argument("--seq-len", type=int, default=None, help="default: the model's")
    pl.add_argument("--precision", action="append", default=None,
                    help="precision(s) to search (repeatable; default tf32 and bf16, plus fp8 / "
                         "fp4 where the GPU has them)")
    pl.add_argument("--fp32-gradients", action=argparse.BooleanOptionalAction, default=True,
                    help="fp32 gradient buffers (Megatron-LM's for bf16); --no-fp32-gradients "
                         "for 16-bit ones (NeMo / Megatron-Bridge recipes)")
    pl.add_argument("--offload-layers", type=int, action="append", default=None,
                    help="activation-offloading setting(s) to search: layers per pipeline chunk "
                         "kept in host memory (repeatable, e.g. --offload-layers 0 "
                         "--offload-layers 40; default 0)")
    pl.add_argument("--offload-optimizer", type=float, action="append", default=None,
                    help="optimizer-offload share(s) to search: the part of the optimizer states "
                         "kept in host memory and stepped by the CPU, 0 to 1 (ZeRO-Offload; "
                         "repeatable, e.g. --offload-optimizer 0 --offload-optimizer 1; "
                         "default 0)")
    pl.add_argument("--offload-weights", type=int, action="append", default=None,
                    choices=[0, 1],
                    help="weight offload setting(s) to search: 1 keeps the weights in host "
                         "memory (ZeRO-Infinity, with ZeRO-3; repeatable; default 0)")
    pl.add_argument("--uneven-layouts", action="store_true",
                    help="also rank plans whose pp * vp does not divide the layer count (they "
                         "need a custom pipeline layout; modelled as perfectly balanced)")
    h.add_argument("--efficiency", default=None, help="fitted efficiency JSON")
    add_set_argument(h)
    add_runtime_argument(t, what="Its plan defaults fix the plan axes they name (a runtime "
                                 "without TP overlap searches --overlap-tp off only) and the "
                                 "plan fields no axis varies; --precision, --fp32-gradients "
                                 "and --offload-layers given on the command line win.")
    _add_search_outputs(t, "memory / step-time")
    t.set_defaults(func=distributed(run_search_train))

    i = kinds.add_parser("infer", help="best TP / PP / EP / batch for a latency target; "
                                       "Pareto front",
                         description="Search the inference plans (tp, pp, ep, batch) of a model "
                                     "on one GPU type. Without --model / --gpu: "
                                     f"{DEFAULT_INFER_MODEL} on {DEFAULT_INFER_GPU}, as `infer`.")
    add_model_argument(i, DEFAULT_INFER_MODEL)
    add_gpu_argument(i, DEFAULT_INFER_GPU)
    h, pl = group(i, "hardware"), group(i, "plan")
    pl.add_argument("--input", type=int, default=2048, help="prompt tokens (default 2048)")
    pl.add_argument("--output", type=int, default=256, help="generated tokens (default 256)")
    pl.add_argument("--latency", type=float, default=None,
                    help="end-to-end latency target per request, s (default: none)")
    pl.add_argument("--tpot", type=float, default=None,
                    help="time-per-output-token target, s (default: none)")
    pl.add_argument("--max-gpus", type=int, default=8,
                    help="largest tp * pp (default 8; tp and pp are each at most 64)")
    add_precision_arguments(pl)
    add_prefill_tokens(pl)
    add_per_head_decode(pl)
    h.add_argument("--efficiency", default=None, help="fitted efficiency JSON")
    add_set_argument(h)
    add_runtime_argument(i, what="Its plan defaults fill the plan options not given.")
    _add_search_outputs(i, "latency / throughput")
    i.set_defaults(func=distributed(run_search_infer))


def _add_search_outputs(parser, front: str) -> None:
    """`--top`, `--plot`, `--out` and `--json`: the same for `search train` and `search infer`."""
    group(parser, "output").add_argument("--top", type=int, default=10,
                                         help="best plans to show and write (default 10)")
    add_output_arguments(
        parser, plot=f"also save the {front} Pareto front with the best plans to this image file",
        out="also write the best plans and the Pareto front to FILE.csv or FILE.parquet "
            "(parquet needs pyarrow); the front goes to FILE-pareto.csv/.parquet. Checked "
            "writable before the search; a search that finds no plan leaves existing files "
            "alone")
    add_all_plans_argument(group(parser, "output"))
    add_distributed_arguments(parser)


def _records(df: pd.DataFrame) -> list[dict]:
    return json.loads(df.to_json(orient="records")) if len(df) else []


def run_search_train(args) -> int:
    choice = resolve_runtime(args, "train")
    model = _load_model(args.model, args.seq_len, training=True)
    system = system_with_overrides(_train_system(args), args.set)
    acc = system.accelerator
    if args.precision:
        for name in args.precision:
            presets.check_precision_names(args.gpu, **{"--precision": name})
        codes = sorted({precision_code(p) for p in args.precision})
    else:
        codes = [c for c in (0, 1, 2, 3) if float(acc.peak_flops(c)) > 0]
    offload = sorted(set(args.offload_layers)) if args.offload_layers else [0]
    if offload[0] < 0:
        raise CliError(f"--offload-layers must be >= 0, got {offload[0]}")
    if offload[-1] >= float(model.layers):
        raise CliError(f"--offload-layers must be fewer than the model's {float(model.layers):g} "
                       f"layers (a pipeline chunk holds at most that many), got {offload[-1]}")
    shares = sorted(set(args.offload_optimizer)) if args.offload_optimizer else [0.0]
    if shares[0] < 0 or shares[-1] > 1:
        raise CliError(f"--offload-optimizer must lie in [0, 1], got "
                       f"{shares[0] if shares[0] < 0 else shares[-1]:g}")
    weights = sorted(set(args.offload_weights)) if args.offload_weights else [0]
    if args.out:  # the Pareto table's file too, before the search (--out itself: check_paths)
        check_writable("--out", _suffixed(args.out, "-pareto"))
    grid = default_training_grid(model, args.gpus, args.global_batch, precisions=codes,
                                 fp32_gradients=[int(args.fp32_gradients)],
                                 offload_layers=offload, plan_defaults=choice.applied,
                                 offload_optimizer=shares, offload_weights=weights)
    sink = open_all_plans(args, grid)  # --all-plans: every feasible plan, streamed
    result = search_training(model, system, args.gpus, args.global_batch, grid=grid,
                             efficiency=_load_efficiency(args.efficiency, args.gpu), top_k=args.top,
                             progress=not args.json, even_layouts=not args.uneven_layouts,
                             runtime=choice.runtime, plan_defaults=choice.applied,
                             plan_sink=sink)
    close_all_plans(sink)
    top, pareto = result["top"], result["pareto"]
    for df in (top, pareto, result["least_memory"]):
        if df is not None and len(df):
            df["precision"] = [presets.precision_label(args.gpu, p) for p in df["precision"]]
    _write_tables(args, top, pareto, "no feasible plan")
    if args.plot:
        _plot(args, pareto, top, "memory_gb", "step_time_s", _train_label,
              "memory per GPU (GB)", "step time (s)",
              f"{args.model} on {args.gpus} x {args.gpu}{tag(args.set)}, global batch "
              f"{args.global_batch}")
    if args.json:
        print(json.dumps({"evaluated": result["evaluated"], "feasible": result["feasible"],
                          "seconds": result["seconds"], "grid": repr(grid),
                          "infeasible_by_reason": result["reasons"], "top": _records(top),
                          "pareto_memory_vs_time": _records(pareto), "gpu": args.gpu,
                          "least_memory_plan": (None if result["least_memory"] is None else
                                                _records(result["least_memory"])[0]),
                          "system": args.system, "set": _set_texts(args),
                          "runtime": choice.to_json()}))
        return 0 if len(top) else NO_PLAN
    what_if = tag(args.set)
    where = f" in {args.system}" if args.system else ""
    print(f"search: {args.model} on {args.gpus} x {args.gpu}{where}{what_if}, global batch "
          f"{args.global_batch}, sequence length {float(model.seq_len):g}")
    print(f"  {choice.header()}")
    print(f"  {grid}")
    print(f"  evaluated {result['evaluated']:,} plans, {result['feasible']:,} feasible, in "
          f"{result['seconds']:.2f} s (compilation included)")
    for reason, count in sorted(result["reasons"].items(), key=lambda kv: -kv[1]):
        print(f"    infeasible: {count:>12,}  {reason}")
    if len(top) == 0:
        print("  no feasible plan")
        least = result.get("least_memory")
        if least is not None and len(least):
            r = least.iloc[0]
            shown = ", ".join(f"{c}={r[c]:g}" if isinstance(r[c], float) else f"{c}={r[c]}"
                              for c in ("tp", "pp", "dp", "cp", "vp", "micro_batch",
                                        "recompute", "zero", "precision"))
            print(f"  least memory of any plan: {r['memory_gb']:.1f} GB per GPU, the GPU has "
                  f"{float(system.accelerator.hbm_capacity) / 1e9:.1f} GB ({shown})")
        return NO_PLAN
    plan_cols = ["tp", "pp", "dp", "cp", "vp", "micro_batch", "recompute", "zero",
                 "sequence_parallel", "flash_attention", "ep", "overlap_tp", "overlap_dp",
                 "precision", "fp32_gradients", "offload_layers", "expert_tp", "overlap_ep",
                 "offload_optimizer", "offload_weights"]
    host = ["host_s"] if (top["host_s"] > 0).any() else []  # the host-bound time per step
    print("\nbest plans:")
    print(top[_shown(top, plan_cols, always=10) + ["step_time_s", *host, "mfu", "memory_gb",
                                                   "vs_best"]]
          .to_string(index=False, float_format="%.3f"))
    print(_common(top, plan_cols, always=10))
    if len(pareto):
        print("\nPareto front, memory per GPU vs step time:")
        print(pareto[_shown(pareto, plan_cols, always=8) + ["memory_gb", "step_time_s"]]
              .to_string(index=False, float_format="%.2f"))
        print(_common(pareto, plan_cols, always=8))
    return 0


def _shown(df: pd.DataFrame, cols: list[str], always: int) -> list[str]:
    """The first `always` plan columns, then those of the rest that differ between the rows
    shown (two rows must never look identical while their times differ)."""
    return cols[:always] + [c for c in cols[always:] if c in df and df[c].nunique() > 1]


def _common(df: pd.DataFrame, cols: list[str], always: int) -> str:
    """The plan columns `_shown` leaves out because every row shown has the same value, as one
    line, so that a plan can be rebuilt from the text."""
    same = [c for c in cols[always:] if c in df and df[c].nunique() == 1]
    value = lambda v: f"{v:g}" if isinstance(v, (int, float)) else str(v)  # noqa: E731
    return "in every plan above: " + (", ".join(f"{c}={value(df[c].iloc[0])}" for c in same)
                                      or "-")


def _set_texts(args) -> list[str]:
    """The `--set` items as parsed (for the JSON output of a what-if search)."""
    return [o.text for o in parse_overrides(args.set)]


def _train_label(r) -> str:
    """A training plan in a few words for the plot ("tp8 pp4 vp3 mb1 sel z1")."""
    words = [f"tp{r['tp']:g}", f"pp{r['pp']:g}"] + [
        f"{k}{r[k]:g}" for k in ("cp", "vp", "ep") if k in r and r[k] > 1] + [
        f"mb{r['micro_batch']:g}", str(r["recompute"])[:4], f"z{r['zero']:g}"]
    return " ".join(words)


def _plot(args, front, best, x, y, label, xlabel, ylabel, title) -> None:
    """Write `--plot` (nothing, with a note, when no plan is feasible)."""
    if front.empty:
        print("no plot: no feasible plan", file=sys.stderr)
        return
    front_plot(front, best, x, y, label, args.plot, xlabel, ylabel, title)
    wrote(args.plot)


def _write_tables(args, best: pd.DataFrame, front: pd.DataFrame, nothing: str) -> None:
    """Write `--out` (the best plans) and its `-pareto` twin (the front); a search that found no
    plan leaves existing files alone and says so (`nothing`: why there is no plan)."""
    if not args.out:
        return
    pareto = _suffixed(args.out, "-pareto")
    if len(best):
        write_table(best, args.out)
        write_table(front, pareto)
        wrote(f"{args.out} and {pareto}")
    else:
        print(f"note: {nothing}: {args.out} and {pareto} not written", file=sys.stderr)


def _suffixed(path: str, suffix: str) -> str:
    p = Path(path)
    return str(p.with_name(p.stem + suffix + p.suffix))


def write_table(df: pd.DataFrame, path: str) -> None:
    """Write a result table as CSV or Parquet (by extension), with a clear error otherwise."""
    if path.endswith(".parquet"):
        try:
            df.to_parquet(path, index=False)
        except ImportError:
            raise ValueError("writing parquet needs pyarrow: pip install pyarrow (or use .csv)"
                             ) from None
    elif path.endswith(".csv"):
        df.to_csv(path, index=False)
    else:
        raise ValueError(f"--out {path!r}: use a .csv or .parquet file name")


def run_search_infer(args) -> int:
    t0 = time.perf_counter()
    choice = resolve_runtime(args, "infer")
    unflagged = apply_plan_defaults(args, choice, "infer")
    model = _load_model(args.model)
    system = system_with_overrides(presets.system(args.gpu), args.set)
    if args.input + args.output > float(model.seq_len):
        print(f"warning: input + output = {args.input + args.output} tokens exceeds the model's "
              f"context of {float(model.seq_len):g} tokens (searched anyway)", file=sys.stderr)
    weights, act, kv = precisions_of(args)
    if args.out:  # the Pareto table's file too, before the search (--out itself: check_paths)
        check_writable("--out", _suffixed(args.out, "-pareto"))
    if args.all_plans:
        check_all_plans(args.all_plans, args.distributed)
    if args.max_gpus > 64 * 64:
        print(f"note: --max-gpus {args.max_gpus}: tp and pp are each searched up to 64, so at "
              f"most {64 * 64} GPUs", file=sys.stderr)
    df = search_inference(model, system, args.input, args.output, args.max_gpus,
                          weights, _load_efficiency(args.efficiency, args.gpu),
                          grouped_decode_attention=0 if args.per_head_decode else 1,
                          activation_precision=act, kv_precision=kv,
                          gemm_peak_fraction=args.gemm_peak_fraction,
                          prefill_tokens=args.prefill_tokens, runtime=choice.runtime,
                          plan_defaults=unflagged)
    finite = np.isfinite(df[["e2e_latency_s", "ttft_s", "tpot_s"]].to_numpy()).all(axis=1)
    ok = df[df["feasible"] & finite]
    gemm = float(InferencePlan(weight_precision=weights, activation_precision=act).math_precision)
    why = _infeasible_reasons(df[~(df["feasible"] & finite)], int(gemm))
    write_all_inference_plans(args, ok)
    target = ok
    if args.latency is not None:
        target = target[target["e2e_latency_s"] <= args.latency]
    if args.tpot is not None:
        target = target[target["tpot_s"] <= args.tpot]
    # one row per (tp, pp, batch): plans that differ only in ep would fill the list otherwise
    best = (target.sort_values("output_tok_s_per_gpu", ascending=False, kind="stable")
            .drop_duplicates(["tp", "pp", "batch"]).head(args.top))
    front_idx = _latency_throughput_front(ok)
    front = ok.iloc[front_idx]
    seconds = time.perf_counter() - t0
    _write_tables(args, best, front, "no feasible plan" if len(ok) == 0 else
                  "no feasible plan meets the target (--latency / --tpot)")
    if args.plot:
        _plot(args, front, best, "e2e_latency_s", "output_tok_s_per_gpu",
              lambda r: f"tp{r['tp']:g} pp{r['pp']:g}"
                        + (f" ep{r['ep']:g}" if r["ep"] > 1 else "") + f" b{r['batch']:g}",
              "end-to-end latency (s)", "output tokens/s per GPU",
              f"{args.model} on {args.gpu}{tag(args.set)}, {args.input} in / {args.output} out, "
              f"{precisions_text(args)}")
    if args.json:
        print(json.dumps({"evaluated": int(len(df)), "feasible": int(len(ok)),
                          "seconds": seconds, "grid": _grid_text(df),
                          "infeasible_by_reason": why, "top": _records(best),
                          "pareto_latency_vs_throughput": _records(front), "gpu": args.gpu,
                          "latency_target_s": args.latency, "tpot_target_s": args.tpot,
                          "set": _set_texts(args), "runtime": choice.to_json()}))
        return 0 if len(best) else NO_PLAN
    what_if = tag(args.set)
    print(f"search infer: {args.model} on {args.gpu}{what_if}, {args.input} in / {args.output} "
          f"out, {precisions_text(args)}; {len(df)} plans, {len(ok)} feasible, {seconds:.2f} s")
    print(f"  {choice.header()}")
    print(f"  {_grid_text(df)}")
    moe = df["ep"].nunique() > 1
    host = ["host_s"] if (ok["host_s"] > 0).any() else []  # the GPU waiting for the host
    cols = ["tp", "pp"] + (["ep"] if moe else []) + [
        "batch", "e2e_latency_s", "ttft_s", "tpot_s", *host, "output_tok_s_per_gpu",
        "memory_gb"]
    if len(ok) == 0:
        print("  no feasible plan; why the plans fail (count):")
        for text, n in why.items():
            print(f"    {n:6d}  {text}")
        return NO_PLAN
    if len(best) == 0:
        print("  no feasible plan meets the target (--latency / --tpot)")
    else:
        goal = []
        if args.latency is not None:
            goal.append(f"e2e <= {args.latency:g} s")
        if args.tpot is not None:
            goal.append(f"TPOT <= {args.tpot * 1e3:g} ms")
        goal_text = " with " + ", ".join(goal) if goal else ""
        per_ep = " (the best ep of each tp, pp and batch)" if moe else ""
        print(f"\nhighest throughput per GPU{goal_text}{per_ep}:")
        print(best[cols].to_string(index=False, float_format="%.4g"))
    print("\nPareto front, end-to-end latency vs output tokens/s per GPU:")
    print(front[cols].to_string(index=False, float_format="%.4g"))
    return 0 if len(best) else NO_PLAN


def _grid_text(df: pd.DataFrame) -> str:
    """The values searched per axis of an inference search, e.g. 'tp [1, 2, 4, 8] x ...'."""
    axes = [f"{c} {sorted(int(v) for v in df[c].unique())}" for c in ("tp", "pp", "ep", "batch")
            if c != "ep" or df[c].nunique() > 1]  # ep only for a MoE model
    rule = ", ep divides tp" if df["ep"].nunique() > 1 else ""
    return "grid: " + " x ".join(axes) + f" (tp * pp <= --max-gpus{rule})"


def _infeasible_reasons(bad: pd.DataFrame, code: int) -> dict:
    """{readable reason: number of plans}, most common first, for the plans that failed (a
    plan whose latency overflowed float32 counts as 'prediction not finite'); `code`: the
    GEMMs' precision code."""
    out: dict = {}
    for (feasible, reason), n in bad.groupby(["feasible", "reason"]).size().items():
        text = ("prediction not finite (lengths too large for float32)" if feasible
                else explain(int(reason), precision=code))
        out[text] = out.get(text, 0) + int(n)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _latency_throughput_front(df: pd.DataFrame) -> np.ndarray:
    """Positions of plans not dominated in (lower latency, higher throughput per GPU)."""
    if len(df) == 0:
        return np.zeros(0, dtype=np.int64)
    return pareto_front(-df["output_tok_s_per_gpu"].to_numpy(), df["e2e_latency_s"].to_numpy())
