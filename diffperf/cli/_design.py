"""`diffperf sensitivity | attribution | technology | codesign`: the system architect's questions
(where does the speed-up come from, how does technology scaling move the bottleneck, where does
the next mm^2 / W / $ buy the most, what is the best design under budgets)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ..design import _attribution as A, _codesign as C, _sensitivity as S, _technology as T
from ..design._attribution import FACTORS
from ..design._node_study import node_study
from ..explore._what_if import add_set_argument, system_with_overrides, tag
from ..feasibility import VALID_OR_OUT_OF_HBM, describe_failure, explain
from ..inference._infer import infer
from ..plots._pyplot import pyplot
from ..presets import precision_label, system
from ..specs._inference_plan import InferencePlan
from ..specs._training_plan import RECOMPUTE, ZERO
from ._checks import CODESIGN_MAX_EVALUATIONS, WORK_CAPS
from ._common import (
    DEFAULT_INFER_MODEL,
    DEFAULT_TRAIN_GPU,
    DEFAULT_TRAIN_MODEL,
    _load_efficiency,
    _load_model,
    add_gpu_argument,
    add_model_argument,
    add_output_arguments,
    group,
    wrote,
)
from ._runtime import RuntimeChoice, add_runtime_argument, resolve_runtime

#: GPU presets that have a technology reference design.
_REFERENCE_OF = {"a100-sxm4-80gb": "a100", "a100-sxm4-40gb": "a100", "dgx-a100": "a100",
                 "a100": "a100", "h100-sxm5-80gb": "h100", "dgx-h100": "h100", "h100": "h100",
                 "b200": "b200", "dgx-b200": "b200"}


def _err(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def add_design_parsers(subparsers) -> None:
    """Register the `sensitivity`, `attribution`, `technology` and `codesign` sub-commands."""
    p = subparsers.add_parser(
        "sensitivity", help="elasticities d log(time) / d log(parameter), ranked",
        description="Elasticities of training step time or inference latency w.r.t. every "
                    "hardware (Accelerator + Network) parameter and, with --technology, every "
                    "technology / design / architecture parameter of the GPU's reference design, "
                    "by one jax.grad.")
    p.add_argument("--workload", choices=("train", "infer"), default="train")
    add_model_argument(p, None, default_text=f"{DEFAULT_TRAIN_MODEL}, or {DEFAULT_INFER_MODEL} "
                                             f"with --workload infer")
    add_gpu_argument(p, DEFAULT_TRAIN_GPU, default_text=f"{DEFAULT_TRAIN_GPU}, for both "
                                                        f"workloads")
    h, pl = group(p, "hardware"), group(p, "plan")
    pl.add_argument("--gpus", type=int, default=None, help="training GPUs (default 1024)")
    pl.add_argument("--global-batch", type=int, default=None,
                    help="training global batch (default 1536)")
    pl.add_argument("--tp", type=int, default=None, help="inference tensor parallel (default 8)")
    pl.add_argument("--batch", type=int, default=None, help="inference batch (default 1)")
    add_set_argument(h)
    h.add_argument("--technology", action="store_true",
                   help="also technology elasticities (a100 / h100 / b200 reference designs)")
    add_runtime_argument(p, what="Training picks its best plan under the runtime's plan "
                                 "defaults; the elasticities are those of the time with its "
                                 "host costs.")
    group(p, "output").add_argument("--top", type=int, default=0,
                                    help="show only the top N rows (default 0: all)")
    add_output_arguments(p)
    p.set_defaults(func=run_sensitivity)

    p = subparsers.add_parser(
        "attribution", help="Shapley attribution of the A100 -> H100 -> B200 -> GB200 speed-up",
        description="Decompose the training speed-up base -> target over precision, tensor "
                    "FLOP/s, HBM bandwidth and capacity, NVLink bandwidth and domain, scale-out "
                    "bandwidth and best plan (exact Shapley values over all 2^8 coalitions, "
                    "vmapped).")
    p.add_argument("--workload", choices=["train", "infer"], default="train",
                   help="train (default): one training step on its best plan per coalition; "
                        "infer: the end-to-end latency of a fixed inference plan (--tp, "
                        "--batch, --input, --output) over precision, tensor FLOP/s, HBM and "
                        "NVLink")
    add_model_argument(p, None, default_text=f"{DEFAULT_TRAIN_MODEL}, or {DEFAULT_INFER_MODEL} "
                                             f"with --workload infer")
    h, pl = group(p, "hardware"), group(p, "plan")
    h.add_argument("--base", default="dgx-a100", help="base system preset or system JSON file "
                                                     "(default dgx-a100)")
    h.add_argument("--targets", nargs="+", default=["dgx-h100", "dgx-b200", "gb200-nvl72"],
                   help="target system presets or system JSON files (default dgx-h100 "
                        "dgx-b200 gb200-nvl72)")
    pl.add_argument("--gpus", type=int, default=1024, help="GPUs in the job (default 1024)")
    pl.add_argument("--global-batch", type=int, default=1536,
                    help="sequences per optimizer step (default 1536)")
    pl.add_argument("--precision", default="fp8", choices=["bf16", "fp8", "fp4"],
                    help="target plan precision (default fp8; the base runs bf16)")
    pl.add_argument("--tp", type=int, default=8,
                    help="--workload infer: tensor-parallel GPUs (default 8)")
    pl.add_argument("--batch", type=int, default=1, help="--workload infer: batch (default 1)")
    pl.add_argument("--input", type=int, default=128,
                    help="--workload infer: prompt tokens (default 128)")
    pl.add_argument("--output", type=int, default=128,
                    help="--workload infer: generated tokens (default 128)")
    add_runtime_argument(p, what="One runtime on the base and every target, so the speed-up "
                                 "stays the hardware's; its plan defaults fix the candidate "
                                 "plans' options.")
    add_output_arguments(p, plot="save a bar chart of the Shapley shares (--workload train)")
    p.set_defaults(func=run_attribution)

    p = subparsers.add_parser(
        "technology", help="technology generator check and node exploration (12 nm -> 1 nm)",
        description="Print the generated A100 / H100 / B200 against their datasheets, then "
                    "training step time (GPT-3 175B) and inference latency (Llama-2 70B, TP 8, "
                    "batch 1, 128 / 128 tokens unless --model etc. say otherwise) across "
                    "logic nodes with logic-only, memory-only, network-only and full scaling, "
                    "with compute / memory / network / latency shares.")
    add_model_argument(p, None,
                       default_text=f"{DEFAULT_INFER_MODEL}; the inference workload, training is "
                                    f"GPT-3 175B")
    group(p, "model").add_argument("--infer-model", dest="infer_model", default=None,
                                   help=argparse.SUPPRESS)  # the old name of --model
    h, pl = group(p, "hardware"), group(p, "plan")
    h.add_argument("--nodes", type=float, nargs="+", default=None,
                   help="logic nodes, nm (default: every node of the technology table)")
    h.add_argument("--arch", default="hopper", type=str.lower,
                   help="architecture held fixed (default hopper)")
    h.add_argument("--references-only", action="store_true",
                   help="only the generated A100 / H100 / B200 against their datasheets")
    pl.add_argument("--tp", type=int, default=8, help="inference tensor parallelism (default 8)")
    pl.add_argument("--batch", type=int, default=1, help="inference batch (default 1)")
    pl.add_argument("--input", type=int, default=128, help="prompt tokens (default 128)")
    pl.add_argument("--output", type=int, default=128, help="generated tokens (default 128)")
    group(p, "output").add_argument("--csv", default=None,
                                    help="write the node table to this CSV")
    add_runtime_argument(p, what="It runs both workloads of the node study (its plan defaults "
                                 "fix the training candidates' options); the datasheet check "
                                 "does not depend on it.")
    add_output_arguments(p, plot="save the node exploration plot")
    p.set_defaults(func=run_technology)

    p = subparsers.add_parser(
        "codesign", help="optimise die area split, HBM stacks and NVLink lanes under budgets",
        description="Gradient-based (optax, projected Adam + penalties) co-design of a GPU at a "
                    "technology point under area / power / perimeter / cost budgets for a "
                    "training or inference workload (plan fixed). --compare-grid also runs a "
                    "dense grid search over the same space.")
    p.add_argument("--workload", choices=("train", "infer"), default="train")
    h, pl = group(p, "hardware"), group(p, "plan")
    h.add_argument("--node", type=float, default=3.0, help="logic node, nm (default 3)")
    h.add_argument("--memory-gen", type=float, default=3.0,
                   help="HBM generation index 0 HBM2 .. 5 HBM4e (default 3 = HBM3e)")
    h.add_argument("--network-gen", type=float, default=3.0,
                   help="network generation index 0 NVLink2 .. 5 NVLink7 (default 3 = NVLink5)")
    h.add_argument("--arch", default="blackwell", type=str.lower,
                   help="architecture (default blackwell)")
    h.add_argument("--area", type=float, default=814.0, help="die area budget, mm^2 (default 814)")
    h.add_argument("--power", type=float, default=700.0, help="power budget, W (default 700)")
    h.add_argument("--perimeter", type=float, default=114.0,
                   help="IO perimeter budget, mm (default 114)")
    h.add_argument("--cost", type=float, default=4000.0, help="cost budget, USD (default 4000)")
    pl.add_argument("--steps", type=int, default=100,
                    help=f"Adam steps per start (default 100, at most "
                         f"{WORK_CAPS[('codesign', 'steps')]:,})")
    pl.add_argument("--starts", type=int, default=4,
                    help=f"starts, vmapped: the box centre, random designs and the fastest of 256 "
                         f"random designs (default 4, at most "
                         f"{WORK_CAPS[('codesign', 'starts')]:,}; --steps x --starts at most "
                         f"{CODESIGN_MAX_EVALUATIONS:,}, about a minute and 1 GB)")
    pl.add_argument("--compare-grid", action="store_true",
                    help="also search a 119,232-point grid over the same space and compare")
    pl.add_argument("--margins", type=float, nargs="?", const=5.0, default=None,
                    metavar="PERCENT",
                    help="also what each budget is worth: the optimum re-run with one budget "
                         "PERCENT looser at a time (default 5), giving the time change per "
                         "mm^2, W, mm and $ (30-60 s). The time is lumpy in die area (whole "
                         "SMs, GEMM waves): try more than one PERCENT")
    add_runtime_argument(p, what="The workload's software (training: its plan defaults fix "
                                 "the plan's options).")
    add_output_arguments(p)
    p.set_defaults(func=run_codesign)


# ----------------------------------------------------------------------------- sensitivity


#: Workload sizes of `diffperf sensitivity` when not given (training / inference flags).
_SENSITIVITY_DEFAULTS = {"gpus": 1024, "global_batch": 1536, "tp": 8, "batch": 1}


def _plan_fields(plan) -> dict:
    """The plan a sensitivity study differentiates, as printable numbers and names."""
    if hasattr(plan, "global_batch"):  # training: the best plan for the GPUs and batch
        fields = ("num_gpus", "tp", "pp", "dp", "cp", "vp", "micro_batch", "global_batch")
        out = {k: int(float(getattr(plan, k))) for k in fields}
        out["recompute"] = RECOMPUTE[int(float(plan.recompute))]
        out["zero"] = ZERO[int(float(plan.zero))]
        return out
    return {k: int(float(getattr(plan, k))) for k in ("tp", "batch", "input_len", "output_len")}


def run_sensitivity(args) -> int:
    other = {"train": ("tp", "batch"), "infer": ("gpus", "global_batch")}[args.workload]
    ignored = [f"--{k.replace('_', '-')}" for k in other if getattr(args, k) is not None]
    if ignored:
        verb = "does" if len(ignored) == 1 else "do"
        return _err(f"{' and '.join(ignored)} {verb} not apply to --workload {args.workload} "
                    f"(training: --gpus, --global-batch and the best plan for them; "
                    f"inference: --tp, --batch)")
    if args.set and args.technology:
        return _err("--set does not apply with --technology (the technology elasticities are "
                    "those of the GPU's reference design)")
    for k, default in _SENSITIVITY_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, default)
    model_name = args.model or ("gpt3-175b" if args.workload == "train" else "llama2-70b")
    try:
        choice = resolve_runtime(args, args.workload)
        runtime = choice.runtime
        eff = _load_efficiency(None, args.gpu)  # the GPU's fitted factors, as train / infer use
        sys_ = system_with_overrides(system(args.gpu), args.set)
        if args.workload == "train":
            mdl = _load_model(model_name, training=True)
            plan = S.best_training_plan(mdl, sys_, args.gpus, args.global_batch, efficiency=eff,
                                        runtime=runtime, plan_defaults=choice.applied)
        else:
            mdl = _load_model(model_name)
            plan = InferencePlan(**{"tp": args.tp, "batch": args.batch, "input_len": 128,
                                    "output_len": 128} | choice.applied)
            rep = infer(mdl, sys_, plan, eff, runtime)
            reason = int(rep.reason)
            if reason not in VALID_OR_OUT_OF_HBM:
                return _err(f"infeasible plan: {describe_failure(reason, mdl, plan)}")
            if reason == 10:
                need, has = float(rep.memory.total), float(sys_.accelerator.hbm_capacity)
                print(f"warning: {explain(10, need, has)} (elasticities computed anyway)",
                      file=sys.stderr)
        fn = S.workload_time(args.workload, mdl, plan, eff, runtime)
        value, el = S.hardware_elasticities(fn, sys_)
        tech = None
        if args.technology:
            ref = _REFERENCE_OF.get(args.gpu.lower())
            if ref is None:
                return _err(f"--technology needs a GPU with a reference design: "
                            f"{', '.join(sorted(_REFERENCE_OF))}")
            tv, tech = S.technology_elasticities(fn, ref, float(sys_.network.nvlink_domain))
    except ValueError as e:
        return _err(str(e))
    out = {"workload": args.workload, "model": model_name, "plan": _plan_fields(plan),
           "set": args.set or [], "runtime": choice.to_json(), "time_s": value,
           "bottlenecks": S.bottlenecks(el),
           "hardware": dict(S.ranked(el, args.top or None))}
    if tech is not None:
        out["technology_reference"] = ref
        out["technology_time_s"] = tv
        out["technology"] = dict(S.ranked(tech, args.top or None))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    what = "step time" if args.workload == "train" else "e2e latency"
    what_if = tag(args.set)
    print(f"{args.workload}: {what} {value:.4g} s of {model_name} on {args.gpu}{what_if} ("
          + " ".join(f"{k}={v}" for k, v in out["plan"].items()) + ")")
    print(choice.header())
    print("elasticity = d log(time) / d log(parameter) (-0.5: +1 % parameter -> -0.5 % time)")
    print("bottleneck shares: " + ", ".join(f"{k} {v if abs(v) >= 5e-4 else 0.0:.1%}"
                                            for k, v in out["bottlenecks"].items()))
    print(f"whole-number / on-off parameters left out ({', '.join(S.DISCRETE_LEAVES)}): "
          f"compare them with --set what-ifs")
    for title, table in (("hardware", out["hardware"]), ("technology", out.get("technology"))):
        if table is None:
            continue
        if title == "technology":
            gap = out["technology_time_s"] / value - 1.0
            print(f"\ntechnology: the generated {ref.upper()} reference design, {what} "
                  f"{out['technology_time_s']:.4g} s" + (
                      f" ({gap:+.1%} against {args.gpu}{what_if}: not the same hardware, so its "
                      f"elasticities differ from the ones above)" if abs(gap) > 0.01 else ""))
        print(f"\n{title} parameter{'':<28} elasticity")
        for k, v in table.items():
            print(f"  {k:<40} {v:+.4f}")
    return 0


# ----------------------------------------------------------------------------- attribution


def _count(n: int, noun: str) -> str:
    """'1 evaluation', '400 evaluations'."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _attribution_rows(args, choice: RuntimeChoice):
    mdl = _load_model(args.model, training=True)
    base = system(args.base)
    results = {}
    if len(set(args.targets)) < len(args.targets):
        print("note: --targets names a system twice; each is shown once", file=sys.stderr)
    for tgt in dict.fromkeys(args.targets):
        try:
            results[tgt] = A.attribute(mdl, base, system(tgt), args.gpus, args.global_batch,
                                       target_precision=args.precision,
                                       runtime=choice.runtime, plan_defaults=choice.applied)
        except ValueError as e:
            raise ValueError(f"target {tgt}: {e}") from None
    return results


