"""`diffperf infer`: predict one serving configuration and print its boundedness table; and
`bench_inference`, the vmapped inference sweep timed by `diffperf bench`."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._checks import check_finite_report
from ..calibrate._error_model import spec_descriptor
from ..calibrate._uncertainty import decode_quantity, interval_summary
from ..explore._what_if import add_set_argument, change, comparison, system_with_overrides, tag
from ..feasibility import VALID_OR_OUT_OF_HBM, describe_failure, explain
from ..inference._boundedness import boundedness
from ..inference._infer import infer
from ..plots._roofline_plot import roofline_plot
from ..presets import (
    DEFAULT_RUNTIME,
    check_precision_names,
    default_efficiency,
    default_precision,
    gpu_names,
    model,
    system,
)
from ..specs._hardware import (
    BYTES_PER_ELEMENT,
    INTEGER_WEIGHTS,
    WEIGHT_SCALE_BLOCK,
    precision_code,
    weight_scale_block,
    weight_storage,
)
from ..specs._inference_plan import InferencePlan
from ..validation._stack import constants_static
from ._common import (
    DEFAULT_INFER_GPU,
    DEFAULT_INFER_MODEL,
    _load_efficiency,
    _load_model,
    add_gpu_argument,
    add_model_argument,
    add_output_arguments,
    group,
    wrote,
)
from ._runtime import (
    RuntimeChoice,
    add_runtime_argument,
    apply_plan_defaults,
    has_host_times,
    resolve_runtime,
    with_plan_fields,
)

#: What `infer --set` compares with the preset: (summary key, label, unit, scale).
_WHAT_IF_ROWS = (("ttft_s", "TTFT", "ms", 1e3), ("tpot_s", "TPOT", "ms", 1e3),
                 ("e2e_latency_s", "e2e latency", "s", 1.0),
                 ("output_tok_s_per_gpu", "tok/s per GPU", "", 1.0))

#: The per-phase time terms of `infer --json`, s (`host`: the GPU waiting for the host).
_PHASE_TERMS = ("gemm", "attention", "elementwise", "launch", "tp_comm", "pp_comm", "host",
                "total")


def add_per_head_decode(parser) -> None:
    """The `--per-head-decode` flag (shared by `infer` and `search infer`)."""
    parser.add_argument("--per-head-decode", action="store_true",
                        help="decode attention with one thread block per query head "
                             "(TensorRT-LLM masked MHA) instead of a grouped GQA kernel")


def add_attention_dp(parser) -> None:
    """`--attention-dp`: attention data-parallel over the tp GPUs (`InferencePlan.attention_dp`)."""
    parser.add_argument("--attention-dp", action="store_true",
                        help="attention data parallelism over the tp GPUs (TensorRT-LLM "
                             "enable_attention_dp, SGLang --enable-dp-attention): each GPU "
                             "serves its own sequences with the whole attention block and KV "
                             "cache; only the routed experts are split (use --ep = --tp)")


def add_prefill_tokens(parser) -> None:
    """The `--prefill-tokens` option (shared by `infer` and `search infer`)."""
    parser.add_argument("--prefill-tokens", type=int, default=0,
                        help="chunked prefill: the most prompt tokens one forward pass "
                             "processes (TensorRT-LLM max_num_tokens, vLLM "
                             "max_num_batched_tokens); bounds the prefill activations in the "
                             "memory estimate and max batch (default 0: all prompts at once)")


def add_precision_arguments(parser) -> None:
    """`--precision`, `--activation-precision`, `--kv-precision` and `--gemm-peak-fraction`
    (shared by `infer` and `search infer`; read back with `precisions_of`)."""
    parser.add_argument("--precision", default=None,
                        help="weight and GEMM precision: fp32, bf16, fp16, fp8, fp4 (default "
                             "bf16, fp16 on V100); int8 / int4 for weight-only quantisation, "
                             "with a 16-bit --activation-precision")
    parser.add_argument("--activation-precision", default=None,
                        help="GEMM input precision (default: --precision)")
    parser.add_argument("--kv-precision", default=None,
                        help="KV-cache precision (default: the GEMM input precision, "
                             "--activation-precision if given, else --precision)")
    parser.add_argument("--gemm-peak-fraction", type=float, default=1.0,
                        help="share of the tensor-core peak the weight GEMM kernels can issue "
                             "(default 1; about 0.67 for Ampere-generation mma.sync kernels on "
                             "Hopper, e.g. TensorRT-LLM <= 0.9 weight-only / MoE GEMMs, "
                             "Marlin)")


def add_infer_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `infer` sub-command on an argparse `subparsers` object."""
    p = subparsers.add_parser(
        "infer", help="predict LLM inference latency, throughput, memory and boundedness",
        description="Predict time to first token, time per output token, end-to-end latency, "
                    "throughput and memory of a static batch of requests, with the per-operation "
                    "boundedness table (compute / memory / network / launch overhead). Without "
                    f"--model / --gpu: {DEFAULT_INFER_MODEL} on {DEFAULT_INFER_GPU}, as "
                    "`search infer`.")
    add_model_argument(p, DEFAULT_INFER_MODEL)
    add_gpu_argument(p, DEFAULT_INFER_GPU)
    h, pl = group(p, "hardware"), group(p, "plan")
    pl.add_argument("--tp", type=int, default=1,
                    help=f"tensor parallel degree (default 1; {DEFAULT_INFER_MODEL}'s bf16 "
                         f"weights need tp >= 2 on an 80 GB GPU)")
    pl.add_argument("--pp", type=int, default=1, help="pipeline parallel degree (default 1)")
    pl.add_argument("--ep", type=int, default=1,
                    help="expert-parallel degree of a MoE model's experts within the tp GPUs "
                         "(divides tp; TensorRT-LLM's moe_ep_size, with moe_tp_size = tp / ep; "
                         "default 1: every expert split over all tp GPUs)")
    add_attention_dp(pl)
    pl.add_argument("--batch", type=int, default=1,
                    help="concurrent sequences (default 1; with --attention-dp over all ranks)")
    pl.add_argument("--input", type=int, default=128, help="prompt tokens (default 128)")
    pl.add_argument("--output", type=int, default=128, help="generated tokens (default 128)")
    add_precision_arguments(pl)
    add_prefill_tokens(pl)
    pl.add_argument("--no-flash", action="store_true", help="unfused prefill attention")
    add_per_head_decode(pl)
    add_set_argument(h)
    h.add_argument("--efficiency", default=None, help="efficiency factors JSON file")
    add_runtime_argument(p, what="The report names it, and each phase's host term is the "
                                 "time the GPU waits for the host (the serving engine's "
                                 "scheduler, Python and launches outside CUDA graphs).")
    group(p, "output").add_argument(
        "--interval", action="store_true",
        help="also print the 90%% prediction intervals of TTFT and end-to-end latency "
             "(parameter uncertainty + the model's held-out error on that quantity; at least "
             "the held-out error of inference outside the fitted data on an unfitted GPU, GEMM "
             "precision or --set hardware, or of a MoE model with more experts than any "
             "fitted one)")
    add_output_arguments(p, plot="save a roofline plot to this file")
    p.set_defaults(func=run_infer)
    return p


