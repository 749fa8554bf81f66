"""`diffperf` command line: train, validate, bench, presets (and infer when available).

Run `diffperf` with no arguments for the quick start: GPT-3 175B on 1,024 A100s, then the
validation summary on the shipped benchmark data.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from pathlib import Path

import jax
import numpy as np

from .. import presets
from ..calibrate._batch_predict import predict_csv
from ..calibrate._error_model import spec_descriptor
from ..calibrate._uncertainty import interval_summary, issues_from_host
from ..explore._what_if import (
    add_set_argument,
    change,
    comparison,
    parse_overrides,
    system_with_overrides,
    tag,
)
from ..feasibility import explain
from ..plots._validation_plot import validation_plot
from ..specs._training_plan import RECOMPUTE_MODULES, TrainingPlan, layer_count_error
from ..training._layer import layer_costs
from ..training._notes import training_notes, utilisation_notes
from ..training._offload import offload_traffic
from ..training._step import predict_training, train_step
from ..validation._data import BenchmarkError, _leading_comments
from ..validation._stack import capacity_warning
from ..validation._validate import imec_summaries, validate
from . import _bench as bench
from ._calibrate import add_calibrate_parser
from ._checks import (
    _INPUTS,
    _OUTPUTS,
    CliError,
    _opt,
    check_paths,
    check_values,
    resolve_hardware_names,
)
from ._common import (
    BENCHMARKS,
    DEFAULT_TRAIN_GPU,
    DEFAULT_TRAIN_MODEL,
    _load_efficiency,
    _load_model,
    _train_system,
    add_gpu_argument,
    add_model_argument,
    add_output_arguments,
    group,
)
from ._compile_cache import disable_compilation_cache, enable_compilation_cache
from ._daemon import add_daemon_parser
from ._design import add_design_parsers
from ._detail import detail_summary, print_detail
from ._infer import add_infer_parser
from ._runtime import (
    add_runtime_argument,
    apply_plan_defaults,
    given_options,
    resolve_runtime,
    runtime_summary,
    runtime_summary_text,
    with_plan_fields,
)
from ._search import add_search_parser
from ._serve import add_serve_parser


#: `train` / `search train` GPU when neither --gpu nor --system is given.
# ----------------------------------------------------------------------------------- train
def _add_train(sub):
    p = sub.add_parser("train", help="predict one training step (time, memory, MFU)",
                       description="Predict one optimizer step of a training job.")
    add_model_argument(p, DEFAULT_TRAIN_MODEL)
    add_gpu_argument(p, None, what="GPU",
                     default_text=f"the --system's GPU, else {DEFAULT_TRAIN_GPU}")
    h, pl = group(p, "hardware"), group(p, "plan")
    h.add_argument("--system", default=None, help="system preset id or system JSON file "
                                                  "(default: the GPU's system)")
    pl.add_argument("--gpus", type=int, default=1024, help="GPUs in the job (default 1024)")
    h.add_argument("--nvlink-domain", type=int, default=None, help="GPUs per NVLink domain")
    pl.add_argument("--tp", type=int, default=8, help="tensor-parallel degree (default 8)")
    pl.add_argument("--pp", type=int, default=8, help="pipeline stages (default 8)")
    pl.add_argument("--dp", type=int, default=None, help="default: gpus / (tp * pp * cp)")
    pl.add_argument("--cp", type=int, default=1, help="context-parallel degree (default 1)")
    pl.add_argument("--ep", type=int, default=1, help="expert-parallel degree (default 1)")
    pl.add_argument("--expert-tp", type=int, default=0,
                    help="tensor-parallel degree of the expert MLPs (Megatron-core "
                         "--expert-tensor-parallel-size; NVIDIA's MoE recipes use 1, which lets "
                         "--ep span the TP ranks); default 0 = --tp")
    pl.add_argument("--overlap-ep", action="store_true",
                    help="hide the expert-parallel all-to-alls behind another micro-batch's "
                         "compute (Megatron-core --overlap-moe-expert-parallel-comm)")
    pl.add_argument("--fused-expert-gemm", action="store_true",
                    help="each grouped expert GEMM is one kernel (CUTLASS / cuBLASLt grouped GEMM, "
                         "DeepGEMM); default: one GEMM launch per local expert, as Transformer "
                         "Engine's GroupedLinear in Megatron-core runs them")
    pl.add_argument("--vp", type=int, default=None,
                    help="interleaved chunks per stage (default 3 with --pp > 1, else 1)")
    pl.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch "
                                                                "(default 1)")
    pl.add_argument("--global-batch", type=int, default=1536,
                    help="sequences per optimizer step (default 1536)")
    pl.add_argument("--seq-len", type=int, default=None, help="default: the model's")
    pl.add_argument("--recompute", default="selective", choices=["none", "selective", "full"])
    pl.add_argument("--recompute-modules", default="", metavar="LIST",
                    help="modules whose outputs are recomputed instead of stored, comma-separated: "
                         "layernorm, moe_act, mla_up_proj, mlp (Megatron-core's selective "
                         "--recompute-modules beside core_attn, which is --recompute selective)")
    pl.add_argument("--recompute-layers", type=int, default=0,
                    help="layers per pipeline chunk fully recomputed, the rest follow --recompute "
                         "(Megatron's --recompute-method block --recompute-num-layers; default 0)")
    pl.add_argument("--offload-layers", type=int, default=0,
                    help="layers per pipeline chunk whose activations are offloaded to host "
                         "memory (Megatron-core's cpu_offloading_num_layers; default 0)")
    pl.add_argument("--offload-optimizer", type=float, default=0.0, metavar="SHARE",
                    help="share of the optimizer states kept in host memory and stepped by the "
                         "CPU, 0 to 1 (ZeRO-Offload: 1; Megatron-core --optimizer-cpu-offload "
                         "--optimizer-offload-fraction; default 0)")
    pl.add_argument("--offload-weights", action="store_true",
                    help="keep the weights in host memory and copy each layer's in before it "
                         "runs (ZeRO-Infinity offload_param, usually with --zero 3)")
    pl.add_argument("--account-embedding-loss", action="store_true",
                    help="count the embedding and the LM head + loss as one pipeline layer each "
                         "(Megatron's account_for_{embedding,loss}_in_pipeline_split)")
    pl.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3])
    pl.add_argument("--optimizer-moments", default="fp32", choices=["fp32", "bf16"],
                    help="Adam moment precision: bf16 is Megatron-core's precision-aware optimizer "
                         "(--exp-avg-dtype / --exp-avg-sq-dtype bf16; fp32 master weights stay): "
                         "8 instead of 12 B of optimizer state per parameter (default fp32)")
    pl.add_argument("--fp32-gradients", action=argparse.BooleanOptionalAction, default=None,
                    help="fp32 gradient buffer and reduction; --no-fp32-gradients for 16-bit "
                         "gradients as in NeMo / Megatron-Bridge performance recipes "
                         "(grad_reduce_in_fp32=False). Default: Megatron-LM's, fp32 except with "
                         "--precision fp16")
    pl.add_argument("--precision", default=None, choices=["fp32", "tf32", "bf16", "fp16", "fp8",
                                                          "fp4"],
                    help="GEMM precision (default bf16, fp16 on V100); fp32 runs at the GPU's "
                         "fp32 tensor-core rate (TF32 on A100 and later, the same as tf32, as "
                         "with PyTorch's allow_tf32 = True)")
    pl.add_argument("--sp", dest="sequence_parallel", action=argparse.BooleanOptionalAction,
                    default=None, help="sequence parallelism (default: on when tp > 1)")
    pl.add_argument("--flash", dest="flash_attention", action=argparse.BooleanOptionalAction,
                    default=True, help="fused attention (default on)")
    pl.add_argument("--overlap-tp", action=argparse.BooleanOptionalAction, default=True)
    pl.add_argument("--overlap-tp-backward", action=argparse.BooleanOptionalAction, default=True,
                    help="reduce each column-parallel input gradient during its weight-gradient "
                         "GEMM (Megatron's asynchronous TP all-reduce; --no-overlap-tp-backward "
                         "for the 2021 Megatron-LM)")
    pl.add_argument("--overlap-dp", action=argparse.BooleanOptionalAction, default=True)
    pl.add_argument("--zero3-per-matrix", action="store_true",
                    help="with --zero 3: DeepSpeed-style gathers, one per weight matrix (default: "
                         "FSDP-style, one per transformer layer)")
    add_set_argument(h)
    h.add_argument("--efficiency", default=None, help="fitted efficiency JSON")
    add_runtime_argument(p, what="The report names it; the step-time table adds host_wait, "
                                 "the time the GPUs wait for the host to issue the layers' "
                                 "work.")
    group(p, "output").add_argument(
        "--interval", action="store_true",
        help="also print the 90%% prediction interval of the step time (calibration "
             "uncertainty + model error, a MoE model's from held-out MoE runs; a few seconds "
             "more)")
    group(p, "output").add_argument(
        "--detail", action="store_true",
        help="also print the full breakdown: per operation of a layer (forward, backward, "
             "recompute) its FLOPs, bytes, time and binding resource; per communication term "
             "its message size, calls, link time and hidden and exposed parts (with --json: a "
             "\"detail\" object)")
    add_output_arguments(p)
    p.set_defaults(func=run_train)


def _train_inputs(args):
    """(model, system, plan, efficiency, RuntimeChoice) of `train`'s command line; the
    runtime's plan defaults fill the plan options not given."""
    choice = resolve_runtime(args, "train")
    unflagged = apply_plan_defaults(args, choice, "train")
    if args.vp is None:
        args.vp = 3 if args.pp > 1 else 1
    model = _load_model(args.model, args.seq_len, training=True)
    if args.nvlink_domain is not None and any(
            o.field == "nvlink_domain" for o in parse_overrides(args.set)):
        raise CliError("--nvlink-domain and --set nvlink_domain=... both set the NVLink domain; "
                       "give one")
    system = system_with_overrides(_train_system(args), args.set)
    if args.precision is None:
        args.precision = presets.default_precision(args.gpu)
    presets.check_precision_names(args.gpu, **{"--precision": args.precision})
    per_replica = args.tp * args.pp * args.cp
    if args.dp is None:
        if args.gpus % per_replica:
            raise CliError(f"--gpus {args.gpus} is not divisible by tp*pp*cp = {per_replica}")
        dp = args.gpus // per_replica
    else:
        dp = args.dp
        if dp * per_replica != args.gpus:
            raise CliError(f"tp*pp*dp*cp = {dp * per_replica} does not equal --gpus {args.gpus}")
    sp = args.sequence_parallel if args.sequence_parallel is not None else args.tp > 1
    problem = layer_count_error(float(model.layers), args.pp, args.vp, args.recompute == "full",
                                args.recompute_layers, args.offload_layers,
                                name=lambda f: "--" + f.replace("_", "-"))
    if problem:
        raise CliError(problem)
    if not 0.0 <= args.offload_optimizer <= 1.0:
        raise CliError(f"--offload-optimizer must lie in [0, 1], got {args.offload_optimizer:g}")
    if args.zero3_per_matrix and args.zero != 3:
        raise CliError(f"--zero3-per-matrix describes ZeRO-3's gathers; it needs --zero 3 "
                       f"(got --zero {args.zero})")
    plan = TrainingPlan(tp=args.tp, pp=args.pp, dp=dp, cp=args.cp, ep=args.ep,
                        micro_batch=args.micro_batch, global_batch=args.global_batch,
                        vp=args.vp, sequence_parallel=int(sp), recompute=args.recompute,
                        zero=args.zero, precision=args.precision,
                        flash_attention=int(args.flash_attention),
                        overlap_tp=int(args.overlap_tp),
                        overlap_tp_backward=int(args.overlap_tp_backward),
                        overlap_dp=int(args.overlap_dp),
                        zero3_per_matrix=int(args.zero3_per_matrix),
                        fp32_gradients=int(args.fp32_gradients if args.fp32_gradients is not None
                                           else args.precision != "fp16"),
                        account_embedding_loss=int(args.account_embedding_loss),
                        recompute_layers=args.recompute_layers,
                        offload_layers=args.offload_layers,
                        fp32_optimizer_moments=int(args.optimizer_moments == "fp32"),
                        expert_tp=args.expert_tp, overlap_ep=int(args.overlap_ep),
                        fused_expert_gemm=int(args.fused_expert_gemm),
                        offload_optimizer=args.offload_optimizer,
                        offload_weights=int(args.offload_weights),
                        **recompute_module_flags(args.recompute_modules))
    plan = with_plan_fields(plan, unflagged)
    return model, system, plan, _load_efficiency(args.efficiency, args.gpu), choice


