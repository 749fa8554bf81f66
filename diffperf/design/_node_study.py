"""The technology-node study (Kundu et al. 2024, Sec. VI): one fixed H100-class design built at
every node from 12 nm to 1 nm, with logic, memory and network scaled alone or together, timed
on a training step and an inference run, with the binding resource at every point."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..explore._search_training import plan_from_values
from ..inference._infer import infer
from ..presets import model, resolve_efficiency
from ..specs._hardware import System
from ..training._step import train_step
from ._attribution import candidate_plans, candidate_step_time
from ._sensitivity import GROUPS, default_inference_plan
from ._technology import Design, _column, architecture, generate, node_names, tables, technology

#: What each scaling mode takes from the swept node (the rest stays at the 12 nm era baseline).
SCALINGS = {"logic": ("logic",), "memory": ("memory",), "network": ("network",),
            "full": ("logic", "memory", "network")}


def roadmap(node_nm) -> tuple[float, float]:
    """(memory_index, network_index) in production when `node_nm` is (matched by year, from the
    table's year columns; clamped at the newest generation)."""
    t = tables()
    years = _column(t["logic"]["rows"], "year")
    nodes = _column(t["logic"]["rows"], "node_nm")
    year = float(np.interp(-np.log(node_nm), -np.log(nodes), years))
    mem_years = _column(t["memory"]["rows"], "year")
    net_years = _column(t["network"]["rows"], "year")
    return (float(np.interp(year, mem_years, np.arange(len(mem_years)))),
            float(np.interp(year, net_years, np.arange(len(net_years)))))


def study_design() -> Design:
    """The fixed design of the node study: H100-class budgets (814 mm^2 die, 700 W, 114 mm
    perimeter, 6 HBM stacks, 36 NVLink lanes, 33 mm^2 of SRAM), 8-GPU NVLink domain."""
    return Design(area_mm2=814.0, sram_mm2=33.0, hbm_stacks=6.0, nvlink_lanes=36.0,
                  power_w=700.0, perimeter_mm=114.0, dies=1.0, nvlink_domain=8.0)


def node_study(nodes=None, arch: str = "hopper", train_model: str = "gpt3-175b",
               gpus: int = 1024, global_batch: int = 1536, infer_model="llama2-70b",
               efficiency=None, base_node: float = 12.0, infer_plan=None, runtime=None,
               plan_defaults: dict | None = None):
    """Training step time (best candidate plan per point, bf16) and inference latency
    (`infer_plan`, default tp 8, batch 1, 128 in / 128 out: TPOT and e2e) of `study_design()`
    across nodes, with logic-only,
    memory-only, network-only and full scaling from the `base_node` era; bottleneck shares
    (compute / memory / network / latency) from the elasticities at every point.

    `runtime` (a `Runtime`, default None: the calibration set's) runs both workloads;
    `plan_defaults` (its plan defaults) fix the training plan fields the candidates do not vary.

    **Returns:** a pandas DataFrame, one row per (scaling, node)."""
    import pandas as pd


    eff = resolve_efficiency(efficiency)
    nodes = node_names() if nodes is None else list(nodes)
    base_mem, base_net = roadmap(base_node)
    points = []
    for mode, parts in SCALINGS.items():
        for n in nodes:
            mem, net = roadmap(n)
            points.append((mode, n,
                           n if "logic" in parts else base_node,
                           mem if "memory" in parts else base_mem,
                           net if "network" in parts else base_net))
    coords = jnp.asarray([p[2:] for p in points], dtype=jnp.result_type(float))
    design, arch_p = study_design(), architecture(arch)

    def system_at(c):
        g = generate(technology(c[0], c[1], c[2]), design, arch_p)
        return System(g.accelerator, g.network)

    tm = model(train_model)
    im = model(infer_model) if isinstance(infer_model, str) else infer_model  # or a Transformer
    grid = candidate_plans(tm, gpus, global_batch)
    vals = {k: jnp.asarray(v) for k, v in grid.product(grid.names).items()}
    n_plans = grid.size
    fixed = plan_defaults or {}  # a runtime's software defaults win over the study's choice
    vals |= {"zero": jnp.full(n_plans, float(fixed.get("zero", 1.0))),
             "sequence_parallel": jnp.full(n_plans, float(fixed.get("sequence_parallel", 1.0))),
             "precision": jnp.ones(n_plans)}

    @jax.jit
    def best_plans(coords):
        def per_point(c):
            s = system_at(c)
            return jnp.argmin(jax.vmap(
                lambda v: candidate_step_time(tm, s, v, gpus, global_batch, eff, runtime,
                                              plan_defaults))(vals))
        return jax.lax.map(per_point, coords)

    idx = np.asarray(best_plans(coords))
    plan_vals = {k: jnp.asarray(np.asarray(v)[idx]) for k, v in vals.items()}
    iplan = default_inference_plan() if infer_plan is None else infer_plan

    def shares(grads, system, t):
        el = jax.tree.map(lambda g, x: g * x / t, grads, system)
        acc, net = el.accelerator, el.network
        comp = -sum(getattr(acc, f) for f in GROUPS["compute"])
        memb = -acc.hbm_bandwidth
        netw = -(net.nvlink_bandwidth + net.scaleout_bandwidth)
        return jnp.stack([comp, memb, netw, 1.0 - comp - memb - netw])

    @jax.jit
    def evaluate(coords, plan_vals):
        def per_point(c, v):
            s = system_at(c)
            plan = plan_from_values(v, gpus, global_batch, plan_defaults)
            ft = lambda sys_: train_step(tm, sys_, plan, eff, runtime).step_time
            fi = lambda sys_: infer(im, sys_, iplan, eff, runtime).e2e_latency
            t, gt = jax.value_and_grad(ft)(s)
            li, gi = jax.value_and_grad(fi)(s)
            rep = infer(im, s, iplan, eff, runtime)
            return (t, shares(gt, s, t), li, rep.tpot, shares(gi, s, li),
                    s.accelerator.flops_bf16, s.accelerator.hbm_bandwidth,
                    s.network.nvlink_bandwidth)
        return jax.vmap(per_point)(coords, plan_vals)

    t, st, li, tpot, si, fl, bw, nv = jax.device_get(evaluate(coords, plan_vals))
    rows = []
    names = ["compute", "memory", "network", "latency"]
    for k, p in enumerate(points):
        row = {"scaling": p[0], "node_nm": p[1], "memory_index": p[3], "network_index": p[4],
               "flops_bf16_tflops": fl[k] / 1e12, "hbm_tb_s": bw[k] / 1e12,
               "nvlink_gb_s": nv[k] / 1e9, "train_step_s": t[k]}
        row |= {f"train_{n}": st[k, j] for j, n in enumerate(names)}
        row |= {"infer_tpot_ms": tpot[k] * 1e3, "infer_e2e_s": li[k]}
        row |= {f"infer_{n}": si[k, j] for j, n in enumerate(names)}
        plan = {a: int(np.asarray(v)[idx[k]]) for a, v in vals.items() if a in grid.names}
        row["train_plan"] = "tp{tp} pp{pp} vp{vp} mb{micro_batch} rc{recompute}".format(**plan)
        rows.append(row)
    return pd.DataFrame(rows)