def precisions_of(args) -> tuple[str, str, str]:
    """(weights, GEMM inputs, KV cache) precision names of the command line; integer weights
    (weight-only quantisation) need a 16-bit or wider --activation-precision. The KV cache
    defaults to the GEMM input precision (so weight-only fp8 / fp4 keeps a 16-bit cache, as
    int8 / int4 do)."""
    if args.precision is None:
        args.precision = default_precision(args.gpu)
    check_precision_names(args.gpu, **{"--precision": args.precision,
                                       "--activation-precision": args.activation_precision,
                                       "--kv-precision": args.kv_precision})
    weights = args.precision.lower()
    if weights in INTEGER_WEIGHTS:
        act = args.activation_precision
        if act is None:
            raise ValueError(f"--precision {weights} is weight-only quantisation: give the GEMM "
                             f"precision with --activation-precision bf16 or fp16")
        try:
            storage = weight_storage(weights, act)
        except ValueError as e:
            raise ValueError(f"--precision {weights}: {e}") from None
        return storage, act, args.kv_precision or act
    act = args.activation_precision or args.precision
    if BYTES_PER_ELEMENT[precision_code(act)] < BYTES_PER_ELEMENT[precision_code(weights)]:
        raise ValueError(f"--activation-precision {act} is narrower than the weights "
                         f"(--precision {weights}): the GEMMs would run at {weights}; quantise "
                         f"the weights too (--precision {act})")
    return args.precision, act, args.kv_precision or act