def recompute_module_flags(text: str) -> dict[str, int]:
    """`TrainingPlan`'s recompute-module flags from a comma-separated --recompute-modules list
    (raises CliError naming an unknown module)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if "core_attn" in names:
        raise CliError("--recompute-modules: core_attn is --recompute selective (the attention "
                       "core); list the other modules here")
    unknown = [n for n in names if n not in RECOMPUTE_MODULES]
    if unknown:
        raise CliError(f"--recompute-modules: unknown module {unknown[0]!r}; known: "
                       f"{', '.join(RECOMPUTE_MODULES)}")
    return {field: int(name in names) for name, field in RECOMPUTE_MODULES.items()}


def training_summary(report, system) -> dict:
    """Plain-Python dict of a scalar TrainingReport (what `--json` prints)."""
    r = jax.device_get(report)
    mem = r.memory
    reason = int(r.reason)
    return {
        "step_time_s": float(r.step_time),
        "breakdown_s": {
            "compute": float(r.compute_time) - float(r.recompute_time),
            "recompute": float(r.recompute_time),
            "tp_comm_exposed": float(r.tp_comm_time),
            "cp_comm_exposed": float(r.cp_comm_time),
            "ep_comm_exposed": float(r.ep_comm_time),
            "pp_comm_exposed": float(r.pp_comm_time),
            "dp_comm_exposed": float(r.dp_comm_time),
            "pipeline_bubble": float(r.bubble_time),
            "optimizer": float(r.optimizer_time),
            "offload_exposed": float(r.offload_time),
            "host_wait": float(r.host_time),
        },
        "memory_gb": {
            "weights": float(mem.weights) / 1e9, "gradients": float(mem.gradients) / 1e9,
            "optimizer": float(mem.optimizer) / 1e9, "activations": float(mem.activations) / 1e9,
            "reserved": float(mem.reserved) / 1e9, "total": float(mem.total) / 1e9,
            "capacity": float(system.accelerator.hbm_capacity) / 1e9,
            "host_offloaded": float(mem.host) / 1e9,
            "host_activations": float(mem.host_activations) / 1e9,
            "host_weights": float(mem.host_weights) / 1e9,
            "host_optimizer": float(mem.host_optimizer) / 1e9,
            "host_capacity": float(system.accelerator.host_memory) / 1e9,
        },
        "fits": bool(r.fits),
        "mfu": float(r.mfu), "hfu": float(r.hfu),
        "tokens_per_s": float(r.tokens_per_s),
        "tokens_per_s_per_gpu": float(r.tokens_per_s_per_gpu),
        "num_gpus": int(round(float(r.num_gpus))),
        "feasible": bool(r.feasible),
        "reason": _training_reason_text(reason, mem, system.accelerator),
    }


def _offloads(args) -> bool:
    """Whether the command line offloads anything to host memory."""
    return bool(args.offload_layers or args.offload_optimizer or args.offload_weights)


def offload_summary(model, system, plan, eff) -> dict:
    """`offload_traffic` of a scalar plan as plain floats: what each offload moves per step, B,
    the host bandwidth it needs to stay hidden, B/s, and the optimizer's host streams, s."""
    layer = layer_costs(model, plan, system, eff)
    t = jax.device_get(offload_traffic(model, plan, system.accelerator, layer))
    return {k: float(v) for k, v in t.items()} | {
        "host_bandwidth": float(system.accelerator.host_bandwidth),
        "host_memory_bandwidth": float(system.accelerator.host_memory_bandwidth)}


