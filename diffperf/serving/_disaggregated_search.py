"""Disaggregated (xPyD) candidates for the SLO search: x prefill replicas of tp_p GPUs and y
decode replicas of tp_d GPUs with `max_num_seqs` request slots, every combination up to the
GPU limit, from one simulation per pool candidate.

The pools are decoupled (the aggregated search's random routing, applied to each pool):

1. Prefill candidate (tp_p, x): one replica sees the traffic's Poisson stream at rate / x (the
   arrival times scaled by x), each request producing its first token only (`simulate`,
   vmapped over the candidates). Per request: TTFT_i.
2. Decode candidate (tp_d, slots, y): one replica sees the requests with more than one output
   token as a Poisson stream at rate / y, arriving with their prompt in the KV cache
   (`simulate(..., prefilled=True)`). Per request: D_i, arrival at the pool to last token
   (its wait for a slot included). The decode pool's arrivals are taken as the traffic's own
   process: the prefill pool delays every request but, while it keeps up, passes the same
   rate on (a decoupling approximation; the chosen deployment is re-checked by the coupled
   simulation `serve_disaggregated`, see `slo_search`).
3. A pair (prefill, decode) on x tp_p + y tp_d GPUs: the KV transfer K_i of each prompt
   (`kv_transfer_time`: NVLink when both pools fit in one NVLink domain, else RDMA), and per
   request TTFT_i, TPOT_i = (K_i + D_i) / (output_i - 1), e2e_i = TTFT_i + K_i + D_i
   (TTFT_i for a one-token request), as `serve_disaggregated` defines them.
   Output tokens/s = sum(output) x min(x / T_p, y / T_d), T the simulated duration of each
   pool's replica (the slower pool sets the rate); energy from each pool's busy share (the
   linear utilisation model of `report`), cost from the price per GPU-hour.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..inference._iteration import iteration_cost
from ..specs._engine import Engine
from ._capacity import replica_kv_tokens
from ._disaggregated import kv_transfer_time
from ._simulate import Requests, reservation, simulate, step_bound

_STATS = ("mean", "p50", "p90", "p99")


def _stats(x: np.ndarray, axis: int = -1) -> dict[str, np.ndarray]:
    """mean and the 50th / 90th / 99th percentiles along `axis` (linear interpolation, as
    `report`'s percentiles)."""
    q = np.percentile(x, [50, 90, 99], axis=axis)
    return {"mean": np.mean(x, axis=axis), "p50": q[0], "p90": q[1], "p99": q[2]}


def _prefill_slots(engine: Engine, inp: np.ndarray) -> int:
    """Request slots that never bind in a prefill pool (one output token: a request leaves in
    the iteration its prompt completes, so at most budget / shortest prompt + 1 requests are
    ever in flight); at most the engine's `max_num_seqs`, a power of two, <= 256."""
    need = float(engine.max_num_batched_tokens) / max(float(np.min(inp)), 1.0) + 2.0
    slots = 1 << int(math.ceil(math.log2(max(need, 8.0))))
    return int(min(slots, float(engine.max_num_seqs), 256))


def _simulate_pool(model, system, plan, engine, eff, runtime, typical, tps, reps, seqs,
                   arrival, inp, out, slots, prefilled, chunk=64):
    """Simulate one replica of every pool candidate (tp, replicas, slots), vmapped `chunk`
    candidates at a time; returns numpy per-candidate fields: `first` / `finish` relative to
    each request's scaled arrival, `completed`, `duration`, `busy`, `fits` (every request's
    reservation fits the KV cache)."""
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    n = len(tps)
    eng_bound = eqx.tree_at(lambda e: e.max_num_seqs, engine, f32(max(seqs)))
    bound = step_bound(inp, eng_bound)

    def one(tp, r, s):
        p = eqx.tree_at(lambda q: (q.tp, q.batch, q.input_len, q.output_len), plan,
                        (tp, f32(1.0), f32(typical["input_len"]), f32(typical["output_len"])))
        eng = eqx.tree_at(lambda e: e.max_num_seqs, engine, s)
        cost = iteration_cost(model, system, p, eng.max_num_batched_tokens, eff, runtime,
                              eng.max_num_seqs)
        kv = replica_kv_tokens(model, system, p, eng, eff, s)
        req = Requests(f32(arrival) * r, f32(inp), f32(out))
        sched = simulate(cost, eng, kv, req, slots, bound, 0.0, prefilled=prefilled)
        fits = jnp.max(reservation(eng, f32(inp), f32(out))) <= kv
        start = jnp.min(sched.arrival)
        duration = jnp.maximum(jnp.max(sched.finish) - start, 1e-12)
        return (sched.ttft, sched.e2e, sched.completed, duration,
                jnp.clip(sched.busy_time / duration, 0.0, 1.0), fits)

    run = jax.jit(jax.vmap(one))
    cols = [np.asarray(a, np.float32) for a in (tps, reps, seqs)]
    size = min(chunk, n)
    parts = []
    for i in range(0, n, size):
        idx = np.minimum(np.arange(i, i + size), n - 1)  # the last chunk padded
        res = jax.device_get(run(*(f32(c[idx]) for c in cols)))
        parts.append([np.asarray(a)[: min(size, n - i)] for a in res])
    ttft, e2e, completed, duration, busy, fits = (np.concatenate(p) for p in zip(*parts))
    return {"ttft": ttft.astype(float), "e2e": e2e.astype(float), "completed": completed,
            "duration": duration.astype(float), "busy": busy.astype(float), "fits": fits}


def disaggregated_candidates(model, system, plan, engine: Engine, arrival, inp, out, tps,
                             replicas_options, seqs_options, max_gpus: int, eff, runtime,
                             price_per_hour: float = 0.0, power=(0.0, 0.0), log=None
                             ) -> list[dict]:
    """Every xPyD deployment of at most `max_gpus` GPUs (module docstring): one dict per
    (prefill tp, x, decode tp, slots, y) with the SLO search's fields (`mode`
    "disaggregated", `num_gpus`, latencies in ms at mean / p50 / p90 / p99, tokens/s, cost,
    energy, `fits`)."""
    inp, out, arrival = (np.asarray(a, float) for a in (inp, out, arrival))
    typical = dict(input_len=float(np.round(inp.mean())), output_len=float(np.round(out.mean())))
    pp = float(plan.pp)
    pre = [(tp, x) for tp in tps for x in replicas_options if (x * tp + min(tps)) * pp <= max_gpus]
    if not pre:
        return []
    budget = float(engine.max_num_batched_tokens)
    dec = [(tp, s, y) for tp in tps for s in seqs_options if s <= budget
           for y in replicas_options if (y * tp + min(tps)) * pp <= max_gpus]
    if log:
        log(f"disaggregated: simulating {len(pre)} prefill and {len(dec)} decode pool "
            f"candidates x {len(inp)} requests ...")
    slots_p = _prefill_slots(engine, inp)
    ones = np.ones_like(out)
    P = _simulate_pool(model, system, plan, engine, eff, runtime, typical,
                       [c[0] for c in pre], [c[1] for c in pre], [slots_p] * len(pre),
                       arrival, inp, ones, slots_p, prefilled=False)
    many = np.flatnonzero(out > 1)
    D = None
    dec_groups: dict[int, list[int]] = {}
    for k, c in enumerate(dec):
        dec_groups.setdefault(64 if c[1] <= 64 else max(seqs_options), []).append(k)
    if len(many):
        fields: dict[str, np.ndarray] = {}
        for slots, ks in sorted(dec_groups.items()):
            g = _simulate_pool(model, system, plan, engine, eff, runtime, typical,
                               [dec[k][0] for k in ks], [dec[k][2] for k in ks],
                               [dec[k][1] for k in ks], arrival[many], inp[many], out[many],
                               slots, prefilled=True)
            for name, a in g.items():
                fields.setdefault(name, np.zeros((len(dec),) + a.shape[1:], a.dtype))[ks] = a
        D = fields
    domain = float(system.network.nvlink_domain)
    tokens = float(out.sum())
    idle, peak = power
    rows = []
    transfers: dict[tuple, np.ndarray] = {}  # (prefill tp, decode tp, one NVLink domain) -> s

    def transfer(tpp, tpd, same) -> np.ndarray:
        if (tpp, tpd, same) not in transfers:
            pplan = eqx.tree_at(lambda q: q.tp, plan, jnp.asarray(tpp, jnp.float32))
            dplan = eqx.tree_at(lambda q: q.tp, plan, jnp.asarray(tpd, jnp.float32))
            transfers[tpp, tpd, same] = np.asarray(kv_transfer_time(
                model, system, pplan, dplan, jnp.asarray(inp, jnp.float32), same), float)
        return transfers[tpp, tpd, same]

    for i, (tpp, x) in enumerate(pre):
        gp = x * tpp * pp
        js = [j for j, (tpd, _, y) in enumerate(dec) if gp + y * tpd * pp <= max_gpus]
        if not js:
            continue
        gd = np.array([dec[j][2] * dec[j][0] * pp for j in js])
        same = gp + gd <= domain
        k = np.stack([transfer(tpp, dec[j][0], bool(sm)) for j, sm in zip(js, same)])  # [J, N]
        ttft = P["ttft"][i]  # [N]
        e2e = np.repeat(ttft[None, :], len(js), axis=0)
        ok = np.full(len(js), bool(P["completed"][i] >= 1.0) and bool(P["fits"][i]))
        rate = np.full(len(js), x / P["duration"][i])
        busy_d = np.zeros(len(js))
        if D is not None:  # every pair at once: [J, M] decode times of the decode candidates
            d = D["e2e"][js]
            e2e[:, many] = ttft[many] + k[:, many] + d
            p_stats = _stats((k[:, many] + d) / (out[many] - 1.0), axis=1)
            ok &= (D["completed"][js] >= 1.0) & D["fits"][js].astype(bool)
            rate = np.minimum(rate, np.array([dec[j][2] for j in js]) / D["duration"][js])
            busy_d = D["busy"][js]
        else:
            p_stats = {st: np.zeros(len(js)) for st in _STATS}
        t_stats, e_stats = _stats(ttft), _stats(e2e, axis=1)
        tok_s = tokens * rate
        watts = gp * (idle + (peak - idle) * float(P["busy"][i])) + \
            gd * (idle + (peak - idle) * busy_d)
        for a, j in enumerate(js):
            tpd, seqs, y = dec[j]
            row = {"mode": "disaggregated", "prefill_tp": tpp, "prefill_replicas": x,
                   "decode_tp": tpd, "decode_replicas": y, "max_num_seqs": seqs,
                   "tp": tpd, "replicas": x + y, "num_gpus": gp + float(gd[a]),
                   "fits": bool(ok[a]),
                   "link": "NVLink" if same[a] else "scale-out (RDMA)",
                   "kv_transfer_ms": round(1e3 * float(np.mean(k[a])), 3)}
            for st in _STATS:
                row[f"ttft_{st}_ms"] = round(1e3 * float(t_stats[st]), 3)
                row[f"tpot_{st}_ms"] = round(1e3 * float(p_stats[st][a]), 3)
                row[f"e2e_{st}_ms"] = round(1e3 * float(e_stats[st][a]), 3)
            gpus = gp + float(gd[a])
            row["output_tok_s"] = float(tok_s[a])
            row["output_tok_s_per_gpu"] = float(tok_s[a] / gpus)
            row["cost_per_million_tokens_usd"] = float(price_per_hour * gpus / 3600.0
                                                       / tok_s[a] * 1e6)
            row["energy_per_token_j"] = float(watts[a] / tok_s[a])
            rows.append(row)
    return rows