def precisions_text(args) -> str:
    """The precisions of the command line for a header line, e.g. 'bf16' or 'weights int8, GEMM
    inputs fp16, KV cache fp16, GEMMs at 0.667 of the tensor peak'; 4-bit weights say the bits
    their block scales bring them to ('fp4 (NVFP4 weights: 4.5 bits with their scales)')."""
    weights, act, kv = precisions_of(args)
    text = (args.precision if act == kv == args.precision else
            f"weights {args.precision}, GEMM inputs {act}, KV cache {kv}")
    if weights == "fp4":
        block = weight_scale_block(args.precision)
        fmt = "NVFP4" if block == WEIGHT_SCALE_BLOCK["fp4"] else "MXFP4 / group-wise int4"
        text += f" ({fmt} weights: {4 + 8 / block:g} bits with their scales)"
    if args.gemm_peak_fraction != 1:
        text += f", GEMMs at {args.gemm_peak_fraction:g} of the tensor peak"
    return text


def _specs(args, choice: RuntimeChoice):
    """(model, system, plan, efficiency) of `infer`'s command line; `choice`'s plan defaults
    fill the plan options not given."""
    unflagged = apply_plan_defaults(args, choice, "infer")
    mdl = _load_model(args.model)
    sys_ = system_with_overrides(system(args.gpu), args.set)
    weights, act, kv = precisions_of(args)
    plan = InferencePlan(tp=args.tp, pp=args.pp, ep=args.ep, batch=args.batch,
                         input_len=args.input, output_len=args.output, weight_precision=weights,
                         weight_scale_block=weight_scale_block(args.precision),
                         activation_precision=act, kv_precision=kv,
                         flash_attention=0 if args.no_flash else 1,
                         grouped_decode_attention=0 if args.per_head_decode else 1,
                         gemm_peak_fraction=args.gemm_peak_fraction,
                         prefill_tokens=args.prefill_tokens,
                         attention_dp=1 if args.attention_dp else 0)
    plan = with_plan_fields(plan, unflagged)
    return mdl, sys_, plan, _load_efficiency(args.efficiency, args.gpu)


def _summary(rep) -> dict:
    f = lambda x: float(x)
    mem = rep.memory
    return {
        "ttft_s": f(rep.ttft), "tpot_s": f(rep.tpot), "e2e_latency_s": f(rep.e2e_latency),
        "output_tok_s_per_gpu": f(rep.output_tok_s_per_gpu), "throughput_tok_s": f(rep.throughput),
        "num_gpus": int(rep.num_gpus),
        "memory_gb": {"weights": f(mem.weights) / 1e9, "kv_cache": f(mem.kv_cache) / 1e9,
                      "activations": f(mem.activations) / 1e9,
                      "workspace": f(mem.workspace) / 1e9, "total": f(mem.total) / 1e9},
        "fits": bool(rep.fits), "max_batch": int(rep.max_batch),
        "feasible": bool(rep.feasible),
        "reason": explain(int(rep.reason)),  # memory_gb has the numbers of reason 10
        "prefill_s": {k: f(getattr(rep.prefill, k)) for k in _PHASE_TERMS},
        "decode_s": {k: f(getattr(rep.decode, k)) for k in _PHASE_TERMS},
    }