def _print_offload(o: dict) -> None:
    """The offload lines of `train`: per kind the bytes per step and the bandwidth that hides
    them, against the GPU's host link; the CPU optimizer's streams."""
    link = o["host_bandwidth"]
    for kind in ("activations", "weights", "gradients"):
        moved = o[f"{kind}_bytes_per_step"]
        if moved <= 0:
            continue
        need = o.get(f"{kind}_hide_bandwidth", 0.0)
        verdict = "hidden" if need <= link else "exposed"
        print(f"  offload {kind:11s}  {moved / 1e9:9.1f} GB per step; hiding each copy needs "
              f"{need / 1e9:.0f} GB/s, the host link has {link / 1e9:.0f} GB/s ({verdict})")
    if o["cpu_adam_s"] > 0:
        print(f"  CPU optimizer        {o['cpu_adam_s']:9.3f} s  (Adam at "
              f"{o['host_memory_bandwidth'] / 1e9:.0f} GB/s host DRAM per GPU; gradients to "
              f"host {o['to_host_s']:.3f} s, weights back {o['to_gpu_s']:.3f} s, pipelined)")


def _training_reason_text(reason: int, mem, acc) -> str:
    """`explain` of a training reason code, with the memory numbers for the memory reasons."""
    return capacity_warning(reason, mem.total, acc.hbm_capacity, mem.host,
                            acc.host_memory) or explain(reason)


