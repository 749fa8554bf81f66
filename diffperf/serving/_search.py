"""Sizing for SLOs: which deployment (tensor parallelism, request slots, replicas) serves a
traffic within latency targets on the fewest GPUs.

Every candidate is simulated (`simulate`, vmapped over the candidates that share a slot
size): tp in 1, 2, 4, 8 (those the model and the NVLink domain allow), `max_num_seqs` in
`SEQS`, and replicas R in `REPLICAS` up to `max_gpus`. Each replica of R sees its share of the
traffic: an open loop's Poisson stream at rate / R (requests routed at random: the arrival
times of one stream scaled by R), or a closed loop's concurrency / R clients (rounded up).
Disaggregated deployments (`disaggregated=True`, open-loop traffic): every xPyD pair of a
prefill pool (tp, x replicas) and a decode pool (tp, slots, y replicas) within `max_gpus`,
each pool simulated once with the same random routing and the pairs combined per request
(`_disaggregated_search`).
A candidate meets the SLOs when every target holds and every request finished; the best is
the fewest GPUs, then the most output tokens/s per GPU. A disaggregated best is re-simulated
with its pools coupled (`serve_disaggregated`) and kept only if that meets the SLOs too.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..inference import infer
from ..inference._iteration import iteration_cost
from ..presets import resolve_efficiency
from ..specs._engine import Engine
from ..specs._runtime import Runtime
from ._capacity import replica_kv_tokens
from ._disaggregated import serve_disaggregated
from ._disaggregated_search import disaggregated_candidates
from ._report import report
from ._simulate import Requests, reservation, simulate, step_bound
from ._traffic import Traffic, requests

#: Metrics an SLO may bound, s: `ttft_p90` is the 90th percentile of the time to first token.
SLO_METRICS = tuple(f"{m}_{s}" for m in ("ttft", "tpot", "itl", "e2e")
                    for s in ("mean", "p50", "p90", "p99"))
TP_OPTIONS = (1, 2, 4, 8)
SEQS = (8, 16, 32, 64, 128, 256)
REPLICAS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def parse_slo(text: str) -> dict[str, float]:
    """`"ttft_p90=0.5,tpot_p90=0.05"` -> {metric: seconds}; one-line errors naming the item."""
    slo = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--slo item {item!r}: expected METRIC=SECONDS with METRIC one of "
                             f"{', '.join(SLO_METRICS)}")
        try:
            v = float(value)
        except ValueError:
            raise ValueError(f"--slo item {item!r}: {value!r} is not a number of seconds"
                             ) from None
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"--slo item {item!r}: the target must be > 0 s")
        slo[name] = v
    if not slo:
        raise ValueError("--slo: give at least one METRIC=SECONDS target")
    return slo


def _metric(rep, name: str):
    what, stat = name.split("_")
    return getattr(getattr(rep, what), stat)


def slo_search(model, system, plan, engine: Engine, traffic: Traffic, slo: dict,
               efficiency=None, runtime: Runtime | None = None, max_gpus: int = 64,
               price_per_hour: float = 0.0, power=(0.0, 0.0), log=None,
               disaggregated: bool = True) -> dict:
    """Simulate every candidate deployment and pick the fewest GPUs meeting `slo` (module
    docstring). `engine` gives the scheduler settings other than `max_num_seqs`; `plan`
    the precisions and ep. Returns a JSON-ready dict: `candidates` (each with tp,
    max_num_seqs, replicas, num_gpus, its metrics in ms and tokens/s, `meets`), `best` (or
    None) and `front` (the candidates no other beats on both TTFT p90 and tokens/s per GPU)."""
    if float(np.max(np.asarray(plan.attention_dp))) > 0:
        raise ValueError("plan.attention_dp: not supported by the SLO search yet (it splits "
                         "traffic per replica, not per attention rank)")
    if math.isinf(traffic.rate) and traffic.concurrency == 0:
        raise ValueError("--slo needs a finite --rate or a --concurrency: with every request "
                         "sent at once the latencies grow with the request count")
    eff = resolve_efficiency(efficiency)
    runtime = Runtime() if runtime is None else runtime
    arrival, inp, out = requests(traffic)
    typical = dict(input_len=float(np.round(inp.mean())), output_len=float(np.round(out.mean())))
    domain = float(system.network.nvlink_domain)
    tps = []
    for tp in TP_OPTIONS:
        if tp > domain or tp > max_gpus:
            continue
        p = eqx.tree_at(lambda q: (q.tp, q.batch, q.input_len, q.output_len), plan,
                        tuple(jnp.asarray(v, jnp.float32) for v in
                              (tp, 1.0, typical["input_len"], typical["output_len"])))
        r = infer(model, system, p, eff, runtime)
        if bool(r.feasible):
            tps.append(tp)
    if not tps:
        allowed = [tp for tp in TP_OPTIONS if tp <= min(domain, max_gpus)]
        raise ValueError(f"no tensor-parallel degree in {', '.join(map(str, allowed))} "
                         f"(at most --max-gpus {max_gpus} and the NVLink domain of "
                         f"{domain:g}) fits the model on this GPU")
    budget = float(engine.max_num_batched_tokens)
    cands = [(tp, s, r) for tp in tps for s in SEQS if s <= budget
             for r in REPLICAS if r * tp * float(plan.pp) <= max_gpus]
    bound = step_bound(inp, engine)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    results = []
    for slots in sorted({64 if s <= 64 else max(SEQS) for _, s, _ in cands}):
        group = [c for c in cands if (64 if c[1] <= 64 else max(SEQS)) == slots]
        tp, seqs, reps = (f32([c[i] for c in group]) for i in range(3))

        def one(tp, seqs, reps, slots=slots):
            p = eqx.tree_at(lambda q: (q.tp, q.input_len, q.output_len), plan,
                            (tp, f32(typical["input_len"]), f32(typical["output_len"])))
            eng = eqx.tree_at(lambda e: e.max_num_seqs, engine, seqs)
            cost = iteration_cost(model, system, p, eng.max_num_batched_tokens, eff, runtime,
                                  eng.max_num_seqs)
            kv = replica_kv_tokens(model, system, p, eng, eff, seqs)
            conc = jnp.where(traffic.concurrency > 0,
                             jnp.ceil(traffic.concurrency / reps), 0.0)
            req = Requests(f32(arrival) * reps, f32(inp), f32(out))
            sched = simulate(cost, eng, kv, req, slots, bound, conc)
            fits = jnp.max(reservation(eng, f32(inp), f32(out))) <= kv
            rep = report(sched, f32(inp), f32(out), kv, reps, tp * p.pp, price_per_hour,
                         power[0], power[1])
            return rep, fits

        if log:
            log(f"simulating {len(group)} deployments x {len(inp)} requests "
                f"({slots} request slots) ...")
        chunk = min(64, len(group))
        run = jax.jit(jax.vmap(one))  # one compilation per group: every chunk has `chunk` rows
        def pad(a, i, chunk=chunk):  # rows i .. i + chunk, the last repeated past the end
            return jnp.concatenate([a[i:i + chunk], jnp.repeat(a[-1:], max(i + chunk - len(a), 0))])
        for i in range(0, len(group), chunk):
            if log and i:
                log(f"  {i}/{len(group)} simulated")
            rep, fits = jax.device_get(run(pad(tp, i), pad(seqs, i), pad(reps, i)))
            for j, c in enumerate(group[i:i + chunk]):
                r = jax.tree.map(lambda a, j=j: a[j], rep)
                ok = bool(fits[j]) and float(r.completed) == 1.0
                row = {"tp": c[0], "max_num_seqs": c[1], "replicas": c[2],
                       "num_gpus": c[0] * c[2] * float(plan.pp), "fits": ok}
                for name in ("ttft_p90", "ttft_p99", "tpot_p90", "tpot_p99", "e2e_p90"):
                    row[name + "_ms"] = round(1e3 * float(_metric(r, name)), 3)
                for name in slo:
                    row[name + "_ms"] = round(1e3 * float(_metric(r, name)), 3)
                row["output_tok_s"] = float(r.output_tok_s)
                row["output_tok_s_per_gpu"] = float(r.output_tok_s_per_gpu)
                row["cost_per_million_tokens_usd"] = float(r.cost_per_million_tokens)
                row["energy_per_token_j"] = float(r.energy_per_token)
                row["meets"] = ok and all(float(_metric(r, k)) <= v for k, v in slo.items())
                results.append(row)
    for row in results:
        row["mode"] = "aggregated"
    note = None
    if disaggregated and traffic.concurrency == 0:
        dis = disaggregated_candidates(model, system, plan, engine, arrival, inp, out, tps,
                                       REPLICAS, SEQS, max_gpus, eff, runtime,
                                       price_per_hour, power, log)
        for row in dis:
            row["meets"] = row["fits"] and all(row[k + "_ms"] <= 1e3 * v
                                               for k, v in slo.items())
        results += dis
    elif disaggregated:
        note = "disaggregated deployments not searched: closed-loop traffic"
    best = _verified_best(results, model, system, plan, engine, traffic, slo, eff, runtime,
                          price_per_hour, power, log)
    fitting = [r for r in results if r["fits"]]
    front = [r for r in fitting if not any(
        o["ttft_p90_ms"] <= r["ttft_p90_ms"] and o["output_tok_s_per_gpu"]
        >= r["output_tok_s_per_gpu"] and o is not r and (
            o["ttft_p90_ms"] < r["ttft_p90_ms"]
            or o["output_tok_s_per_gpu"] > r["output_tok_s_per_gpu"]) for o in fitting)]
    return {"slo_s": slo, "candidates": results, "best": best, "note": note,
            "front": sorted(front, key=lambda r: r["ttft_p90_ms"]),
            "routing": "each replica: Poisson at rate / replicas (random routing)"
            if traffic.concurrency == 0 else "each replica: concurrency / replicas clients"}


#: Disaggregated candidates re-checked by the coupled simulation before one is chosen.
VERIFY = 5


def _verified_best(results, model, system, plan, engine, traffic, slo, eff, runtime,
                   price_per_hour, power, log):
    """The fewest GPUs meeting the SLOs (then the most tokens/s per GPU). A disaggregated
    candidate (simulated with decoupled pools) is re-simulated by `serve_disaggregated`
    (pools coupled, round-robin routing) and kept only if that meets the SLOs too; its
    coupled metrics are stored under `coupled`. After `VERIFY` rejected candidates the best
    aggregated one is taken."""
    meeting = sorted((r for r in results if r["meets"]),
                     key=lambda r: (r["num_gpus"], -r["output_tok_s_per_gpu"]))
    tried = 0
    for row in meeting:
        if row["mode"] == "aggregated":
            return row
        if tried == VERIFY:
            continue
        tried += 1
        pre = eqx.tree_at(lambda q: q.tp, plan, jnp.asarray(row["prefill_tp"], jnp.float32))
        dec = eqx.tree_at(lambda q: q.tp, plan, jnp.asarray(row["decode_tp"], jnp.float32))
        dec_engine = eqx.tree_at(lambda e: e.max_num_seqs, engine,
                                 jnp.asarray(row["max_num_seqs"], jnp.float32))
        if log:
            log(f"checking {row['prefill_replicas']:g}P{row['decode_replicas']:g}D "
                f"(tp {row['prefill_tp']:g} / {row['decode_tp']:g}, "
                f"{row['max_num_seqs']:g} slots) with the coupled simulation ...")
        rep = serve_disaggregated(model, system, pre, dec, engine, dec_engine, traffic,
                                  int(row["prefill_replicas"]), int(row["decode_replicas"]),
                                  eff, runtime, price_per_hour, power)["report"]
        coupled = {k + "_ms": round(1e3 * float(_metric(rep, k)), 3) for k in slo}
        coupled["output_tok_s"] = float(rep.output_tok_s)
        row["coupled"] = coupled
        row["verified"] = all(coupled[k + "_ms"] <= 1e3 * v for k, v in slo.items())
        if row["verified"]:
            return row
        row["meets"] = False
    return None