def _kv_only_max_batch(rep, batch, capacity: float) -> int:
    """The largest batch whose KV cache fits next to the weights and the workspace: the
    capacity of a server that prefills in chunks (TensorRT-LLM's max_num_tokens, vLLM's chunked
    prefill); `max_batch` also holds every prompt's prefill activations at once."""
    mem = rep.memory
    free = capacity - float(mem.weights) - float(mem.workspace)
    per_seq = float(mem.kv_cache) / batch
    return max(int(free // per_seq), 0) if per_seq > 0 else 0


def _caveats(mdl, args, s: dict, choice: RuntimeChoice) -> list[str]:
    """Notes on what the prediction rests on, for the cases where that matters most."""
    notes = []
    decode = s["decode_s"]
    if (decode["total"] > 0 and decode["launch"] > 0.25 * decode["total"] and not args.set
            and choice.is_default):
        notes.append(f"{100 * decode['launch'] / decode['total']:.0f} % of decode is kernel "
                     f"launches, at the per-kernel cost of the 2023-24 TensorRT-LLM / NeMo "
                     f"measurements in the fit; --set launch_overhead=0 removes the host launch "
                     f"cost, as CUDA graphs do (the fitted kernel_overhead stays); --runtime "
                     f"names a serving engine's CUDA graphs and host costs (diffperf presets)")
    if args.interval and float(mdl.kv_lora_rank) > 0:
        notes.append("no inference measurement of multi-head latent attention (MLA) is in the "
                     "calibration, so the real error may be larger than the intervals' model "
                     "error")
    return notes


def _print(args, s: dict, table, capacity: float, choice: RuntimeChoice) -> None:
    m = s["memory_gb"]
    what_if = tag(args.set)
    ep = ((f", ep={args.ep}" if args.ep != 1 else "")
          + (", attention DP" if getattr(args, "attention_dp", False) else ""))
    print(f"{args.model} on {s['num_gpus']} x {args.gpu}{what_if} (tp={args.tp}, pp={args.pp}"
          f"{ep}), batch {args.batch}, {args.input} in / {args.output} out, "
          f"{precisions_text(args)}")
    print(f"  {choice.header()}")
    if s["host_time_factor"] != 1.0 and has_host_times(choice.runtime):
        print(f"  host CPU: the runtime's host times x{s['host_time_factor']:g} "
              f"(host_time_factor: this GPU's host CPU against a DGX H100's x86 host)")
    shown = set()  # a note is printed once, under the first interval it applies to

    def interval(field):
        if field in s:
            iv = s[field]
            print(f"    prediction    {iv['text']}" if "text" in iv else
                  f"    (no interval: {iv['error']})")
            if "note" in iv and iv["note"] not in shown:
                print(f"    note: {iv['note']}")
                shown.add(iv["note"])

    print(f"  TTFT            {s['ttft_s'] * 1e3:10.2f} ms")
    interval("ttft_interval_s")
    print(f"  TPOT            {s['tpot_s'] * 1e3:10.2f} ms" + (
        "  (one output token: no decode step runs; the time one would take)"
        if args.output == 1 else ""))
    print(f"  e2e latency     {s['e2e_latency_s']:10.3f} s")
    interval("e2e_latency_interval_s")
    print(f"  throughput      {s['throughput_tok_s']:10.1f} output tok/s "
          f"({s['output_tok_s_per_gpu']:.1f} per GPU)")
    print(f"  memory per GPU  {m['total']:10.1f} GB of {capacity / 1e9:.1f} GB (weights "
          f"{m['weights']:.1f}, KV cache {m['kv_cache']:.2f}, activations {m['activations']:.2f}, "
          f"workspace {m['workspace']:.1f}); fits: {'yes' if s['fits'] else 'NO'}; "
          f"max batch {s['max_batch']} ({s['max_batch_kv_only']} if only the KV cache had "
          f"to fit, as with chunked prefill)")
    show_host = not choice.is_default or any(s[f"{ph}_s"]["host"] > 0
                                             for ph in ("prefill", "decode"))
    for phase in ("prefill", "decode"):
        b = s[f"{phase}_s"]
        parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in b.items()
                          if k != "total" and (k != "host" or show_host))
        print(f"  {phase:7s} {b['total'] * 1e3:10.2f} ms = {parts} ms")
    if show_host:
        shares = ", ".join(f"{ph} {_share(s[f'{ph}_s']['host'], s[f'{ph}_s']['total'])}"
                           for ph in ("prefill", "decode"))
        print(f"  host-bound      {shares} of the phase's time (the GPU waiting for the host)")
    if "what_if" in s:
        w = s["what_if"]
        print(f"  what-if vs the preset ({'; '.join(w['changes'])}):")
        b = w["preset"]
        if "ttft_s" not in b:
            print(f"    the preset cannot run this plan: {b['reason']}")
        else:
            for key, label, unit, scale in _WHAT_IF_ROWS:
                print(f"    {label:14s} {change(b[key] * scale, s[key] * scale, unit)}")
            print(f"    {'fits':14s} {'yes' if b['fits'] else 'no'} -> "
                  f"{'yes' if s['fits'] else 'no'} (max batch {b['max_batch']} -> "
                  f"{s['max_batch']})")
    print()
    cols = ["phase", "op", "bound", "intensity", "machine_balance", "time_s", "share"]
    print(table[cols].to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    print("(machine_balance: the datasheet ridge point, peak FLOP/s / HBM B/s; `bound` compares "
          "the times at the fitted efficiencies, so a small GEMM a little below the ridge point "
          "can be compute-bound at its lower achieved FLOP/s)")


def _share(part: float, total: float) -> str:
    """`12.3 %` (`-` for an empty phase)."""
    return f"{100 * part / total:.1f} %" if total > 0 else "-"


def run_infer(args) -> int:
    """Run `diffperf infer`; returns the exit status (0 ok, 2 bad input)."""
    try:
        choice = resolve_runtime(args, "infer")
        runtime = choice.runtime
        mdl, sys_, plan, eff = _specs(args, choice)
        # eager: faster than compiling once
        rep = jax.device_get(infer(mdl, sys_, plan, eff, runtime))
        reason = int(rep.reason)
        if reason not in VALID_OR_OUT_OF_HBM:
            text = (explain(reason, precision=int(plan.math_precision)) if reason == 9
                    else describe_failure(reason, mdl, plan))
            print(f"error: infeasible plan: {text}", file=sys.stderr)
            return 2
        check_finite_report(rep, "the inference prediction",
                            f"input={args.input}, output={args.output}, batch={args.batch}")
        table = boundedness(mdl, sys_, plan, eff, runtime, report=rep)
        if args.plot:
            roofline_plot(table, args.plot, sys_,
                          f"{args.model} on {args.gpu}{tag(args.set)}, tp={args.tp}")
            wrote(args.plot)
    except (ValueError, ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    capacity = float(sys_.accelerator.hbm_capacity)
    summary = _summary(rep)
    summary["max_batch_kv_only"] = _kv_only_max_batch(rep, args.batch, capacity)
    summary["runtime"] = choice.to_json()
    summary["host_time_factor"] = float(sys_.accelerator.host_time_factor)
    if args.set:
        base_system = system(args.gpu)
        base_rep = jax.device_get(infer(mdl, base_system, plan, eff, choice.preset))
        base_reason = int(base_rep.reason)
        if base_reason in VALID_OR_OUT_OF_HBM:
            base = _summary(base_rep)
            preset = {k: base[k] for k, *_ in _WHAT_IF_ROWS} | {
                "fits": base["fits"], "max_batch": base["max_batch"],
                "memory_gb": base["memory_gb"]["total"]}
        else:  # the plan needs what only the changed hardware has (e.g. fp8 tensor cores)
            preset = {"feasible": False, "reason": (
                explain(base_reason, precision=int(plan.math_precision)) if base_reason == 9
                else describe_failure(base_reason, mdl, plan))}
        summary["what_if"] = comparison(base_system, sys_, args.set, preset, choice.preset,
                                        runtime)
    if args.interval:
        for field, quantity, unit, scale in (
                ("ttft", "ttft", "ms", 1e3),
                ("e2e_latency", decode_quantity(args.batch, args.output), "s", 1.0)):
            summary[f"{field}_interval_s"] = interval_summary(
                lambda e, f=field: getattr(infer(mdl, sys_, plan, e, runtime), f),
                args.efficiency, args.gpu, "infer",
                spec_descriptor(mdl, sys_, plan, quantity, args.gpu,
                                DEFAULT_RUNTIME if choice.is_default else choice.name),
                unit, scale, what_if_hardware=bool(args.set))
    if reason == 10:
        print(f"warning: {explain(10, float(rep.memory.total), capacity)}; try more GPUs "
              f"(--tp, --pp), narrower weights (--precision) or a smaller --batch: `diffperf "
              f"search infer` lists the plans that fit", file=sys.stderr)
    for note in _caveats(mdl, args, summary, choice):
        print(f"note: {note}", file=sys.stderr)
    layers = float(mdl.layers)
    if args.pp > 1 and layers % args.pp:
        print(f"note: uneven layout: {layers:g} layers over pp = {args.pp} stages "
              f"({layers / args.pp:.2f} each); memory per GPU is the average stage's, the "
              f"largest holds {math.ceil(layers / args.pp)} layers", file=sys.stderr)
    context = args.input + args.output
    if context > float(mdl.seq_len):
        print(f"warning: input + output = {context} tokens exceeds the model's context of "
              f"{float(mdl.seq_len):g} tokens (predicted anyway)", file=sys.stderr)
    if args.json:
        summary["boundedness"] = json.loads(table.to_json(orient="records"))
        print(json.dumps(summary, indent=1))
    else:
        _print(args, summary, table, capacity, choice)
    return 0


def _random_specs(n: int, seed: int):
    """`n` random (model, system, plan) triples stacked as one batch of pytrees."""
    rng = np.random.default_rng(seed)
    names = ["llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "mistral-7b", "mixtral-8x7b"]
    stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
    models, systems = stack([model(m) for m in names]), stack([system(g) for g in gpu_names()])
    pick = lambda tree, size: jax.tree.map(lambda x: x[rng.integers(0, size, n)], tree)
    plan = InferencePlan(
        tp=2.0 ** rng.integers(0, 4, n), pp=1.0, batch=rng.integers(1, 257, n),
        input_len=rng.integers(64, 4097, n), output_len=rng.integers(1, 2049, n),
        weight_precision=1, activation_precision=1, kv_precision=rng.integers(1, 3, n))
    plan = jax.tree.map(lambda x: jnp.broadcast_to(x, (n,)), plan)
    return pick(models, len(names)), pick(systems, len(gpu_names())), plan


def bench_inference(n: int = 100_000, repeats: int = 3, seed: int = 0,
                    share_constants: bool = True) -> float:
    """Inference evaluations per second of one jit-compiled, vmapped sweep of `n` random
    configurations (models, GPUs, tp, batch, lengths, KV precision), best of `repeats` runs
    after a warm-up (compilation excluded). Fields every configuration shares (e.g. none of
    the preset models has MLA) enter as constants, as in calibration
    (`validation._stack.constants_static`); `share_constants=False` maps every field."""

    specs = _random_specs(n, seed)
    if share_constants:
        specs = constants_static(specs)
    eff = default_efficiency()

    @eqx.filter_jit
    def run(specs):
        r = eqx.filter_vmap(lambda a, b, c: infer(a, b, c, eff))(*specs)
        return r.e2e_latency, r.ttft, r.tpot, r.feasible
    jax.block_until_ready(run(specs))
    best = np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(specs))
        best = min(best, time.perf_counter() - t0)
    return n / best