def _tf32_note(args) -> str:
    """' at the TF32 tensor rate' where --precision fp32 runs on tensor cores (A100 and later)."""
    if args.precision != "fp32":
        return ""
    acc = presets.gpu(args.gpu)
    return " at the TF32 tensor rate" if float(acc.flops_fp32) > float(acc.vector_flops) else ""


def _print_training(args, s: dict, plan, layers: float, choice) -> None:
    rc = {0: "none", 1: "selective", 2: "full"}[int(np.asarray(plan.recompute))]
    if args.recompute_layers and rc != "full":
        rc += f" + {args.recompute_layers} full layers/chunk"
    if args.recompute_modules and rc != "full":
        rc += f" + modules {args.recompute_modules}"
    if args.offload_layers:
        chunk = float(np.asarray(plan.chunk_layers(layers)))
        kept = chunk - (args.recompute_layers if rc != "full" else chunk)
        offloaded = min(args.offload_layers, kept)
        rc += f", offload {offloaded:g} layers/chunk"
        if offloaded < args.offload_layers:
            rc += f" (of {args.offload_layers}: the rest are recomputed)"
    where = f" in {args.system}" if args.system else ""  # the network of another system
    where += tag(args.set)
    print(f"diffperf train: {args.model} on {s['num_gpus']} x {args.gpu}{where}  "
          f"(tp={args.tp} pp={args.pp} dp={s['num_gpus'] // (args.tp * args.pp * args.cp)} "
          f"cp={args.cp} vp={args.vp} mb={args.micro_batch} gb={args.global_batch} "
          f"seq={s['seq_len']} "
          f"recompute={rc} zero={args.zero} {args.precision}{_tf32_note(args)})")
    print(f"  {choice.header()}")
    print(f"  step time            {s['step_time_s']:10.3f} s")
    if "step_time_interval_s" in s:
        iv = s["step_time_interval_s"]
        print(f"    prediction         {iv['text']}" if "text" in iv else
              f"    (no interval: {iv['error']})")
        if "note" in iv:
            print(f"    note: {iv['note']}")
    for k, v in s["breakdown_s"].items():
        if k == "offload_exposed" and not _offloads(args):
            continue  # no offloading: keep the table to the terms that apply
        degree = {"cp_comm_exposed": args.cp, "ep_comm_exposed": args.ep}.get(k)
        if degree == 1:
            continue  # no context / expert parallelism: no such communication
        if k == "host_wait" and v == 0.0 and choice.is_default:
            continue  # the calibration set's runtime: its host never binds
        share = v / s["step_time_s"] * 100 if s["step_time_s"] > 0 else 0.0
        why = ""
        if k == "recompute" and v == 0.0 and rc.startswith("selective") and args.flash_attention:
            why = "  (selective: flash attention recomputes inside its backward, in compute)"
        if k == "host_wait":
            why = "  (host-bound share: the GPUs wait for the host to issue the step's work)"
        print(f"    {k:18s} {v:10.3f} s  {share:5.1f} %{why}")
    print(f"  MFU / HFU            {s['mfu'] * 100:9.1f} % / {s['hfu'] * 100:.1f} %")
    print(f"  tokens/s             {s['tokens_per_s']:12.0f}  "
          f"({s['tokens_per_s_per_gpu']:.0f} per GPU)")
    m = s["memory_gb"]
    print(f"  memory per GPU       {m['total']:9.1f} GB of {m['capacity']:.1f} GB  "
          f"(weights {m['weights']:.1f}, grads {m['gradients']:.1f}, optimizer "
          f"{m['optimizer']:.1f}, activations {m['activations']:.1f}, reserved "
          f"{m['reserved']:.1f})")
    if _offloads(args):
        parts = ", ".join(f"{k} {m['host_' + k]:.1f}" for k in ("activations", "weights",
                                                                 "optimizer")
                          if m["host_" + k] > 0)
        print(f"  host memory per GPU  {m['host_offloaded']:9.1f} GB of {m['host_capacity']:.0f} GB"
              f"  (offloaded: {parts or 'nothing'})")
    if "offload" in s:
        _print_offload(s["offload"])
    print(f"  feasible             {'yes' if s['feasible'] else 'NO: ' + s['reason']}")
    if "note" in s:
        print(f"  note: {s['note']}")
    if "what_if" in s:
        w, b = s["what_if"], s["what_if"]["preset"]
        print(f"  what-if vs the preset ({'; '.join(w['changes'])}):")
        if "step_time_s" not in b:
            print(f"    the preset cannot run this plan: {b['reason']}")
            return
        print(f"    step time          {change(b['step_time_s'], s['step_time_s'], 's')}")
        print(f"    MFU                {change(b['mfu'] * 100, s['mfu'] * 100, '%', False)}")
        print(f"    memory per GPU     {change(b['memory_gb'], m['total'], 'GB')}")
        print(f"    feasible           {'yes' if b['feasible'] else 'no'} -> "
              f"{'yes' if s['feasible'] else 'no'}")


