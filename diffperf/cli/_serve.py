"""`diffperf serve`: one deployment under one traffic (the engine's scheduler simulated), or,
with `--slo`, the search for the deployments that meet latency targets."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys

import equinox as eqx
import jax
import numpy as np

from .. import presets
from ..calibrate._error_model import spec_descriptor
from ..calibrate._uncertainty import error_model_intervals
from ..plots import serving_front_plot
from ..presets import system
from ..serving import (
    Traffic,
    read_trace,
    requests as traffic_requests,
    serve,
    serve_disaggregated,
    trtllm_bench_engine_limits,
)
from ..serving._kv_dtype import keeps_model_dtype_kv
from ..serving._search import SLO_METRICS, parse_slo, slo_search
from ..serving._serve import eqx_replace
from ..specs import Engine, InferencePlan, weight_scale_block
from ..specs._engine import ENGINE_FIELDS
from ._common import (
    DEFAULT_INFER_GPU,
    _load_efficiency,
    _load_model,
    add_gpu_argument,
    add_model_argument,
    add_output_arguments,
    group,
)
from ._infer import add_attention_dp, add_precision_arguments, precisions_of
from ._runtime import add_runtime_argument, has_host_times, resolve_runtime

#: The engine preset that goes with each software-runtime preset (and the default pair).
ENGINE_OF_RUNTIME = {"vllm": "vllm", "sglang": "sglang", "trtllm": "trtllm"}
#: The software-runtime preset that goes with each engine preset (without --runtime): the
#: TensorRT engine of 0.14 is the calibration set's runtime (no CUDA graphs).
RUNTIME_OF_ENGINE = {"vllm": "vllm", "vllm-a100": "vllm", "sglang": "sglang",
                     "trtllm": "trtllm", "trtllm-0.14-triton": "megatron-core"}
#: `serve`'s default model: one that fits a single 80 GB GPU in bf16.
DEFAULT_SERVE_MODEL = "llama3-8b"
DEFAULT_ENGINE = "trtllm"


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `serve` sub-command."""
    p = subparsers.add_parser(
        "serve", help="serving under load: TTFT / TPOT percentiles, throughput, cost; --slo "
                      "searches deployments",
        description="Simulate an engine replica's scheduler (in-flight batching, chunked "
                    "prefill, KV-cache admission; docs/serving.md) serving a request stream, "
                    "each iteration's time from the inference cost model: TTFT, time per "
                    "output token and end-to-end latency at p50 / p90 / p99, throughput per "
                    "GPU, cost per million tokens and energy per token. With --slo: search "
                    "tensor parallelism, request slots and replicas for the fewest GPUs that "
                    f"meet the targets. Without --model / --gpu: {DEFAULT_SERVE_MODEL} on "
                    f"{DEFAULT_INFER_GPU}.")
    add_model_argument(p, DEFAULT_SERVE_MODEL)
    add_gpu_argument(p, DEFAULT_INFER_GPU)
    add_runtime_argument(p, what="Its host costs and CUDA graphs enter every iteration's time; "
                                 "it also picks the default --engine. serve's default: the "
                                 "runtime of the --engine (trtllm without either).")
    pl = group(p, "plan")
    pl.add_argument("--tp", type=int, default=1, help="tensor parallel degree (default 1)")
    pl.add_argument("--pp", type=int, default=1, help="pipeline parallel degree (default 1)")
    pl.add_argument("--ep", type=int, default=1, help="expert parallel degree within tp")
    add_attention_dp(pl)
    pl.add_argument("--replicas", type=int, default=1,
                    help="engine replicas; requests go round robin (default 1)")
    pl.add_argument("--disaggregated", default=None, metavar="xPyD",
                    help="disaggregated prefill / decode: x prefill and y decode replicas, "
                         "e.g. 2P1D (KV cache moved over NVLink within a domain, else RDMA)")
    pl.add_argument("--prefill-tp", type=int, default=None,
                    help="with --disaggregated: tp of a prefill replica (default --tp)")
    pl.add_argument("--decode-tp", type=int, default=None,
                    help="with --disaggregated: tp of a decode replica (default --tp)")
    add_precision_arguments(pl)
    e = group(p, "engine")
    e.add_argument("--engine", default=None, metavar="NAME",
                   help=f"scheduler preset: {', '.join(presets.engine_names())} (default: the "
                        f"one matching --runtime, else {DEFAULT_ENGINE})")
    e.add_argument("--trtllm-bench-limits", action="store_true",
                   help="size max_num_seqs and max_num_batched_tokens as `trtllm-bench "
                        "throughput` does when not given them: from the requests of the "
                        "traffic's mean lengths the KV cache holds (--max-num-seqs / "
                        "--max-num-batched-tokens still win)")
    e.add_argument("--max-num-seqs", type=int, default=None, help="request slots")
    e.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one iteration")
    e.add_argument("--chunked-prefill", choices=["on", "off"], default=None)
    e.add_argument("--policy", choices=["decode_first", "prefill_first"], default=None)
    e.add_argument("--block-size", type=int, default=None, help="KV-cache block, tokens")
    e.add_argument("--kv-memory-fraction", type=float, default=None,
                   help="share of the free HBM given to the KV cache")
    e.add_argument("--kv-output-reserve", type=float, default=None,
                   help="share of each request's remaining output held in the KV cache ahead "
                        "(1: reserved at admission, TensorRT-LLM; 0: allocated as the "
                        "context grows, vLLM; SGLang 0.098)")
    e.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV-cache tokens of a replica, set directly (an engine configured by "
                        "block count; overrides --kv-memory-fraction); default 0: from "
                        "--kv-memory-fraction")
    e.add_argument("--context-pass", choices=["on", "off"], default=None,
                   help="on: prompts run in a forward pass of their own before each "
                        "iteration's decode pass (FasterTransformer / LMDeploy TurboMind "
                        "v0.1); off (every preset): one mixed pass")
    t = group(p, "traffic")
    t.add_argument("--rate", type=float, default=None,
                   help="Poisson arrivals, requests/s (default: every request at t = 0, the "
                        "offline maximum-throughput benchmark)")
    t.add_argument("--concurrency", type=int, default=0,
                   help="closed loop with this many clients (instead of --rate)")
    t.add_argument("--trace", default=None, metavar="FILE.csv",
                   help="requests from a CSV with arrival (s), input_len, output_len")
    t.add_argument("--num-requests", type=int, default=1000, help="requests (default 1000)")
    t.add_argument("--input", type=int, default=1024, help="mean prompt tokens (1024)")
    t.add_argument("--output", type=int, default=256, help="mean output tokens (256)")
    t.add_argument("--input-spread", type=float, default=0.0,
                   help="standard deviation (normal) or range ratio (uniform) of prompts")
    t.add_argument("--output-spread", type=float, default=0.0)
    t.add_argument("--distribution", choices=["fixed", "normal", "uniform"], default="fixed")
    t.add_argument("--seed", type=int, default=0)
    c = group(p, "cost")
    c.add_argument("--price-per-hour", type=float, default=None,
                   help="USD per GPU-hour (default: the GPU's preset price)")
    c.add_argument("--power", dest="gpu_power", default=None, metavar="IDLE,MAX",
                   help="GPU power at idle and busy, W (default: the GPU's preset)")
    c.add_argument("--goodput", default=None, metavar="TTFT,TPOT",
                   help="per-request targets in s, e.g. 0.5,0.05: report the goodput, the "
                        "requests/s whose own TTFT and TPOT both meet them")
    c.add_argument("--interval", action="store_true",
                   help="also print 90%% intervals of TTFT, TPOT, the median inter-token gap "
                        "and output tokens/s from the calibration's error model, and what "
                        "widens them")
    s = group(p, "search")
    s.add_argument("--slo", default=None, metavar="METRIC=SECONDS,...",
                   help=f"search deployments meeting these targets ({', '.join(SLO_METRICS)}), "
                        "e.g. ttft_p90=0.5,tpot_p90=0.05")
    s.add_argument("--max-gpus", type=int, default=64,
                   help="search: largest deployment, GPUs (default 64)")
    s.add_argument("--aggregated-only", action="store_true",
                   help="search: leave out disaggregated (xPyD) deployments")
    add_output_arguments(p, plot="with --slo: save the throughput-latency front to this file")
    p.set_defaults(func=run_serve)
    return p


