"""Gradient-based hardware co-design under area, power, perimeter and cost budgets.

Design space (continuous, the same for the gradient method and the grid):

- `area_mm2` in [AREA_MIN, min(area budget, RETICLE_MM2)]: logic-die area;
- `sram_frac` in [0, SRAM_MAX_FRAC]: share of the die area in SRAM (L2);
- `hbm_stacks` in [1, STACKS_MAX] (continuous relaxation of the stack count);
- `nvlink_lanes` in [4, LANES_MAX] (continuous relaxation of the lane count).

The compute area is what remains (`diffperf.design.generate`); the power budget is met by
construction for the compute datapath (the clock is lowered by DVFS when power binds), so the
explicit constraints are

    perimeter: shoreline(HBM PHYs + NVLink lanes) <= perimeter budget
    power:     HBM + NVLink + SRAM + leakage power <= 0.9 x power budget (compute keeps >= 10 %)
    cost:      yielded die + HBM + package + SerDes cost <= cost budget
    memory:    the workload's per-GPU memory <= HBM capacity
    compute:   compute area >= 10 % of the die area

Objective: the workload time (training step time or inference end-to-end latency) with the
parallel plan **fixed** (the plan is chosen once on the reference system and held; relaxing it
would make the objective piecewise, see `_sensitivity.best_training_plan`).

Gradient method: box constraints by projection (clipping in unit-box coordinates); the other
constraints by an exact (linear) + quadratic penalty on the normalised violation, tightened by
a `MARGIN` so that iterates converge from the feasible side; Adam (optax) from a few starts
vmapped together. The result is the best iterate that satisfies every budget exactly (each
iterate's value and constraints come from the same forward pass as its gradient, so they cost
nothing extra).
`whole_design` then finds the best buildable design near it: whole HBM stacks and NVLink lanes.

Evaluation count convention: one forward+gradient (`jax.value_and_grad`) = 1 evaluation; one
grid point = 1 evaluation (forward only). On this model a value_and_grad costs about 5-11
forward passes of wall time on a 2-core CPU (`measure_grad_cost`; noisy), so the saving in
compute is several times smaller than the saving in evaluations.
"""

from __future__ import annotations

import dataclasses
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..inference._infer import infer
from ..presets import model, resolve_efficiency, system
from ..specs._efficiency import Efficiency
from ..specs._hardware import System
from ..specs._runtime import Runtime
from ..specs._transformer import Transformer
from ..training._step import train_step
from . import _technology as T
from ._sensitivity import best_training_plan, default_inference_plan

AREA_MIN = 200.0
#: Largest die one lithography exposure can print: the 26 mm x 33 mm scanner field, mm^2. A
#: larger area budget still bounds the search at this size (bigger chips are several dies).
RETICLE_MM2 = 858.0
SRAM_MAX_FRAC = 0.3
STACKS_MAX = 12.0
LANES_MIN, LANES_MAX = 4.0, 72.0
MARGIN = 0.002
PENALTY = 50.0
CONSTRAINTS = ("perimeter", "power", "cost", "memory", "compute")


class Budgets(eqx.Module):
    """Budgets: `area_mm2` (max logic-die area), `power_w` (board), `perimeter_mm` (die edge for
    IO PHYs), `cost_usd` (die + HBM + package + SerDes)."""

    area_mm2: float
    power_w: float
    perimeter_mm: float
    cost_usd: float

    def __check_init__(self):
        for name in ("area_mm2", "power_w", "perimeter_mm", "cost_usd"):
            v = getattr(self, name)
            if not (np.isfinite(v) and v > 0):
                raise ValueError(f"Budgets.{name} must be a finite number > 0, got {v}")
        if self.area_mm2 <= AREA_MIN:
            raise ValueError(f"Budgets.area_mm2 must exceed {AREA_MIN:g} mm^2, got "
                             f"{self.area_mm2:g}")


class Problem(eqx.Module):
    """A co-design problem: technology point, architecture, budgets and a workload."""

    tech: T.TechParams
    arch: T.ArchParams
    budgets: Budgets = eqx.field(static=True)
    workload: str = eqx.field(static=True)
    model: Transformer
    plan: eqx.Module
    efficiency: Efficiency
    nvlink_domain: float = eqx.field(static=True, default=8.0)
    dies: float = eqx.field(static=True, default=1.0)
    runtime: Runtime | None = None  # the software runtime (None: the calibration set's)