def run_train(args) -> int:
    model, system, plan, eff, choice = _train_inputs(args)
    runtime = choice.runtime
    # ValueError for invalid plans
    report = predict_training(model, system, plan, eff, runtime)
    s = training_summary(report, system)
    s["runtime"] = choice.to_json()
    s["seq_len"] = int(float(model.seq_len))
    notes = training_notes(model, plan) + utilisation_notes(
        float(report.mfu), float(report.hfu), float(plan.flash_attention))
    if _offloads(args):
        s["offload"] = offload_summary(model, system, plan, eff)
        domain = float(system.network.nvlink_domain)
        if args.offload_optimizer and s["num_gpus"] < domain:
            notes.append(f"CPU Adam gets {s['offload']['host_memory_bandwidth'] / 1e9:.0f} GB/s "
                         f"of host DRAM per GPU, the node's shared by all {domain:g} of its "
                         f"GPUs; a job on {s['num_gpus']} of them may get more "
                         f"(--set host_memory_bandwidth=x{domain / s['num_gpus']:g})")
    if notes:
        s["note"] = "; ".join(notes)
    if args.interval:
        described = spec_descriptor(
            model, system, plan, "step_time", args.gpu,
            choice.name + (" (modified by --set)" if choice.set_items else ""),
            issues_from_host(runtime))
        s["step_time_interval_s"] = interval_summary(
            lambda e: train_step(model, system, plan, e, runtime).step_time, args.efficiency,
            args.gpu, "train", described, what_if_hardware=bool(args.set))
    if args.set:
        base_system = _train_system(args)
        try:
            base = training_summary(predict_training(model, base_system, plan, eff,
                                                     choice.preset), base_system)
            preset = {k: base[k] for k in ("step_time_s", "mfu", "tokens_per_s_per_gpu", "fits",
                                           "feasible")} | {"memory_gb": base["memory_gb"]["total"]}
        except ValueError as e:  # the plan needs what only the changed hardware has
            preset = {"feasible": False, "reason": str(e)}
        s["what_if"] = comparison(base_system, system, args.set, preset, choice.preset,
                                  runtime)
    if args.detail:
        s["detail"] = detail_summary(model, system, plan, eff, report)
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        _print_training(args, s, plan, float(model.layers), choice)
        if args.detail:
            print_detail(s["detail"])
    return 0


# -------------------------------------------------------------------------------- validate
#: How the CSV commands (validate, predict, calibrate) choose a row's software runtime.
_ROW_RUNTIME = (f"Each row's software runtime is its `runtime` column (empty: "
                f"{presets.DEFAULT_RUNTIME}), with that runtime's plan defaults for the row's "
                f"empty plan cells: a CSV can mix runtimes, so these commands take no --runtime "
                f"(diffperf presets lists the runtimes)")


def _add_validate(sub):
    p = sub.add_parser("validate", help="compare predictions with published measurements",
                       description="Predict every row of benchmark CSV(s) and report errors.")
    p.add_argument("--data", action="append", default=None,
                   help="benchmark CSV, columns as in docs/benchmark-format.md (repeatable; "
                        "default: the shipped train and infer sets). " + _ROW_RUNTIME)
    p.add_argument("--efficiency", default=None, help="fitted efficiency JSON")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--summary", action="store_true", help="print only the summary")
    p.add_argument("--plot", default=None,
                   help="also save predicted vs measured and the errors by source to this "
                        "image file (matplotlib)")
    p.set_defaults(func=run_validate)


def _default_data() -> list[str]:
    files = [BENCHMARKS / "train_calibration.csv", BENCHMARKS / "infer_calibration.csv"]
    found = [str(f) for f in files if f.is_file()]
    if not found:
        raise CliError(f"no benchmark data at {BENCHMARKS}; pass --data FILE.csv")
    return found


