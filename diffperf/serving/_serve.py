"""`serve`: one deployment (replicas of one engine) under one request stream."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..feasibility import explain
from ..inference import infer
from ..inference._iteration import iteration_cost
from ..presets import resolve_efficiency
from ..specs._efficiency import Efficiency
from ..specs._engine import Engine
from ..specs._hardware import System
from ..specs._inference_plan import InferencePlan
from ..specs._runtime import Runtime
from ..specs._transformer import Transformer
from ._capacity import replica_kv_tokens
from ._report import ServingReport, report
from ._simulate import Requests, reservation, simulate, split_times, step_bound
from ._traffic import Traffic, requests as traffic_requests


def stream_arrays(traffic) -> tuple:
    """`(arrival s, input_len, output_len, concurrency)` of a `Traffic` or of a trace's
    `(arrival, input_len, output_len)` arrays (concurrency 0: open loop)."""
    if isinstance(traffic, Traffic):
        return (*traffic_requests(traffic), traffic.concurrency)
    return (*(np.asarray(a, float) for a in traffic), 0)


def _stream(traffic, replicas: int):
    arrival, inp, out, concurrency = stream_arrays(traffic)
    # round robin over alike replicas: replica 0 gets requests 0, R, 2R, ... of the first
    # N - N mod R (so that it serves exactly 1 / R of the stream)
    if len(arrival) < replicas:
        raise ValueError(f"{len(arrival)} requests cannot feed {replicas} replicas "
                         f"(give at least one request per replica)")
    n = len(arrival) // replicas * replicas
    if concurrency:
        concurrency = max(1, math.ceil(concurrency / replicas))
    pick = slice(0, n, replicas)
    return arrival[pick], inp[pick], out[pick], concurrency


@jax.jit
def _cost_and_capacity(model, system, plan, engine, eff, runtime):
    cost = iteration_cost(model, system, plan, engine.max_num_batched_tokens, eff, runtime,
                          engine.max_num_seqs)
    kv = replica_kv_tokens(model, system, plan, engine, eff)
    return cost, kv


def serve(model: Transformer, system: System, plan: InferencePlan, engine: Engine, traffic,
          efficiency: Efficiency | None = None, runtime: Runtime | None = None,
          replicas: int = 1, price_per_hour: float = 0.0, power=(0.0, 0.0),
          fast_forward: bool = True, ttft_target: float = math.inf,
          tpot_target: float = math.inf) -> ServingReport:
    """Predict serving `traffic` with `replicas` replicas of an engine running `plan` (its tp,
    pp, ep and precisions; `plan.batch` is not used: the engine's scheduler decides the
    batch of every iteration).

    **Arguments:**

    - `traffic`: a `Traffic`, or `(arrival s, input_len, output_len)` arrays (a trace).
    - `engine`: the scheduler (`diffperf.presets.engine` for the engines' defaults).
    - `replicas`: alike engine replicas; requests go round robin, so each replica serves every
      R-th request (a closed loop's clients are split evenly); the simulated replica stands
      for all. The last N mod R requests of the stream are left out, so that the replica
      serves exactly 1 / R of it. With `plan.attention_dp` each of a replica's tp attention
      ranks schedules its own requests (TensorRT-LLM's and SGLang's attention-DP schedulers,
      `max_num_seqs` per rank): the stream is split over replicas x tp ranks, and the
      simulated rank's iterations cost what one rank's share of the synchronised MoE layers
      costs (`diffperf.inference.iteration_cost`, all ranks assumed equally loaded).
    - `price_per_hour`: USD per GPU-hour (0: no cost reported); `power`: (idle, max) W per GPU.
    - `ttft_target`, `tpot_target`: per-request targets of the report's goodput, s.

    Raises ValueError (one line, naming the field) for a plan that is infeasible, a request
    that can never be admitted, or a prompt longer than the budget without chunked prefill.
    """
    eff = resolve_efficiency(efficiency)
    runtime = Runtime() if runtime is None else runtime
    if not (isinstance(replicas, int) and replicas >= 1):
        raise ValueError(f"replicas must be a whole number >= 1, got {replicas!r}")
    s_max = int(np.max(np.asarray(engine.max_num_seqs)))
    budget = float(np.min(np.asarray(engine.max_num_batched_tokens)))
    if budget < s_max:
        raise ValueError(f"Engine.max_num_batched_tokens ({budget:g}) must be at least "
                         f"max_num_seqs ({s_max})")
    ranks = int(round(float(plan.attention_ranks)))  # schedulers per replica
    arrival, inp, out, concurrency = _stream(traffic, replicas * ranks)
    typical = eqx_replace(plan, batch=1.0, input_len=float(np.round(np.mean(inp))),
                          output_len=float(np.round(np.mean(out))))
    check = infer(model, system, eqx_replace(typical, batch=1.0), eff, runtime)
    if not bool(check.feasible):
        reason = int(check.reason)
        hint = ("; try a larger tp (or narrower --precision)" if reason == 10 else "")
        raise ValueError(f"plan infeasible (tp={float(plan.tp):g}): {explain(reason)}{hint}")
    cost, kv = _cost_and_capacity(model, system, typical, engine, eff, runtime)
    set_tokens = float(np.asarray(engine.kv_cache_tokens))
    if set_tokens > 0 and float(kv) == 0:  # `replica_kv_tokens`: a set cache that does not fit
        raise ValueError(f"Engine.kv_cache_tokens {set_tokens:g} does not fit beside the "
                         f"weights on one GPU ({float(system.accelerator.hbm_capacity) / 1e9:g} "
                         f"GB of HBM)")
    res = np.asarray(reservation(engine, inp, out))
    if res.max() > float(kv):
        i = int(np.argmax(res))
        raise ValueError(f"request {i * replicas * ranks} needs {res[i]:g} KV-cache tokens "
                         f"({inp[i]:g} in + {out[i]:g} out), more than a replica holds "
                         f"({float(kv):g} tokens): it can never be admitted")
    if float(np.asarray(engine.chunked_prefill)) == 0 and inp.max() > budget:
        raise ValueError(f"input_len {inp.max():g} exceeds Engine.max_num_batched_tokens "
                         f"({budget:g}) and chunked_prefill is off")
    hi, lo = split_times(arrival)
    req = Requests(jnp.asarray(hi, jnp.result_type(float)),
                   jnp.asarray(inp, jnp.result_type(float)),
                   jnp.asarray(out, jnp.result_type(float)),
                   jnp.asarray(lo, jnp.result_type(float)))
    steps = step_bound(inp, engine)
    schedule = _simulate_jit(cost, engine, kv, req, s_max, steps, float(concurrency),
                             fast_forward)
    if not bool(schedule.completed):
        raise RuntimeError(f"the simulation did not finish within {steps} steps "
                           "(a bug: please report it with the command)")
    summary = report(schedule, inp, out, kv, replicas * ranks, plan.num_gpus / ranks,
                     price_per_hour, power[0], power[1], ttft_target, tpot_target)
    # a replica of attention-DP ranks: its replicas count and KV cache are those of all ranks
    return eqx.tree_at(lambda r: (r.replicas, r.kv_capacity), summary,
                       (summary.replicas / ranks, summary.kv_capacity * ranks))


_simulate_jit = jax.jit(simulate, static_argnums=(4, 5, 7))


def eqx_replace(plan: InferencePlan, **fields) -> InferencePlan:
    """`plan` with `fields` replaced (values as floats)."""
    names = tuple(fields)
    return eqx.tree_at(lambda p: tuple(getattr(p, k) for k in names), plan,
                       tuple(jnp.asarray(v, jnp.result_type(float)) for v in fields.values()))