def _print_factor_table(out: dict, factors) -> None:
    """Shapley and alone speed-up of every factor per target, then the total speed-up."""
    print(f"{'factor':<20}" + "".join(f"{t:>22}" for t in out))
    print(f"{'':<20}" + "".join(f"{'shapley x (alone x)':>22}" for _ in out))
    for f in factors:
        print(f"{f:<20}" + "".join(
            f"{r['factors'][f]['speedup']:>12.2f}x ({r['factors'][f]['alone']:5.2f}x)"
            for r in out.values()))
    print(f"{'total speed-up':<20}" + "".join(f"{r['speedup']:>21.2f}x" for r in out.values()))


def _run_infer_attribution(args, choice: RuntimeChoice) -> int:
    """`attribution --workload infer`: the speed-up of one fixed inference plan."""
    if args.plot:
        return _err("--plot is for --workload train")
    try:
        mdl = _load_model(args.model)
        plan = InferencePlan(**{"tp": args.tp, "batch": args.batch, "input_len": args.input,
                                "output_len": args.output} | choice.applied)
        out = {t: A.attribute_inference(mdl, system(args.base), system(t), plan,
                                        target_precision=args.precision,
                                        runtime=choice.runtime)
               for t in dict.fromkeys(args.targets)}
    except ValueError as e:
        return _err(str(e))
    if args.json:
        print(json.dumps({"workload": "infer", "base": args.base, "model": args.model,
                          "tp": args.tp, "batch": args.batch, "input": args.input,
                          "output": args.output, "precision": args.precision,
                          "runtime": choice.to_json(), "targets": out}, indent=2))
        return 0
    print(f"{args.model} inference, tp {args.tp}, batch {args.batch}, {args.input} in / "
          f"{args.output} out: {args.base} ({precision_label(args.base, 'bf16')}) -> target "
          f"({args.precision}); end-to-end "
          f"latency of the same plan, {2 ** len(A.INFER_FACTORS)} coalitions")
    print(choice.header())
    print("efficiency: the shared fitted factors on every system, so that the speed-up is the "
          "hardware's; HBM capacity, NVLink domain and scale-out stay the base's (a fixed plan "
          "that fits does not depend on them)")
    _print_factor_table(out, A.INFER_FACTORS)
    print(f"{'TPOT base/tgt':<20}" + "".join(
        f"{r['base_tpot_s'] * 1e3:>10.2f}/{r['target_tpot_s'] * 1e3:.2f} ms".rjust(22)
        for r in out.values()))
    print("\nShapley factors multiply to the total (log-speed-ups add up).")
    return 0