def run_validate(args) -> int:
    paths = args.data or _default_data()
    result = validate(paths, _load_efficiency(args.efficiency), progress=True)
    if not result["rows"] and not result["failed"]:
        raise CliError(f"no benchmark rows in {', '.join(map(str, paths))}")
    status = 2 if not result["rows"] else 0  # every row failed: bad input
    if args.plot and result["rows"]:
        validation_plot(result["rows"], args.plot,
                        title=f"diffperf validate: {', '.join(Path(p).name for p in paths)}")
        print(f"wrote {args.plot}", file=sys.stderr)
    elif args.plot:
        print("no plot: no row could be predicted", file=sys.stderr)
    if args.json:
        print(json.dumps({k: result[k] for k in ("rows", "summary", "failed")}
                         | {k: result[k] for k in ("defaults", "warnings", "implausible",
                                                 "suspect_units")}))
        return status
    if not args.summary:
        print(f"{'id':58s} {'metric':22s} {'measured':>11s} {'predicted':>11s} {'error':>7s}")
        for r in result["rows"]:
            print(f"{r['id'][:58]:58s} {r['metric']:22s} {r['measured']:11.4g} "
                  f"{r['predicted']:11.4g} {_pct(r['ape'])}%")
        print()
    print_validation_summary(result, paths)
    return status


def _pct(x: float) -> str:
    """A percentage in 6 characters; beyond 10^6 % (a measurement off by orders of magnitude,
    e.g. a unit error in the CSV) in exponent form instead of hundreds of digits."""
    return f"{x:6.1f}" if x < 1e6 else f"{x:6.2g}"


#: Flagged measurements (implausible, suspect units) listed one per line up to this many;
#: beyond it the summary gives their count and the `FLAG_EXAMPLES` most extreme.
FLAG_LINES, FLAG_EXAMPLES = 5, 3
#: Kinds of failure (distinct messages) listed, most frequent first, before "... more".
FAILURE_KINDS = 10


def print_validation_summary(result: dict, paths) -> None:
    """The summary of `validate`: MAPE per metric, then the flags (failed rows by message,
    rows that do not fit, implausible and suspect measurements: counted, with a few examples,
    whatever the number of rows), then the IMEC subsets."""
    print(f"validation on {', '.join(Path(p).name for p in paths)}:")
    for metric, s in result["summary"].items():
        print(f"  {metric:22s} n={s['n']:3d}  MAPE {_pct(s['mape'])} %  max {_pct(s['max_ape'])} %")
    if result["failed"]:
        print(f"  failed rows: {len(result['failed'])}")
        shown: dict[str, list[str]] = {}
        for f in result["failed"]:
            shown.setdefault(f["error"], []).append(f["id"])
        kinds = sorted(shown.items(), key=lambda kv: -len(kv[1]))  # stable: ties keep order
        for err, ids in kinds[:FAILURE_KINDS]:
            print(f"    {len(ids):3d} x {err}  (e.g. {ids[0]})")
        if len(kinds) > FAILURE_KINDS:
            rest = sum(len(ids) for _, ids in kinds[FAILURE_KINDS:])
            print(f"    ... {len(kinds) - FAILURE_KINDS} more kinds ({rest} rows): see --json "
                  f"failed")
    if result["warnings"]:
        print(f"  rows predicted not to fit in HBM or host memory (see --json warnings): "
              f"{len(result['warnings'])}")
    for key, label, what, size in (
            ("implausible", "implausible measurement", "faster than ideal hardware could run "
             "their recorded configuration", "factor"),
            ("suspect_units", "suspect measurement", "likely unit mix-ups", "ratio")):
        flagged = result.get(key, [])
        if len(flagged) <= FLAG_LINES:
            for bad in flagged:
                print(f"  {label}: {bad['id']}: {bad['warning']}")
            continue
        print(f"  {label}s: {len(flagged)} ({what}; all in --json {key}); the "
              f"{FLAG_EXAMPLES} most extreme:")
        for bad in sorted(flagged, key=lambda b: b[size], reverse=True)[:FLAG_EXAMPLES]:
            print(f"    {bad['id']}: {bad['warning']}")
    if result["defaults"]:
        print(f"  rows that used schema defaults for empty plan cells: {len(result['defaults'])}")
    for name, summary in imec_summaries(result).items():
        for metric, v in summary.items():
            print(f"  {name}: {metric} n={v['n']} MAPE {_pct(v['mape']).strip()} % "
                  f"(max {_pct(v['max_ape']).strip()} %)")


# --------------------------------------------------------------------------------- predict
def _add_predict(sub):
    p = sub.add_parser("predict", help="predict every configuration listed in CSV file(s)",
                       description="Predict each row of benchmark-format CSV(s) "
                                   "(docs/benchmark-format.md; measured columns optional): "
                                   "training step time, tokens/s, TFLOP/s or inference "
                                   "latencies and throughput, memory per GPU, and whether the "
                                   "plan fits. Rows that cannot be evaluated say why.")
    p.add_argument("--data", action="append", required=True, metavar="CSV",
                   help="configurations to predict (repeatable). " + _ROW_RUNTIME)
    p.add_argument("--efficiency", default=None, help="fitted efficiency JSON")
    p.add_argument("--out", default=None, help="write the predictions to this .csv file")
    p.add_argument("--json", action="store_true", help='print one JSON object {"rows": [...]}')
    p.add_argument("--interval", action="store_true",
                   help="add the 90%% prediction interval of each row's step time (train) or "
                        "end-to-end latency (infer), from the calibration's uncertainty")
    p.set_defaults(func=run_predict)