def _engine(args, runtime_name: str) -> tuple[str, Engine]:
    name = args.engine or ENGINE_OF_RUNTIME.get(runtime_name, DEFAULT_ENGINE)
    base = presets.engine(name)
    fields = {k: getattr(base, k) for k in ENGINE_FIELDS}
    given = {"max_num_seqs": args.max_num_seqs,
             "max_num_batched_tokens": args.max_num_batched_tokens,
             "chunked_prefill": None if args.chunked_prefill is None
             else float(args.chunked_prefill == "on"),
             "policy": args.policy, "block_size": args.block_size,
             "kv_memory_fraction": args.kv_memory_fraction,
             "kv_output_reserve": args.kv_output_reserve,
             "kv_cache_tokens": args.kv_cache_tokens,
             "context_pass": None if args.context_pass is None
             else float(args.context_pass == "on")}
    fields.update({k: v for k, v in given.items() if v is not None})
    return name, Engine(**fields)


def _engine_default_kv(args, engine_name: str, act: str, kv: str) -> str:
    """The KV-cache precision `serve` assumes: `--kv-precision` when given; bf16 where the
    engine preset keeps the model's dtype with fp8 / fp4 GEMMs (`keeps_model_dtype_kv`, said
    in a note); else `kv` (TensorRT-LLM follows its checkpoint, which `--precision` stands
    for)."""
    if args.kv_precision is None and keeps_model_dtype_kv(engine_name, act):
        if not args.json:
            print(f"note: KV cache in bf16: {engine_name}'s default --kv-cache-dtype auto keeps "
                  f"the model's dtype with {act} weights (--kv-precision fp8 for an fp8 "
                  "cache)", file=sys.stderr)
        return "bf16"
    return kv