def run_attribution(args) -> int:
    if args.model is None:
        args.model = "llama2-70b" if args.workload == "infer" else "gpt3-175b"
    try:
        choice = resolve_runtime(args, args.workload)
    except ValueError as e:
        return _err(str(e))
    if args.workload == "infer":
        return _run_infer_attribution(args, choice)
    try:
        results = _attribution_rows(args, choice)
    except ValueError as e:
        return _err(str(e))
    out = {t: {k: v for k, v in r.items() if k != "raw"} for t, r in results.items()}
    if args.plot:
        _plot_attribution(results, args)
        wrote(args.plot)
    if args.json:
        print(json.dumps({"base": args.base, "model": args.model, "gpus": args.gpus,
                          "global_batch": args.global_batch, "precision": args.precision,
                          "runtime": choice.to_json(), "targets": out,
                          "claims": [{"source": s, "what": w, "ratio": r}
                                     for s, w, r in A.CLAIMS]}, indent=2))
        return 0
    print(f"{args.model} training on {args.gpus} GPUs, global batch {args.global_batch}: "
          f"{args.base} ({precision_label(args.base, 'bf16')}) -> target ({args.precision}); "
          f"best of {next(iter(out.values()))['candidates_per_coalition']} candidate plans per "
          f"coalition, 256 coalitions")
    print(choice.header())
    print("efficiency: the shared fitted factors on every system (train uses each GPU's own), "
          "so that the speed-up is the hardware's")
    _print_factor_table(out, A.FACTORS)
    print(f"{'step time base/tgt':<20}" + "".join(
        f"{r['base_step_time']:>10.2f}s/{r['target_step_time']:.2f}s".rjust(22)
        for r in out.values()))
    print("\nShapley factors multiply to the total (log-speed-ups add up). Published claims:")
    for s, w, r in A.CLAIMS:
        print(f"  {r:>5.1f}x  {w}  [{s}]")
    return 0