def run_predict(args) -> int:
    import pandas as pd
    df = predict_csv(args.data, _load_efficiency(args.efficiency), intervals=args.interval,
                     fit=args.efficiency, progress=True)
    if df.empty:
        raise CliError(f"no rows in {', '.join(args.data)}")
    invalid = df["status"].str.startswith("invalid")
    status = 2 if invalid.all() else 0  # nothing predicted
    if args.out:
        df.to_csv(args.out, index=False, float_format="%.6g")
    if args.json:
        print(json.dumps({"rows": json.loads(df.to_json(orient="records"))}))
        return status
    if args.out:
        print(f"wrote {len(df)} predictions to {args.out}")
    else:
        head = f"{'id':40s} {'kind':5s} {'time (s)':>10s} {'tok/s/GPU':>10s} {'mem GB':>7s}"
        print(head + ("  90% interval (s)   " if args.interval else "") + "  status")
        for r in df.itertuples():
            train = r.kind == "train"
            time = r.step_time_s if train else r.e2e_latency_s
            rate = r.tokens_per_s_per_gpu if train else r.output_tok_s_per_gpu
            mem = r.peak_memory_gb
            cells = (f"{time:10.4g} " + (f"{rate:10.1f}" if rate < 1e7 else f"{rate:10.3g}")
                     + " " + (f"{mem:7.1f}" if mem < 1e5 else f"{mem:7.2g}")
                     if r.fits is not None else f"{'-':>10s} {'-':>10s} {'-':>7s}")
            if args.interval:
                low, high = r.interval_low_s, r.interval_high_s
                cells += (f"  {low:8.4g} to {high:<8.4g} ({r.interval_why})"
                          if pd.notna(low) else f"  {'-':>8s}    {'-':<8s}")
            print(f"{r.id[:40]:40s} {r.kind:5s} {cells}  {r.status}")
        print("time = step time (train) or end-to-end latency (infer); --out F.csv or --json "
              "for every column (TTFT, TPOT, TFLOP/s)")
        print("runtime: each row's runtime column: "
              + ", ".join(f"{k} ({n} rows)" for k, n in csv_runtimes(args.data).items()))
    if invalid.any():
        print(f"{int(invalid.sum())} of {len(df)} rows could not be evaluated (status column)",
              file=sys.stderr)
    return status


def csv_runtimes(paths) -> dict[str, int]:
    """{runtime: rows} of the `runtime` columns of benchmark CSVs (empty or absent: the
    default runtime), for the report's header."""
    import pandas as pd
    counts: dict[str, int] = {}
    for path in paths:
        df = pd.read_csv(path, dtype=str, keep_default_na=False,
                         skiprows=_leading_comments(path))
        df.columns = [str(c).strip() for c in df.columns]
        names = (df["runtime"].str.strip().str.lower() if "runtime" in df
                 else pd.Series([""] * len(df)))
        for name in names.replace("", presets.DEFAULT_RUNTIME):
            counts[name] = counts.get(name, 0) + 1
    return counts


# ----------------------------------------------------------------------------------- bench
def _add_bench(sub):
    p = sub.add_parser("bench", help="measure evaluations per second and gradient cost",
                       description="core: training / inference evaluations per second, latency "
                                   "after jit, gradient cost; sweep: the sweep engine with 1, 2, "
                                   "4, 8 forced CPU devices; search: the GPT-3 175B / 1,024 A100 "
                                   "exhaustive plan search; cli: wall time of `diffperf train`, "
                                   "`infer` and `validate` on a few rows, each in a fresh "
                                   "process with a warm compilation cache; serve: 10^4 serving "
                                   "deployments x 1,000 requests simulated (vmapped).")
    p.add_argument("what", nargs="?", default="core",
                   choices=["core", "sweep", "search", "cli", "serve", "all"])
    p.add_argument("--n", type=int, default=1_000_000,
                   help="configurations (default 10^6, at most 10^7)")
    p.add_argument("--repeats", type=int, default=5,
                   help="cli: timed runs of each command (default 5)")
    p.add_argument("--against", default=None, metavar="DIR",
                   help="cli: also time the source tree DIR (e.g. a `git worktree` of another "
                        "commit, run through PYTHONPATH), alternating with this one")
    add_output_arguments(p)
    p.set_defaults(func=run_bench)


def run_bench(args) -> int:
    if args.what in ("core", "all") and args.n < 2:
        print(f"error: --n must be at least 2 (the sweeps are vmapped over a batch), got "
              f"{args.n}", file=sys.stderr)
        return 2
    if args.what in ("sweep", "search", "cli", "serve") and args.n != 1_000_000:
        print(f"note: --n applies to 'core' only; 'bench {args.what}' has a fixed workload",
              file=sys.stderr)
    log = None if args.json else print
    result = {}
    if args.what in ("core", "all"):
        result["core"] = bench.run_all(n=args.n, log=log)
    if args.what in ("sweep", "all"):
        result["sweep"] = bench.sweep_scaling(log=log)
    if args.what in ("search", "all"):
        result["search"] = bench.search_benchmark(log=log)
    if args.what in ("cli", "all"):
        result["cli"] = bench.cli_benchmark(repeats=args.repeats, against=args.against, log=log)
    if args.what in ("serve", "all"):
        result["serve"] = bench.serving_benchmark(log=log)
    if args.json:
        print(json.dumps(result))
    return 0