def _trtllm_bench_engine(args, mdl, sys_, engine: Engine, traffic, weights: str,
                         kv: str) -> Engine:
    """`engine` with trtllm-bench's own max_num_seqs / max_num_batched_tokens
    (`diffperf.serving.trtllm_bench_engine_limits`) for the traffic's requests: their mean
    prompt and output lengths and the longest prompt, as trtllm-bench reads its dataset;
    the KV fraction is the engine's `kv_memory_fraction`. Explicit limits win."""
    _, inp, out = traffic_requests(traffic)
    chunked = bool(float(engine.chunked_prefill))
    bs, tokens = trtllm_bench_engine_limits(
        mdl, sys_.accelerator, tp=args.tp, pp=args.pp, weight_precision=weights,
        kv_precision=kv, isl=float(np.mean(inp)), osl=float(np.mean(out)),
        max_isl=float(np.max(inp)), kv_fraction=float(engine.kv_memory_fraction),
        chunked_prefill=chunked)
    sized = {"max_num_seqs": bs, "max_num_batched_tokens": tokens}
    explicit = {"max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens}
    print(f"note: trtllm-bench limits: max_batch_size {bs}, max_num_tokens {tokens} (from the "
          f"KV cache at {float(engine.kv_memory_fraction):g} of the memory left after the "
          f"weights and the traffic's mean lengths)", file=sys.stderr)
    return eqx_replace(engine, **{k: v for k, v in sized.items() if explicit[k] is None})


def _power(args) -> tuple[float, float]:
    if args.gpu_power is None:
        return presets.gpu_power(presets.system_gpu(args.gpu))
    try:
        idle, busy = (float(x) for x in args.gpu_power.split(","))
    except ValueError:
        raise ValueError(f"--power must be IDLE,MAX in W, got {args.gpu_power!r}") from None
    if not (0 <= idle <= busy and math.isfinite(busy)):
        raise ValueError(f"--power must be 0 <= IDLE <= MAX W, got {args.gpu_power!r}")
    return idle, busy


def _price(args) -> float:
    if args.price_per_hour is None:
        return presets.gpu_price_per_hour(presets.system_gpu(args.gpu))
    if not (args.price_per_hour >= 0 and math.isfinite(args.price_per_hour)):
        raise ValueError(f"--price-per-hour must be >= 0 USD, got {args.price_per_hour!r}")
    return args.price_per_hour


def _traffic(args):
    if args.trace:
        if args.concurrency:
            raise ValueError("--trace and --concurrency exclude each other")
        return read_trace(args.trace)
    rate = math.inf if args.rate is None else args.rate
    if args.concurrency and args.rate is not None:
        raise ValueError("--rate and --concurrency exclude each other (a closed loop sends "
                         "the next request when one finishes)")
    return Traffic(rate=rate, num_requests=args.num_requests, input_len=args.input,
                   output_len=args.output, input_spread=args.input_spread,
                   output_spread=args.output_spread, distribution=args.distribution,
                   concurrency=args.concurrency, seed=args.seed)


def _ms(x) -> float:
    return round(1e3 * float(x), 3)


def summary(rep) -> dict:
    """The report as a JSON-ready dict (times in ms, throughput in tokens/s)."""
    lat = lambda v: {k: _ms(getattr(v, k)) for k in ("mean", "p50", "p90", "p99")}
    return {"ttft_ms": lat(rep.ttft), "tpot_ms": lat(rep.tpot), "itl_ms": lat(rep.itl),
            "itl_mean_ms": _ms(rep.itl_mean), "e2e_ms": lat(rep.e2e),
            "queue_ms": lat(rep.queue), "output_tok_s": float(rep.output_tok_s),
            "output_tok_s_per_gpu": float(rep.output_tok_s_per_gpu),
            "total_tok_s": float(rep.total_tok_s), "request_rate": float(rep.request_rate),
            "duration_s": float(rep.duration), "busy_share": float(rep.busy_share),
            "mean_batch_tokens": float(rep.mean_batch_tokens),
            "iterations": float(rep.iterations), "kv_capacity_tokens": float(rep.kv_capacity),
            "kv_peak_share": float(rep.kv_peak_share),
            "replicas": float(rep.replicas), "num_gpus": float(rep.num_gpus),
            "cost_per_million_tokens_usd": float(rep.cost_per_million_tokens),
            "energy_per_token_j": float(rep.energy_per_token),
            "ttft_growth_ms": _ms(rep.ttft_growth),
            "goodput_rps": float(rep.goodput), "slo_attainment": float(rep.slo_attainment)}


def _check_options(args) -> None:
    """One-line errors naming the option for values the command cannot use."""
    for k in ("tp", "pp", "ep", "replicas", "num_requests", "input", "output", "max_gpus",
              "max_num_seqs", "max_num_batched_tokens", "block_size", "prefill_tp",
              "decode_tp"):
        v = getattr(args, k)
        if v is not None and v < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be a whole number >= 1, got {v}")
    for k in ("concurrency", "seed", "input_spread", "output_spread"):
        v = getattr(args, k)
        if v < 0:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 0, got {v}")
    if args.rate is not None and not args.rate > 0:
        raise ValueError(f"--rate must be > 0 requests/s, got {args.rate}")
    f = args.kv_memory_fraction
    if f is not None and not 0 < f <= 1:
        raise ValueError(f"--kv-memory-fraction must be in (0, 1], got {f}")
    r = args.kv_output_reserve
    if r is not None and not 0 <= r <= 1:
        raise ValueError(f"--kv-output-reserve must be in [0, 1], got {r}")
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < 0:
        raise ValueError(f"--kv-cache-tokens must be >= 0, got {args.kv_cache_tokens}")


def run_serve(args) -> int:
    """Run `diffperf serve`; returns the exit status (0 ok, 2 bad input)."""
    try:
        _check_options(args)
        if args.slo and args.disaggregated:
            raise ValueError("--slo searches aggregated and disaggregated deployments itself; "
                             "drop --disaggregated")
        if args.aggregated_only and not args.slo:
            raise ValueError("--aggregated-only goes with --slo")
        if args.runtime is None and args.engine:
            args.runtime = RUNTIME_OF_ENGINE.get(args.engine.lower())
        if args.runtime is None:
            args.runtime = RUNTIME_OF_ENGINE[DEFAULT_ENGINE]
        choice = resolve_runtime(args, None)
        engine_name, engine = _engine(args, choice.name)
        mdl = _load_model(args.model)
        sys_ = system(args.gpu)
        weights, act, kv = precisions_of(args)
        kv = _engine_default_kv(args, engine_name, act, kv)
        plan = InferencePlan(tp=args.tp, pp=args.pp, ep=args.ep, weight_precision=weights,
                             weight_scale_block=weight_scale_block(args.precision),
                             activation_precision=act, kv_precision=kv,
                             attention_dp=1 if args.attention_dp else 0,
                             gemm_peak_fraction=args.gemm_peak_fraction)
        if args.attention_dp and (args.slo or args.disaggregated):
            raise ValueError("--attention-dp: not supported with "
                             f"{'--slo' if args.slo else '--disaggregated'} yet (the sizing "
                             "search and the xPyD pools split traffic per replica, not per "
                             "attention rank)")
        eff = _load_efficiency(None, args.gpu)
        traffic = _traffic(args)
        if args.trtllm_bench_limits:
            engine = _trtllm_bench_engine(args, mdl, sys_, engine, traffic, weights, kv)
        price, power = _price(args), _power(args)
        if args.slo:
            return _run_search(args, mdl, sys_, plan, engine, eff, choice, traffic, price,
                               power)
        if args.disaggregated:
            return _run_disaggregated(args, mdl, sys_, plan, engine, engine_name, eff, choice,
                                      traffic, price, power)
        targets = _goodput_targets(args.goodput)
        rep = jax.device_get(serve(mdl, sys_, plan, engine, traffic, eff, choice.runtime,
                                   replicas=args.replicas, price_per_hour=price,
                                   power=power, ttft_target=targets[0],
                                   tpot_target=targets[1]))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.trace and args.num_requests % args.replicas:
        print(f"note: {args.num_requests % args.replicas} of the {args.num_requests} requests "
              f"left out, so that each of the {args.replicas} replicas serves as many",
              file=sys.stderr)
    out = summary(rep)
    out["engine"] = {"preset": engine_name,
                     **{k: float(getattr(engine, k)) for k in ENGINE_FIELDS}}
    out["runtime"] = choice.name
    out["host_time_factor"] = float(sys_.accelerator.host_time_factor)
    out["price_per_gpu_hour_usd"], out["power_w"] = price, list(power)
    if args.rate is not None and out["ttft_growth_ms"] > max(
            1000.0, 0.5 * out["ttft_ms"]["p50"]) and out["busy_share"] > 0.95:
        print(f"note: the backlog grows over the run (the last quarter of the requests wait "
              f"{out['ttft_growth_ms'] / 1e3:.1f} s longer for their first token than the "
              f"first quarter): "
              f"{args.rate:g} req/s is more than this deployment sustains (it completed "
              f"{out['request_rate']:.2f} req/s), so its latencies grow with --num-requests",
              file=sys.stderr)
    if out["kv_peak_share"] > 1.0:
        print(f"note: the running requests' contexts reach {100 * out['kv_peak_share']:.0f} % "
              f"of the KV cache: the engine allocates blocks as contexts grow "
              f"(kv_output_reserve {out['engine']['kv_output_reserve']:g}) and would preempt "
              "requests, which is not modelled (latencies optimistic at this load)",
              file=sys.stderr)
    if args.interval:
        out["intervals"] = _intervals(out, mdl, sys_, plan, args.gpu, engine_name,
                                      _load_of(args))
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    where = f"{args.model} on {args.replicas} x {args.tp * args.pp} {args.gpu}"
    load = (f"trace {args.trace}" if args.trace else
            f"closed loop, {args.concurrency} clients" if args.concurrency else
            f"{'all at once' if args.rate is None else f'{args.rate:g} req/s Poisson'}")
    parallel = (f"tp={args.tp}, pp={args.pp}" + (f", ep={args.ep}" if args.ep != 1 else "")
                + (f", attention DP: {args.tp} ranks, max_num_seqs each" if args.attention_dp
                   else ""))
    print(f"{where} ({parallel}), engine {engine_name} "
          f"(max_num_seqs {out['engine']['max_num_seqs']:g}, budget "
          f"{out['engine']['max_num_batched_tokens']:g} tokens"
          + (", prompts in a context pass of their own" if out["engine"]["context_pass"] else "")
          + f"), runtime {choice.name}"
          + (f" (host CPU times x{out['host_time_factor']:g}: host_time_factor, this GPU's "
             f"host CPU against a DGX H100's x86 host)"
             if out["host_time_factor"] != 1.0 and has_host_times(choice.runtime) else ""))
    if not args.trace:
        print(f"traffic: {args.num_requests} requests, {load}, input {args.input:g} / output "
              f"{args.output:g} tokens ({args.distribution})")
    print(f"\n{'':16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}  ms")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "inter-token"),
                       ("e2e_ms", "end-to-end"), ("queue_ms", "queueing")):
        v = out[key]
        print(f"{label:16}" + "".join(f"{v[k]:>10.1f}" for k in ("mean", "p50", "p90", "p99")))
    print(f"\noutput {out['output_tok_s']:,.0f} tokens/s "
          f"({out['output_tok_s_per_gpu']:,.0f} per GPU), {out['request_rate']:.2f} requests/s")
    print(f"engine busy {100 * out['busy_share']:.0f} % of the time, "
          f"{out['mean_batch_tokens']:.0f} tokens per iteration on average; KV cache "
          f"{out['kv_capacity_tokens']:,.0f} tokens per replica"
          + (" (--kv-cache-tokens)" if out["engine"]["kv_cache_tokens"] else ""))
    if args.goodput:
        print(f"goodput {out['goodput_rps']:.2f} requests/s: {100 * out['slo_attainment']:.1f} % "
              f"of the requests meet TTFT <= {targets[0]:g} s and TPOT <= {targets[1]:g} s")
    print(f"cost ${out['cost_per_million_tokens_usd']:.3f} per million output tokens at "
          f"${price:g}/GPU-h; energy {out['energy_per_token_j']:.3f} J per output token "
          f"({power[0]:g}-{power[1]:g} W per GPU)")
    if args.interval:
        _print_intervals(out["intervals"])
    return 0