def _plot_attribution(results, args) -> None:
    plt = pyplot("--plot")

    fig, ax = plt.subplots(figsize=(9, 4.8))
    targets = list(results)
    left = np.zeros(len(targets))
    cmap = plt.get_cmap("tab10")
    for i, f in enumerate(FACTORS):
        w = np.array([results[t]["factors"][f]["shapley_log"] for t in targets]) / np.log(10)
        ax.barh(targets, w, left=left, color=cmap(i), label=f)
        left += w
    for j, t in enumerate(targets):
        ax.text(left[j] + 0.01, j, f"{results[t]['speedup']:.1f}x", va="center")
    ax.set_xlabel("log10 speed-up over " + args.base + " (Shapley shares)")
    ax.set_title(f"{args.model} training, {args.gpus} GPUs: where the speed-up comes from "
                 f"({args.precision} on targets)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- technology


def run_technology(args) -> int:
    import pandas as pd
    if args.infer_model is not None:  # the old name of --model
        if args.model is not None and args.model != args.infer_model:
            return _err(f"--infer-model {args.infer_model} and --model {args.model} name two "
                        f"models; give --model only (--infer-model is its old name)")
        print("note: --infer-model is deprecated: it is --model now, as in the other commands",
              file=sys.stderr)
        args.model = args.infer_model
    if args.model is None:
        args.model = DEFAULT_INFER_MODEL
    if args.references_only and (args.csv or args.plot):
        return _err("--references-only prints the datasheet check only; --csv and --plot need "
                    "the node study (drop --references-only)")
    try:
        choice = resolve_runtime(args, "train")  # the header's: the training plan's defaults
        refs = T.reference_table()
        df = None
        if not args.references_only:
            T._arch_row(args.arch)
            iplan = InferencePlan(**{"tp": args.tp, "batch": args.batch, "input_len": args.input,
                                     "output_len": args.output}
                                  | resolve_runtime(args, "infer").applied)
            imodel = _load_model(args.model)
            reason = int(infer(imodel, system("h100-sxm5-80gb"), iplan).reason)
            if reason not in VALID_OR_OUT_OF_HBM:  # structural (memory depends on the node's HBM)
                raise ValueError(f"inference plan: {describe_failure(reason, imodel, iplan)}")
            df = node_study(nodes=args.nodes, arch=args.arch, infer_model=imodel,
                            infer_plan=iplan, runtime=choice.runtime,
                            plan_defaults=choice.applied)
    except ValueError as e:
        return _err(str(e))
    if args.csv and df is not None:
        df.to_csv(args.csv, index=False)
        wrote(args.csv)
    if args.plot and df is not None:
        _plot_nodes(df, args)
        wrote(args.plot)
    if args.json:
        print(json.dumps({"references": refs,
                          "inference": {"model": args.model, "tp": args.tp,
                                        "batch": args.batch, "input": args.input,
                                        "output": args.output},
                          "runtime": choice.to_json(),
                          "nodes": None if df is None else df.to_dict(orient="records")},
                         indent=2))
        return 0
    print("generated vs datasheet (ratios):")
    for r in refs:
        print(f"  {r['gpu']:<5} bf16 {r['flops_bf16'] / 1e12:7.1f} TFLOP/s "
              f"({r['flops_bf16_ratio']:.3f})"
              f"  HBM {r['hbm_bandwidth'] / 1e12:5.2f} TB/s ({r['hbm_bandwidth_ratio']:.3f})"
              f"  {r['hbm_capacity'] / 1e9:4.0f} GB ({r['hbm_capacity_ratio']:.3f})"
              f"  NVLink {r['nvlink_bandwidth'] / 1e9:4.0f} GB/s "
              f"({r['nvlink_bandwidth_ratio']:.3f})"
              f"  clock x{r['freq_scale']:.2f}, {r['power_w']:.0f} W, ${r['cost_usd']:,.0f}")
    if df is None:
        return 0
    cols = ["scaling", "node_nm", "flops_bf16_tflops", "hbm_tb_s", "nvlink_gb_s", "train_step_s",
            "train_compute", "train_memory", "train_network", "train_latency", "infer_tpot_ms",
            "infer_compute", "infer_memory", "infer_network", "infer_latency", "train_plan"]
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print(f"\nnode exploration (shares = minus elasticities w.r.t. each resource's rates); "
              f"inference: {args.model}, tp {args.tp}, batch {args.batch}, {args.input} in "
              f"/ {args.output} out; {choice.header()}:")
        print(df[cols].astype({c: float for c in cols[1:-1]}).to_string(
            index=False, float_format=lambda x: f"{x:.3f}"))
    return 0


def _plot_nodes(df, args) -> None:
    plt = pyplot("--plot")
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for mode, g in df.groupby("scaling", sort=False):
        axes[0, 0].plot(g["node_nm"], g["train_step_s"], "o-", label=mode)
        axes[0, 1].plot(g["node_nm"], g["infer_tpot_ms"], "o-", label=mode)
    for ax, title in ((axes[0, 0], "GPT-3 175B step time, 1,024 GPUs (s)"),
                      (axes[0, 1], f"{Path(args.model).name} decode TPOT, tp {args.tp}, batch "
                                   f"{args.batch} (ms)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.invert_xaxis()
        ax.set_xlabel("logic node (nm)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    full = df[df["scaling"] == "full"]
    x = np.arange(len(full))
    for ax, pre, title in ((axes[1, 0], "train", "training bottleneck shares (full scaling)"),
                           (axes[1, 1], "infer", "inference bottleneck shares (full scaling)")):
        bottom = np.zeros(len(full))
        for part in ("compute", "memory", "network", "latency"):
            v = np.clip(full[f"{pre}_{part}"].to_numpy(), 0, None)
            ax.bar(x, v, bottom=bottom, label=part)
            bottom += v
        ax.set_xticks(x, [f"{n:g}" for n in full["node_nm"]])
        ax.set_xlabel("logic node (nm), memory / network generation of its year")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- codesign


def run_codesign(args) -> int:
    if args.margins is not None and not 0 < args.margins <= 100:
        return _err(f"--margins must be a percentage in (0, 100], got {args.margins:g}")
    try:
        choice = resolve_runtime(args, args.workload)
        budgets = C.Budgets(area_mm2=args.area, power_w=args.power, perimeter_mm=args.perimeter,
                            cost_usd=args.cost)
        prob = C.default_problem(args.workload, args.node, args.memory_gen, args.network_gen,
                                 args.arch, budgets, runtime=choice.runtime,
                                 plan_defaults=choice.applied)
        grad = C.optimise(prob, steps=args.steps, starts=args.starts)
        grid = C.grid_search(prob) if args.compare_grid else None
        whole = C.whole_design(prob, grad["x"]) if grad["feasible"] else None
        # margins from the better of the relaxed and the buildable design
        start = (whole["x"] if whole is not None and whole["objective"] < grad["objective"]
                 else grad["x"])
        margins = C.budget_margins(prob, start, rel=args.margins / 100.0, steps=args.steps,
                                   starts=args.starts) \
            if args.margins is not None and grad["feasible"] else None
    except ValueError as e:
        return _err(str(e))
    if not grad["feasible"]:
        over = C.check_design(prob, grad["x"]).get("constraints", {})
        worst = ", ".join(f"{k} {v:+.0%}" for k, v in sorted(over.items(), key=lambda kv: -kv[1])
                          if v > 0)
        return _err(f"no feasible design found in {args.steps} steps from {args.starts} starts "
                    f"(budgets too tight, or too few --steps)"
                    + (f"; the closest design still exceeds: {worst} (relative to the budget or "
                       f"the workload's need)" if worst else ""))
    design = C.check_design(prob, grad["x"])
    out = {"workload": args.workload, "runtime": choice.to_json(),
           "gradient": {"evaluations": grad["evaluations"], "objective": grad["objective"],
                        "seconds": grad["seconds"], "design": design},
           "whole_units": {"evaluations": whole["evaluations"],
                           "objective": whole["objective"] if whole["feasible"] else None,
                           "seconds": whole["seconds"],
                           "design": C.check_design(prob, whole["x"]) if whole["feasible"]
                           else None}}
    if grid is not None:
        out["grid"] = {"evaluations": grid["evaluations"], "objective": grid["objective"],
                       "seconds": grid["seconds"],
                       "design": C.check_design(prob, grid["x"]) if grid["feasible"] else None}
        out["gap"] = grad["objective"] / grid["objective"] - 1.0
        out["evaluation_ratio"] = grid["evaluations"] / grad["evaluations"]
    if margins is not None:
        out["budget_margins"] = margins
    if args.area > C.RETICLE_MM2:
        out["note"] = (f"the {args.area:g} mm^2 area budget exceeds the {C.RETICLE_MM2:g} mm^2 "
                       f"reticle limit: no die can be larger than the limit, whatever the budget")
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    def describe(d, stacks, lanes):
        return (f"die {d['area_mm2']:.0f} mm^2 (compute {d['compute_mm2']:.0f}, SRAM "
                f"{d['sram_mm2']:.0f}), {stacks} HBM stacks, {lanes} NVLink lanes; "
                f"{d['flops_bf16'] / 1e12:.0f} TFLOP/s (clock x{d['freq_scale']:.2f}), "
                f"{d['hbm_bandwidth'] / 1e12:.2f} TB/s, {d['hbm_capacity'] / 1e9:.0f} GB; "
                f"{d['power_w']:.0f} W, {d['shoreline_mm']:.0f} mm shoreline, "
                f"${d['cost_usd']:,.0f}")
    d = design
    print(f"co-design ({args.workload}, node {args.node:g} nm, {args.arch}); budgets: "
          f"{args.area:g} mm^2, {args.power:g} W, {args.perimeter:g} mm, ${args.cost:,.0f}")
    print(f"  {choice.header()}")
    print(f"  gradient: time {grad['objective']:.4g} s after "
          f"{_count(grad['evaluations'], 'evaluation')} ({grad['seconds']:.1f} s), with stack "
          f"and lane counts relaxed to real numbers")
    relaxed = describe(d, f"{d['hbm_stacks']:.2f}", f"{d['nvlink_lanes']:.1f}")
    print(f"    relaxed optimum: {relaxed}")
    w = out["whole_units"]["design"]
    if w is None:
        print("  buildable: no design with whole HBM stacks and NVLink lanes (within one of the "
              "relaxed optimum's) meets every budget")
    else:
        print(f"  buildable (whole stacks and lanes within one of the relaxed optimum's, any die "
              f"area and SRAM share; best of {whole['evaluations']}): time "
              f"{whole['objective']:.4g} s ({whole['objective'] / grad['objective'] - 1:+.2%})")
        buildable = describe(w, f"{w['hbm_stacks']:.0f}", f"{w['nvlink_lanes']:.0f}")
        print(f"    design: {buildable}")
        if whole["objective"] < grad["objective"] * 0.99:
            print("  note: a buildable design beats the relaxed 'optimum' by more than 1 %: the "
                  "gradient search has not converged (raise --steps or --starts)")
    if "note" in out:
        print(f"  note: {out['note']}")
    if margins is not None:
        print(f"  what each budget is worth (re-optimised with that budget "
              f"{margins['rel'] * 100:g}% looser, against {margins['base']:.4g} s at the optimum):")
        if not margins["converged"]:
            print("    warning: the optimum still moved after three rounds of search, so these "
                  "margins include unfinished search (raise --steps or --starts)")
        for name, unit in C.BUDGET_UNITS.items():
            m = margins[name]
            if m["usable"] <= 0:
                print(f"    {name:13s} -> {m['budget']:>9,.1f} {unit:4s}  nothing usable: the "
                      f"die is at the {C.RETICLE_MM2:g} mm^2 reticle limit")
                continue
            print(f"    {name:13s} -> {m['budget']:>9,.1f} {unit:4s}  time {m['change']:+7.2%}  "
                  f"elasticity {m['elasticity']:+.3f}  {m['per_unit'] * 1e3:+.4f} ms per "
                  f"{unit}" + (f" (of which {m['usable']:.0f} usable below the reticle)"
                               if name == "area_mm2" and m["usable"] < m["budget"] / (
                                   1 + margins["rel"]) * margins["rel"] - 1e-9 else ""))
    if grid is not None:
        print(f"  grid:     time {grid['objective']:.4g} s after "
              f"{_count(grid['evaluations'], 'evaluation')} ({grid['seconds']:.1f} s); "
              f"gradient/grid - 1 = {out['gap']:+.2%}, {out['evaluation_ratio']:.0f}x fewer "
              f"evaluations")
        if out["gap"] > 0.01:
            g = out["grid"]["design"]
            print(f"  warning: the grid's design is {out['gap']:.1%} faster than the gradient's: "
                  f"the gradient search ended in a local optimum (raise --starts or --steps)")
            stacks, lanes = f"{g['hbm_stacks']:g}", f"{g['nvlink_lanes']:g}"
            print(f"    grid design: {describe(g, stacks, lanes)}")
    return 0