# --------------------------------------------------------------------------------- presets
def _add_presets(sub):
    p = sub.add_parser("presets", help="list the shipped GPU, system, model and software "
                                       "runtime presets",
                       description="List the shipped presets: GPUs, systems, models, and the "
                                   "software runtimes of --runtime (each with its description, "
                                   "CUDA graphs, host costs and plan defaults). `diffperf "
                                   "presets export NAME` writes one as a JSON file that --gpu, "
                                   "--system, --model and --runtime take (docs/spec-files.md).")
    p.add_argument("action", nargs="?", choices=["export"],
                   help="export: write preset NAME as a spec file (to stdout, or --out)")
    p.add_argument("name", nargs="?", metavar="NAME",
                   help="the GPU, system, model or runtime id to export")
    add_output_arguments(p, out="with export: write the file here instead of to stdout")
    p.set_defaults(func=run_presets)


def run_presets_export(args) -> int:
    """`diffperf presets export NAME [--out FILE]`: the preset as a spec file."""
    if not args.name:
        raise CliError("presets export needs the NAME of a GPU, system, model or runtime preset")
    text = json.dumps(presets.preset_file(args.name), indent=2) + "\n"
    if args.out is None:
        sys.stdout.write(text)
        return 0
    Path(args.out).write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def run_presets(args) -> int:
    if args.action == "export":
        return run_presets_export(args)
    if args.name is not None or args.out is not None:
        raise CliError(f"{'NAME' if args.name is not None else '--out'} is for `diffperf "
                       f"presets export NAME`")
    names = {"gpus": presets.gpu_names(), "systems": presets.system_names(),
             "models": presets.model_names()}
    runtimes = [runtime_summary(n) for n in presets.runtime_names()]
    if args.json:
        print(json.dumps(names | {"runtimes": runtimes,
                                  "default_runtime": presets.DEFAULT_RUNTIME}, indent=1))
        return 0
    for kind, listed in names.items():
        print(f"{kind}: {', '.join(listed)}")
    print(f"runtimes: {', '.join(presets.runtime_names())}")
    for r in runtimes:
        print(f"  {runtime_summary_text(r)}")
    return 0


# ------------------------------------------------------------------------------------ main
def run_quickstart(args) -> int:
    """Default job: GPT-3 175B on 1,024 A100s, then the validation summary."""
    parser = build_parser()
    train_args = parser.parse_args(["train"])
    run_train(train_args)
    print()
    paths = _default_data() if BENCHMARKS.is_dir() else []
    if paths:
        result = validate(paths)
        print_validation_summary(result, paths)
    print("\nnext: diffperf train --help | diffperf validate | diffperf bench | diffperf presets")
    return 0


def _version() -> str:
    """The installed distribution's version (`pip show diffperf`)."""
    try:
        return importlib.metadata.version("diffperf")
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        return "(not installed)"


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (`error: argument --tp: invalid int value: 'abc' (see
    diffperf train --help)`) instead of the usage block, like every other error of the CLI;
    the sub-commands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="diffperf",
        description="Differentiable performance model of distributed LLM training and inference."
                    " Without a command: predict GPT-3 175B on 1,024 A100s and validate.")
    parser.add_argument("--version", action="version", version=f"diffperf {_version()}")
    sub = parser.add_subparsers(dest="command")
    _add_train(sub)
    _add_validate(sub)
    _add_predict(sub)
    _add_bench(sub)
    _add_presets(sub)
    add_infer_parser(sub)
    add_serve_parser(sub)
    add_search_parser(sub)
    add_calibrate_parser(sub)
    add_design_parsers(sub)
    add_daemon_parser(sub)
    parser.set_defaults(func=run_quickstart)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Which options were given (a runtime's plan defaults fill only the others).
    args._given = given_options(parser, argv)
    if args.command == "bench":  # benchmarks report cold, compilation-included times
        disable_compilation_cache()
    else:
        enable_compilation_cache()
    try:
        resolve_hardware_names(args)
        check_values(args)
        check_paths(args)
        return args.func(args) or 0
    except (CliError, BenchmarkError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader of our output went away (`diffperf train | head`): stop quietly, with
        # stdout on /dev/null so that the interpreter's final flush does not fail (not in a
        # daemon, whose stdout is the client's stream and has no file descriptor).
        try:
            fd = sys.stdout.fileno()
        except (OSError, ValueError):
            return 0
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
        return 0
    except OSError as e:  # unreadable / unwritable files named by the user
        print(f"error: {_os_error_message(e, args)}", file=sys.stderr)
        return 2


def _os_error_message(e: OSError, args) -> str:
    """An OS error with the command-line option of the file it concerns (`--out x.csv: [Errno
    28] No space left on device`): the error's own file name if one option names it, else the
    output options given (a full disk reports no file name)."""
    named = []
    for k in _INPUTS + _OUTPUTS:
        v = getattr(args, k, None)
        for x in [v] if isinstance(v, str) else (v or []):
            if isinstance(x, str):
                named.append((k, x))
    if e.filename is not None:
        hits = [(k, x) for k, x in named if Path(x).resolve() == Path(str(e.filename)).resolve()]
    else:
        hits = [(k, x) for k, x in named if k in _OUTPUTS]
    where = ", ".join(f"{_opt(k)} {x}" for k, x in hits)
    reason = f"[Errno {e.errno}] {e.strerror}" if e.strerror else str(e)
    return f"{where}: {reason}" if where else str(e)