#: Served quantities given intervals: (key in `summary`, sub-key, label, unit, error-model
#: quantity).
_INTERVAL_FIELDS = (("ttft_ms", "p50", "TTFT p50", "ms", "serve_ttft"),
                    ("ttft_ms", "p90", "TTFT p90", "ms", "serve_ttft"),
                    ("tpot_ms", "p50", "TPOT p50", "ms", "serve_token_latency"),
                    ("tpot_ms", "p90", "TPOT p90", "ms", "serve_token_latency"),
                    ("itl_ms", "p50", "ITL p50", "ms", "serve_token_latency"),
                    ("output_tok_s", None, "output tokens/s", "tokens/s", "serve_throughput"))


def _load_of(args) -> str:
    """The error model's traffic class of the command line: "closed" (--concurrency),
    "online" (--rate or --trace), "offline" (every request at once)."""
    if args.concurrency:
        return "closed"
    return "online" if (args.rate is not None or args.trace) else "offline"


def _intervals(out: dict, mdl, sys_, plan, gpu: str, engine_name: str, load: str) -> dict:
    """90 % intervals of the headline served quantities from the shipped error model
    (`error_model_intervals`), keyed like `_INTERVAL_FIELDS`' labels."""
    values, described = {}, {}
    for key, sub, label, _, quantity in _INTERVAL_FIELDS:
        values[label] = out[key][sub] if sub else out[key]
        described[label] = spec_descriptor(mdl, sys_, plan, quantity, gpu, engine_name,
                                           load=load)
    iv = error_model_intervals(values, described)
    if "error" not in iv:
        iv["basis"] = ("the error model's serving scale, fitted on published mean / median "
                       "TTFT, ITL / TPOT and throughput under load; p90 read with the same "
                       "scale")
    return iv


