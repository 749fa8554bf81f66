"""Disaggregated serving (xPyD): x prefill replicas and y decode replicas, each pool with its own
parallelism and scheduler, the KV cache of every prompt moved from one to the other.

1. Prefill pool. Requests go round robin to the x prefill replicas (replica r: requests r,
   r + x, ...; `N` rounded down to a multiple of x so that every replica has as many); each
   replica is simulated (`simulate`, vmapped over the replicas) with one output token per
   request: a request's first token comes out when its prompt is complete (TTFT).
2. KV transfer. The prompt's KV cache, `input_len x kv_bytes_per_token x tp_prefill` bytes
   (every layer, every head), moves from the prefill replica's tp GPUs to the decode
   replica's, each GPU pair over its own link: one link latency plus bytes / (min(tp_prefill,
   tp_decode) x link bandwidth), NVLink when both pools fit in one NVLink domain, else the
   scale-out network (RDMA). Transfers do not contend with each other (a lower bound where
   many prompts move at once).
3. Decode pool. The requests arrive, in the order their transfers end, round robin over the y
   decode replicas, with their prompt in the KV cache (`simulate(..., prefilled=True)`):
   admitted FCFS while the cache holds their whole context, each decodes its remaining
   tokens. Requests with one output token end in step 1.

Per request: TTFT = prefill pool's first token - arrival; end-to-end = decode finish - arrival;
TPOT = (decode finish - first token) / (output - 1), which includes the transfer and the wait
for a decode slot.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..feasibility import explain
from ..inference import infer
from ..inference._iteration import iteration_cost, kv_bytes_per_token
from ..presets import resolve_efficiency
from ..specs._engine import Engine
from ..specs._runtime import Runtime
from ._capacity import replica_kv_tokens
from ._report import report
from ._serve import eqx_replace, stream_arrays
from ._simulate import GAP_BINS, Requests, Schedule, reservation, simulate, split_times, step_bound

_f32 = lambda a: jnp.asarray(a, jnp.result_type(float))  # noqa: E731


def _gaps(decode, field: str) -> jax.Array:
    """The decode pool's inter-token gap bins, summed over its replicas (zeros without one).
    A request's first gap there runs from its admission to the decode pool (the prefilled
    first token), not from the prefill pool's first token: the KV transfer and the wait for
    a decode slot are not in the bins (they are in TTFT and TPOT)."""
    if decode is None:
        return _f32(np.zeros(GAP_BINS))
    return _f32(np.asarray(getattr(decode, field)).sum(axis=0))


def kv_transfer_time(model, system, prefill_plan, decode_plan, input_len, same_domain
                     ) -> jax.Array:
    """Seconds to move a prompt's KV cache from a prefill replica to a decode replica (module
    docstring, step 2)."""
    net = system.network
    nbytes = input_len * kv_bytes_per_token(model, prefill_plan) * prefill_plan.tp
    links = jnp.minimum(prefill_plan.tp, decode_plan.tp)
    nvlink = net.nvlink_latency + nbytes / (links * net.nvlink_bandwidth)
    rdma = net.scaleout_latency + nbytes / (links * net.scaleout_bandwidth)
    return jnp.where(same_domain, nvlink, rdma)


def _pool(model, system, plan, engine, eff, runtime, typical):
    p = eqx_replace(plan, batch=1.0, **typical)
    check = infer(model, system, p, eff, runtime)
    if not bool(check.feasible):
        raise ValueError(f"plan infeasible (tp={float(plan.tp):g}): "
                         f"{explain(int(check.reason))}")
    cost = iteration_cost(model, system, p, engine.max_num_batched_tokens, eff, runtime,
                          engine.max_num_seqs)
    kv = replica_kv_tokens(model, system, p, engine, eff)
    return p, cost, kv


def _replicas(cost, engine, kv, arrival, inp, out, x: int, concurrency: int, prefilled: bool
              ) -> Schedule:
    """Simulate x alike replicas, replica r on requests r, r + x, ... (vmapped)."""
    n = len(arrival) // x * x
    shape = lambda a: _f32(np.asarray(a[:n]).reshape(n // x, x).T)
    hi, lo = split_times(arrival[:n])
    req = Requests(shape(hi), shape(inp), shape(out), shape(lo))
    steps = step_bound(np.asarray(inp[:n // x]), engine)
    slots = int(np.max(np.asarray(engine.max_num_seqs)))
    conc = float(max(1, -(-concurrency // x))) if concurrency else 0.0
    run = jax.jit(jax.vmap(lambda r: simulate(cost, engine, kv, r, slots, steps, conc,
                                              prefilled=prefilled)))
    return run(req)


def serve_disaggregated(model, system, prefill_plan, decode_plan, prefill_engine: Engine,
                        decode_engine: Engine, traffic, prefill_replicas: int,
                        decode_replicas: int, efficiency=None, runtime: Runtime | None = None,
                        price_per_hour: float = 0.0, power=(0.0, 0.0)) -> dict:
    """Predict xPyD serving of `traffic` (module docstring). Returns `{"report":
    ServingReport of the whole deployment, "kv_transfer_s": mean transfer time, "prefill_busy",
    "decode_busy": each pool's busy share, "requests": requests simulated}`."""
    for name, pl in (("prefill_plan", prefill_plan), ("decode_plan", decode_plan)):
        if float(np.max(np.asarray(pl.attention_dp))) > 0:
            raise ValueError(f"{name}.attention_dp: not supported in disaggregated serving yet "
                             "(its pools split traffic per replica, not per attention rank)")
    eff = resolve_efficiency(efficiency)
    runtime = Runtime() if runtime is None else runtime
    x, y = prefill_replicas, decode_replicas
    for name, v in (("prefill replicas", x), ("decode replicas", y)):
        if not (isinstance(v, int) and v >= 1):
            raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
    arrival, inp, out, concurrency = stream_arrays(traffic)
    if concurrency:
        raise ValueError("disaggregated serving is simulated for open-loop traffic (--rate or a "
                         "trace), not a closed loop")
    if len(arrival) < max(x, y):
        raise ValueError(f"{len(arrival)} requests cannot feed {max(x, y)} replicas")
    typical = dict(input_len=float(np.round(inp.mean())), output_len=float(np.round(out.mean())))
    pp, pcost, pkv = _pool(model, system, prefill_plan, prefill_engine, eff, runtime, typical)
    dp, dcost, dkv = _pool(model, system, decode_plan, decode_engine, eff, runtime, typical)
    for pool, kv, engine, extra in (("prefill", pkv, prefill_engine, 1.0),
                                    ("decode", dkv, decode_engine, out)):
        need = float(np.max(np.asarray(reservation(engine, inp, extra))))
        if need > float(kv):
            raise ValueError(f"the {pool} pool's KV cache ({float(kv):g} tokens per replica) "
                             f"cannot hold a request of {need:g} tokens")
    # 1. prefill pool: one token per request
    pre = jax.device_get(_replicas(pcost, prefill_engine, pkv, arrival, inp,
                                   np.ones_like(out), x, 0, False))
    n = pre.first_token.size
    order = np.arange(n).reshape(n // x, x).T.ravel()  # request index of each simulated slot
    first = np.empty(n)
    first[order] = arrival[order] + np.asarray(pre.ttft, float).ravel()
    admit = np.empty(n)
    admit[order] = arrival[order] + np.asarray(pre.queue, float).ravel()  # prefill pool
    arrival, inp, out = arrival[:n], inp[:n], out[:n]
    # 2. KV transfer
    gp = x * float(prefill_plan.tp * prefill_plan.pp)
    gd = y * float(decode_plan.tp * decode_plan.pp)
    same = gp + gd <= float(system.network.nvlink_domain)
    transfer = np.asarray(kv_transfer_time(model, system, pp, dp, _f32(inp), same))
    ready = first + transfer
    # 3. decode pool, requests with more than one token, in the order they are ready
    many = np.flatnonzero(out > 1)
    by_ready = many[np.argsort(ready[many], kind="stable")]
    finish = first.copy()  # one-token requests end at their first token
    m = len(by_ready) // y * y
    dec = None
    if m:
        ids = by_ready[:m]
        dec = jax.device_get(_replicas(dcost, decode_engine, dkv, ready[ids], inp[ids],
                                       out[ids], y, 0, True))
        slot_ids = ids.reshape(m // y, y).T.ravel()
        finish[slot_ids] = ready[slot_ids] + np.asarray(dec.e2e, float).ravel()
        keep = np.concatenate([np.flatnonzero(out <= 1), slot_ids])
    else:
        keep = np.flatnonzero(out <= 1)
    keep = np.sort(keep)
    pools = [s for s in (pre, dec) if s is not None]
    iterations = sum(float(np.sum(np.asarray(s.iterations))) for s in pools)
    tokens = sum(float(np.sum(np.asarray(s.iterations) * np.asarray(s.mean_tokens)))
                 for s in pools)
    sched = Schedule(arrival=_f32(arrival[keep]), admit=_f32(admit[keep]),
                     first_token=_f32(first[keep]), finish=_f32(finish[keep]),
                     queue=_f32(admit[keep] - arrival[keep]),
                     ttft=_f32(first[keep] - arrival[keep]),
                     e2e=_f32(finish[keep] - arrival[keep]),
                     completed=_f32(float(np.all(np.asarray(pre.completed)))
                                    * float(dec is None or np.all(np.asarray(dec.completed)))),
                     steps=jnp.asarray(0), iterations=_f32(iterations),
                     busy_time=_f32(0.0), mean_tokens=_f32(tokens / max(iterations, 1.0)),
                     kv_peak=_f32(0.0 if dec is None else float(np.max(np.asarray(dec.kv_peak)))),
                     gap_count=_gaps(dec, "gap_count"), gap_sum=_gaps(dec, "gap_sum"))
    duration = float(finish[keep].max() - arrival[keep].min())
    def busy(s) -> float:
        return 0.0 if s is None else float(np.mean(np.asarray(s.busy_time))) / duration

    # the report's busy share (energy) is the GPU-weighted mean of the two pools'
    share = (gp * busy(pre) + gd * busy(dec)) / (gp + gd)
    sched = eqx.tree_at(lambda s: s.busy_time, sched, _f32(share * duration))
    rep = report(sched, inp[keep], out[keep], dkv, 1, gp + gd, price_per_hour, power[0],
                 power[1])
    if not bool(rep.completed):
        raise RuntimeError("the disaggregated simulation did not finish (a bug: please report "
                           "it with the command)")
    return {"report": rep, "kv_transfer_s": float(np.mean(transfer[keep])),
            "prefill_busy": busy(pre), "decode_busy": busy(dec), "requests": int(len(keep)),
            "link": "NVLink" if same else "scale-out (RDMA)"}