def bounds(b: Budgets) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper bounds of (area_mm2, sram_frac, hbm_stacks, nvlink_lanes); the die area
    stops at the reticle limit whatever the budget."""
    return (np.array([AREA_MIN, 0.0, 1.0, LANES_MIN]),
            np.array([min(b.area_mm2, RETICLE_MM2), SRAM_MAX_FRAC, STACKS_MAX, LANES_MAX]))


def design_of(prob: Problem, x) -> T.Design:
    """The `Design` at natural coordinates x = (area_mm2, sram_frac, hbm_stacks, nvlink_lanes)."""
    b = prob.budgets
    return T.Design(area_mm2=x[0], sram_mm2=x[0] * x[1], hbm_stacks=x[2], nvlink_lanes=x[3],
                    power_w=b.power_w, perimeter_mm=b.perimeter_mm, dies=prob.dies,
                    nvlink_domain=prob.nvlink_domain)


def evaluate(prob: Problem, x) -> tuple[jax.Array, jax.Array]:
    """`(time_s, constraints)` at x; constraints are normalised (<= 0 is satisfied), in the
    order `CONSTRAINTS`."""
    b = prob.budgets
    g = T.generate(prob.tech, design_of(prob, x), prob.arch)
    system = System(g.accelerator, g.network)
    if prob.workload == "train":
        rep = train_step(prob.model, system, prob.plan, prob.efficiency, prob.runtime)
        t, mem = rep.step_time, rep.memory.total
    else:
        rep = infer(prob.model, system, prob.plan, prob.efficiency, prob.runtime)
        t, mem = rep.e2e_latency, rep.memory.total
    u = g.usage
    design_area = x[0] * (1.0 - T.OTHER_FRAC) - x[0] * x[1] - u.io_mm2
    cons = jnp.stack([
        u.shoreline_mm / b.perimeter_mm - 1.0,
        u.io_power_w / (0.9 * b.power_w) - 1.0,
        u.cost_usd / b.cost_usd - 1.0,
        mem / g.accelerator.hbm_capacity - 1.0,
        0.1 - design_area / x[0],
    ])
    return t, cons


def _to_x(prob: Problem, u):
    """Natural coordinates of the unit-box coordinates u in [0, 1]^4."""
    lo, hi = bounds(prob.budgets)
    return jnp.asarray(lo) + (jnp.asarray(hi) - jnp.asarray(lo)) * u


def _loss(prob: Problem, u):
    x = _to_x(prob, u)
    t, cons = evaluate(prob, x)
    v = jax.nn.relu(cons + MARGIN)
    return jnp.log(t) + PENALTY * jnp.sum(v + 10.0 * v * v), (t, cons, x)


def _seed_starts(prob: Problem, starts: int, points: int, seed: int) -> np.ndarray:
    """Unit-box coordinates of the `starts` fastest feasible designs among `points` uniformly
    random ones (fewer rows if fewer are feasible)."""
    lo, hi = bounds(prob.budgets)
    u = np.random.default_rng(seed + 1).uniform(size=(points, lo.size))
    return (_best_of(prob, lo + (hi - lo) * u, keep=starts)["best"] - lo) / (hi - lo)


def optimise(prob: Problem, steps: int = 100, starts: int = 4, lr: float = 0.03,
             seed: int = 0, start=None, seed_points: int = 256) -> dict:
    """Projected Adam (optax) on the penalised log time in unit-box coordinates (the box is
    enforced by clipping after every step), from `starts` starts vmapped in one scan; the
    learning rate decays by cosine to 10 %. The first start is the centre of the box, the last
    max(1, (starts - 1) // 2) the fastest feasible of `seed_points` random designs evaluated
    in one vmapped call (0: none), the rest random; with `start` (natural coordinates, clipped
    to the box) the first start is that design and the rest random. Penalties make the
    landscape multi-modal away from the default budgets and technology (at 1 nm, one start from
    the box centre ends 69 % slower than the grid's best).

    **Returns:** dict with `objective` (best feasible time, s), `x` (its design coordinates),
    `evaluations` (= steps * starts value_and_grad calls + the `seed_points` designs),
    `feasible`, `seconds`, `history` (best feasible time after each step)."""
    lo, hi = bounds(prob.budgets)
    rng = np.random.default_rng(seed)
    u0 = rng.uniform(0.2, 0.8, size=(starts, lo.size))
    u0[0] = 0.5
    seeded = 0
    t0 = time.perf_counter()
    if start is not None:
        u0[0] = np.clip((np.asarray(start, float) - lo) / (hi - lo), 0, 1)
    elif seed_points > 0 and starts > 1:  # the centre stays the first start
        best = _seed_starts(prob, max(1, (starts - 1) // 2), seed_points, seed)
        seeded = seed_points
        u0[starts - len(best):] = best  # the last starts; random ones stay in between
    u0 = jnp.asarray(u0)
    import optax  # here only: its import (0.1-0.2 s) is not for the other commands

    opt = optax.adam(optax.cosine_decay_schedule(lr, steps, alpha=0.1))
    vg = jax.value_and_grad(lambda u: _loss(prob, u), has_aux=True)

    @jax.jit
    def run(u0):
        state = jax.vmap(opt.init)(u0)

        def step(carry, _):
            u, s = carry
            (_, (t, cons, x)), grad = jax.vmap(vg)(u)
            grad = jnp.where(jnp.isfinite(grad), grad, 0.0)
            # optax's Adam mixes its int32 step count with Python floats: its internals follow
            # JAX's standard promotion even where a caller (the tests) asks for strict.
            with jax.numpy_dtype_promotion("standard"):
                upd, s = jax.vmap(opt.update)(grad, s)
            u = jnp.clip(optax.apply_updates(u, upd), 0.0, 1.0)
            return (u, s), (t, cons, x)
        _, hist = jax.lax.scan(step, (u0, state), None, length=steps)
        return hist

    t, cons, x = jax.device_get(run(u0))
    seconds = time.perf_counter() - t0
    ok = np.all(cons <= 0.0, axis=-1) & np.isfinite(t)
    tt = np.where(ok, t, np.inf)
    flat = int(np.argmin(tt))
    i, j = np.unravel_index(flat, tt.shape)
    history = np.minimum.accumulate(tt.min(axis=1))
    return {"objective": float(tt[i, j]), "x": np.asarray(x[i, j], float),
            "feasible": bool(np.isfinite(tt[i, j])), "evaluations": int(steps * starts) + seeded,
            "seconds": seconds, "history": history}


def grid_search(prob: Problem, points_per_axis=(24, 12, 23, 18), chunk: int = 8192,
                keep: int = 1) -> dict:
    """Dense grid over the same box (vmapped in chunks); best feasible time. `best`: the
    `keep` fastest feasible points, fastest first (natural coordinates)."""
    lo, hi = bounds(prob.budgets)
    axes = [np.linspace(a, b, n) for a, b, n in zip(lo, hi, points_per_axis)]
    mesh = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, lo.size)
    return _best_of(prob, mesh, chunk, keep)


def _best_of(prob: Problem, mesh: np.ndarray, chunk: int = 8192, keep: int = 1) -> dict:
    """The fastest feasible of the designs `mesh` (rows of natural coordinates), evaluated
    vmapped in chunks; dict like `grid_search`'s."""
    n = mesh.shape[0]
    chunk = min(chunk, n)
    pad = (-n) % chunk
    xs = np.concatenate([mesh, np.repeat(mesh[:1], pad, 0)]).reshape(-1, chunk, mesh.shape[1])

    @jax.jit
    def run(xs):
        def block(xb):
            t, cons = jax.vmap(lambda x: evaluate(prob, x))(xb)
            ok = jnp.all(cons <= 0.0, axis=-1) & jnp.isfinite(t)
            return jnp.where(ok, t, jnp.inf)
        return jax.lax.map(block, xs)

    t0 = time.perf_counter()
    t = np.asarray(jax.device_get(run(jnp.asarray(xs)))).reshape(-1)[:n]
    seconds = time.perf_counter() - t0
    i = int(np.argmin(t))
    order = np.argsort(t, kind="stable")[:keep]
    return {"objective": float(t[i]), "x": mesh[i], "feasible": bool(np.isfinite(t[i])),
            "evaluations": int(n), "seconds": seconds,
            "best": mesh[order[np.isfinite(t[order])]]}


def whole_design(prob: Problem, x, points_per_axis=(25, 13)) -> dict:
    """The best buildable design near the relaxed optimum x: whole HBM stacks and NVLink lanes
    (the two counts one below to one above x's, clipped to the box) on a grid of die area and
    SRAM share that includes x's own values, every point checked against every budget.

    **Returns:** dict like `grid_search`'s (`objective`, `x`, `feasible`, `evaluations`,
    `seconds`)."""
    lo, hi = bounds(prob.budgets)
    x = np.asarray(x, float)

    def whole(i):
        return [k for k in range(int(np.floor(x[i])) - 1, int(np.ceil(x[i])) + 2)
                if lo[i] <= k <= hi[i]]
    area = np.union1d(np.linspace(lo[0], hi[0], points_per_axis[0]), [x[0]])
    sram = np.union1d(np.linspace(lo[1], hi[1], points_per_axis[1]), [x[1]])
    mesh = np.stack(np.meshgrid(area, sram, whole(2), whole(3), indexing="ij"),
                    -1).reshape(-1, lo.size)

    @jax.jit
    def run(xs):
        t, cons = jax.vmap(lambda x: evaluate(prob, x))(xs)
        ok = jnp.all(cons <= 0.0, axis=-1) & jnp.isfinite(t)
        return jnp.where(ok, t, jnp.inf)

    t0 = time.perf_counter()
    t = np.asarray(jax.device_get(run(jnp.asarray(mesh))))
    i = int(np.argmin(t))
    return {"objective": float(t[i]), "x": mesh[i], "feasible": bool(np.isfinite(t[i])),
            "evaluations": int(mesh.shape[0]), "seconds": time.perf_counter() - t0}


#: Budget fields with their units, in the order `budget_margins` reports them.
BUDGET_UNITS = {"area_mm2": "mm^2", "power_w": "W", "perimeter_mm": "mm", "cost_usd": "$"}


def budget_margins(prob: Problem, x, rel: float = 0.05, steps: int = 100,
                   starts: int = 4) -> dict:
    """What each budget is worth at the design x: the workload re-optimised with that budget
    alone loosened by `rel` (e.g. 5 %), from the optimum under the original budgets and
    `starts - 1` other starts.

    That optimum is x re-optimised until one more round of the same search (from its result,
    as each loosened search starts) gains less than 0.1 % (at most three rounds), so a margin
    measures the budget, not unfinished search; `converged` says whether that held. A loosened
    budget never makes the optimum slower: the optimum stays feasible and is evaluated first.
    The die area stops at the reticle (`RETICLE_MM2`): only the usable part of a looser area
    budget counts, and at the limit the area is worth nothing more.

    **Returns:** dict with `base` (time at the optimum, s), `converged`, `rel` and, per budget
    field, `budget` (its loosened value), `usable` (the loosening that can be used, in the
    budget's unit), `time_s`, `change` (relative time change, <= 0), `elasticity`
    (d log time / d log budget over the usable loosening; 0 when none is usable) and
    `per_unit` (s per usable unit of budget, e.g. s per mm^2; 0 when none is usable)."""
    if not rel > 0:
        raise ValueError(f"rel must be > 0, got {rel}")
    base = optimise(prob, steps=steps, starts=starts, start=x)
    converged = False
    for _ in range(2):
        again = optimise(prob, steps=steps, starts=starts, start=base["x"])
        converged = again["objective"] >= base["objective"] * (1.0 - 1e-3)
        if again["objective"] < base["objective"]:
            base = again
        if converged:
            break
    t0 = base["objective"]
    out = {"base": t0, "converged": bool(converged), "rel": rel}
    for name in BUDGET_UNITS:
        value = getattr(prob.budgets, name)
        looser = dataclasses.replace(prob.budgets, **{name: value * (1.0 + rel)})
        usable, ratio = value * rel, 1.0 + rel
        if name == "area_mm2":  # the die cannot grow beyond the reticle
            old, new = min(value, RETICLE_MM2), min(value * (1.0 + rel), RETICLE_MM2)
            usable, ratio = new - old, new / old
        if usable <= 0:
            out[name] = {"budget": value * (1.0 + rel), "usable": 0.0, "time_s": t0,
                         "change": 0.0, "elasticity": 0.0, "per_unit": 0.0}
            continue
        r = optimise(dataclasses.replace(prob, budgets=looser), steps=steps, starts=starts,
                     start=base["x"])
        t = min(r["objective"], t0)  # the optimum itself is feasible under the looser budget
        out[name] = {"budget": value * (1.0 + rel), "usable": usable, "time_s": t,
                     "change": t / t0 - 1.0, "elasticity": float(np.log(t / t0) / np.log(ratio)),
                     "per_unit": (t - t0) / usable}
    return out


def measure_grad_cost(prob: Problem, repeats: int = 20) -> float:
    """Wall-time ratio value_and_grad / forward at one point (both jitted)."""
    z = jnp.full(4, 0.5)
    f = jax.jit(lambda z: _loss(prob, z)[0])
    g = jax.jit(jax.value_and_grad(lambda z: _loss(prob, z)[0]))
    jax.block_until_ready(f(z)), jax.block_until_ready(g(z))

    def clock(fn):
        t0 = time.perf_counter()
        for _ in range(repeats):
            jax.block_until_ready(fn(z))
        return (time.perf_counter() - t0) / repeats
    return clock(g) / clock(f)


def check_design(prob: Problem, x) -> dict:
    """Budgets used by design x (absolute numbers) and whether each is met."""
    b = prob.budgets
    x = jnp.asarray(x, dtype=jnp.result_type(float))
    g = T.generate(prob.tech, design_of(prob, x), prob.arch)
    t, cons = evaluate(prob, x)
    u = g.usage
    lo, hi = bounds(b)
    return {"time_s": float(t), "area_mm2": float(x[0]), "sram_mm2": float(x[0] * x[1]),
            "compute_mm2": float(u.compute_mm2), "hbm_stacks": float(x[2]),
            "nvlink_lanes": float(x[3]), "shoreline_mm": float(u.shoreline_mm),
            "power_w": float(u.power_w), "io_power_w": float(u.io_power_w),
            "freq_scale": float(u.freq_scale), "cost_usd": float(u.cost_usd),
            "flops_bf16": float(g.accelerator.flops_bf16),
            "hbm_bandwidth": float(g.accelerator.hbm_bandwidth),
            "hbm_capacity": float(g.accelerator.hbm_capacity),
            "nvlink_bandwidth": float(g.network.nvlink_bandwidth),
            "within_box": bool(np.all(np.asarray(x) >= lo - 1e-6) and
                               np.all(np.asarray(x) <= hi + 1e-6)),
            "constraints": {c: float(v) for c, v in zip(CONSTRAINTS, np.asarray(cons))},
            "feasible": bool(np.all(np.asarray(cons) <= 0.0) and float(u.power_w) <= b.power_w
                             and float(x[0]) <= b.area_mm2 + 1e-6)}


def default_problem(workload: str = "train", node_nm: float = 3.0, memory_index: float = 3.0,
                    network_index: float = 3.0, arch: str = "blackwell",
                    budgets: Budgets | None = None, model_name: str | None = None,
                    gpus: int = 1024, global_batch: int = 1536,
                    efficiency: Efficiency | None = None, runtime: Runtime | None = None,
                    plan_defaults: dict | None = None) -> Problem:
    """A ready problem: GPT-3 175B training on `gpus` GPUs (plan: the fastest candidate plan on
    DGX H100, bf16) or Llama-2 70B inference (tp 8, batch 1, 128/128), at a technology point.
    Default budgets: 814 mm^2, 700 W, 114 mm perimeter (a reticle-size square die), $4,000.
    `runtime` (default None: the calibration set's) and, for training, its `plan_defaults`
    (the plan fields the candidate plans do not vary) are those of the workload's software."""
    if workload not in ("train", "infer"):
        raise ValueError(f"workload must be 'train' or 'infer', got {workload!r}")
    eff = resolve_efficiency(efficiency)
    budgets = budgets or Budgets(area_mm2=814.0, power_w=700.0, perimeter_mm=114.0,
                                 cost_usd=4000.0)
    if workload == "train":
        mdl = model(model_name or "gpt3-175b")
        plan = best_training_plan(mdl, system("dgx-h100"), gpus, global_batch, "bf16", eff,
                                  runtime, plan_defaults)
    else:
        mdl = model(model_name or "llama2-70b")
        plan = default_inference_plan()
    return Problem(tech=T.technology(node_nm, memory_index, network_index),
                   arch=T.architecture(arch), budgets=budgets, workload=workload, model=mdl,
                   plan=plan, efficiency=eff, runtime=runtime)


def compare(prob: Problem, steps: int = 100, starts: int = 4,
            points_per_axis=(24, 12, 23, 18)) -> dict:
    """Gradient co-design vs dense grid on the same problem (see the module docstring for the
    evaluation convention)."""
    grad = optimise(prob, steps=steps, starts=starts)
    grid = grid_search(prob, points_per_axis)
    return {"gradient": grad, "grid": grid,
            "gap": grad["objective"] / grid["objective"] - 1.0,
            "evaluation_ratio": grid["evaluations"] / grad["evaluations"]}