def _print_intervals(iv: dict) -> None:
    if "error" in iv:
        print(f"no intervals: {iv['error']}")
        return
    print(f"\n{iv['level']:.0%} intervals:")
    for _, _, label, unit, _ in _INTERVAL_FIELDS:
        v = iv[label]
        print(f"  {label:16} {v['value']:>10.4g}  ({v['low']:.4g} to {v['high']:.4g} {unit})")
    if iv["why"]:
        print("  wider than a calibrated configuration's: " + "; ".join(iv["why"]))


def _run_search(args, mdl, sys_, plan, engine, eff, choice, traffic, price, power) -> int:
    if not isinstance(traffic, Traffic):
        raise ValueError("--slo searches with --rate or --concurrency traffic, not --trace")
    slo = parse_slo(args.slo)
    result = slo_search(mdl, sys_, plan, engine, traffic, slo, eff, choice.runtime,
                        max_gpus=args.max_gpus, price_per_hour=price, power=power,
                        log=lambda m: print(m, file=sys.stderr),
                        disaggregated=not args.aggregated_only)
    if args.plot:
        serving_front_plot(result, args.plot, f"{args.model} on {args.gpu}")
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    best = result["best"]
    if best is None:
        print(f"no deployment of at most {args.max_gpus} GPUs meets {args.slo}")
        return 1
    if result.get("note"):
        print(result["note"])
    print(f"\nfewest GPUs meeting {args.slo}: {best['num_gpus']:g} ({deployment_label(best)}), "
          f"TTFT p90 {best['ttft_p90_ms']:.0f} ms, TPOT p90 {best['tpot_p90_ms']:.1f} ms, "
          f"{best['output_tok_s_per_gpu']:,.0f} tokens/s per GPU, "
          f"${best['cost_per_million_tokens_usd']:.3f} per million tokens")
    if best.get("coupled"):
        c = best["coupled"]
        print("  checked by the coupled xPyD simulation (round-robin routing): "
              + ", ".join(f"{k[:-3].replace('_', ' ')} {v:.1f} ms" for k, v in c.items()
                          if k.endswith("_ms")))
    return 0


def deployment_label(row: dict) -> str:
    """`"2 x tp 1, max_num_seqs 64"` or `"1P1D: prefill 1 x tp 2, decode 1 x tp 1, 64 slots"`
    for a row of `slo_search`."""
    if row.get("mode") == "disaggregated":
        return (f"{row['prefill_replicas']:g}P{row['decode_replicas']:g}D: prefill "
                f"{row['prefill_replicas']:g} x tp {row['prefill_tp']:g}, decode "
                f"{row['decode_replicas']:g} x tp {row['decode_tp']:g}, max_num_seqs "
                f"{row['max_num_seqs']:g}")
    return f"{row['replicas']:g} x tp {row['tp']:g}, max_num_seqs {row['max_num_seqs']:g}"


def _goodput_targets(text) -> tuple[float, float]:
    """`--goodput TTFT,TPOT` in s (both > 0), or (inf, inf) without the option."""
    if text is None:
        return math.inf, math.inf
    try:
        ttft, tpot = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--goodput must be TTFT,TPOT in s (e.g. 0.5,0.05), got {text!r}"
                         ) from None
    if not (0 < ttft < math.inf and 0 < tpot < math.inf):
        raise ValueError(f"--goodput targets must be > 0 s and finite, got {text!r}")
    return ttft, tpot


def parse_xpyd(text: str) -> tuple[int, int]:
    """`"2P1D"` -> (2, 1); one-line error naming --disaggregated otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*[pP]\s*(\d+)\s*[dD]\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"--disaggregated must be xPyD with x, y >= 1 (e.g. 2P1D), got "
                         f"{text!r}")
    return int(m.group(1)), int(m.group(2))


def _run_disaggregated(args, mdl, sys_, plan, engine, engine_name, eff, choice, traffic,
                       price, power) -> int:

    x, y = parse_xpyd(args.disaggregated)
    tp_of = lambda v: eqx.tree_at(lambda q: q.tp, plan, jax.numpy.asarray(float(v)))
    pre, dec = tp_of(args.prefill_tp or args.tp), tp_of(args.decode_tp or args.tp)
    out = serve_disaggregated(mdl, sys_, pre, dec, engine, engine, traffic, x, y, eff,
                              choice.runtime, price_per_hour=price, power=power)
    rep = jax.device_get(out["report"])
    s = summary(rep)
    s.update({"disaggregated": {"prefill_replicas": x, "decode_replicas": y,
                                "prefill_tp": float(pre.tp), "decode_tp": float(dec.tp),
                                "kv_transfer_ms": round(1e3 * out["kv_transfer_s"], 4),
                                "link": out["link"], "prefill_busy": out["prefill_busy"],
                                "decode_busy": out["decode_busy"],
                                "requests_simulated": out["requests"]},
              "engine": engine_name, "runtime": choice.name})
    if args.json:
        print(json.dumps(s, indent=1))
        return 0
    d = s["disaggregated"]
    print(f"{args.model} on {args.gpu}: {x}P{y}D, prefill tp {d['prefill_tp']:g}, decode tp "
          f"{d['decode_tp']:g} ({s['num_gpus']:g} GPUs), engine {engine_name}")
    print(f"\n{'':16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}  ms")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "inter-token"),
                       ("e2e_ms", "end-to-end")):
        v = s[key]
        print(f"{label:16}" + "".join(f"{v[k]:>10.1f}" for k in ("mean", "p50", "p90", "p99")))
    print(f"\noutput {s['output_tok_s']:,.0f} tokens/s ({s['output_tok_s_per_gpu']:,.0f} per "
          f"GPU); KV transfer {d['kv_transfer_ms']:.2f} ms per request over {d['link']}; "
          f"prefill pool busy {100 * d['prefill_busy']:.0f} %, decode pool "
          f"{100 * d['decode_busy']:.0f} %; ${s['cost_per_million_tokens_usd']:.3f} per million "
          f"output tokens")
    if d["requests_simulated"] < args.num_requests:
        print(f"note: {d['requests_simulated']} of the requests simulated (a whole number per "
              f"replica in each pool)", file=sys.stderr)
    return 0
