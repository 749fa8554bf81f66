"""Where a GPU generation's training speed-up comes from: Shapley attribution over hardware factors.

For a base system (e.g. DGX A100) and a target (DGX H100, DGX B200, GB200 NVL72) the speed-up of
one training step is decomposed over F factors:

- `precision`: the plan's GEMM precision (base bf16 -> the target's, e.g. fp8); its FLOP/s
  gain is the target's low-precision / bf16 ratio applied to whatever bf16 rate the coalition has
  (so it is separable from the `tensor_flops` factor);
- `tensor_flops`: bf16 / tf32 / vector FLOP/s, L2 capacity and bandwidth, SM count;
- `hbm_bandwidth`, `hbm_capacity`;
- `nvlink_bandwidth` (with the NVLink generation's hop latency and in-switch reduction),
  `nvlink_domain` (GPUs per NVLink domain);
- `scaleout_bandwidth` (InfiniBand per GPU);
- `best_plan`: re-optimising the parallel plan for the coalition's hardware. Without it the base
  system's best plan is kept (at the coalition's precision).

Each coalition S is the base system with the factors of S swapped to the target's values. All
2^F coalitions are evaluated in one jitted call: `vmap` over coalitions (systems stacked as
pytree leaves selected with `jnp.where`) of `vmap` over a candidate plan set (`candidate_plans`:
a reduced version of `diffperf.default_training_grid`, a few thousand plans), taking the fastest
feasible plan per coalition. The value of a coalition is v(S) = log(T_base / T_S), and the
Shapley value of factor i is

    phi_i = sum_{S not containing i} |S|! (F - |S| - 1)! / F! * (v(S + i) - v(S)),

so that sum_i phi_i = v(all) = log(total speed-up) exactly (efficiency axiom). Factors are
reported as multiplicative speed-ups exp(phi_i), whose product is the total speed-up.
"""

from __future__ import annotations

import itertools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..explore._grid import Grid
from ..explore._search_training import plan_from_values
from ..feasibility import VALID_OR_OUT_OF_HBM, describe_failure, even_layout
from ..inference._infer import infer
from ..presets import resolve_efficiency
from ..specs._efficiency import Efficiency
from ..specs._hardware import Accelerator, Network, System, precision_code
from ..specs._runtime import Runtime
from ..specs._transformer import Transformer
from ..training._step import train_step

FACTORS = ("precision", "tensor_flops", "hbm_bandwidth", "hbm_capacity", "nvlink_bandwidth",
           "nvlink_domain", "scaleout_bandwidth", "best_plan")

#: Accelerator / Network leaves carried by each hardware factor.
_ACC_FACTOR = {"flops_fp32": "tensor_flops", "flops_bf16": "tensor_flops",
               "vector_flops": "tensor_flops", "l2_capacity": "tensor_flops",
               "l2_bandwidth": "tensor_flops", "num_sms": "tensor_flops",
               "sfu_ratio": "tensor_flops",
               "hbm_bandwidth": "hbm_bandwidth", "hbm_capacity": "hbm_capacity",
               "host_time_factor": "host_cpu"}
# NVLink SHARP (in-switch reduction) and the hop latency come with the NVLink / NVSwitch
# generation: they are part of the "NVLink bandwidth" factor.
_NET_FACTOR = {"nvlink_domain": "nvlink_domain", "nvlink_bandwidth": "nvlink_bandwidth",
               "nvlink_sharp": "nvlink_bandwidth", "nvlink_latency": "nvlink_bandwidth",
               "scaleout_bandwidth": "scaleout_bandwidth"}


def candidate_plans(model: Transformer, gpus: int, global_batch: int) -> Grid:
    """The plan set searched per coalition: tp 1-8, pp 1-64 (powers of two), vp 1/2/3/4/6,
    micro-batch 1/2/4/8, recompute none / selective / full, ZeRO 1 with sequence parallelism,
    flash attention and both overlaps on (the choices that win for dense GPT training in the
    full search), cp = 1; for a MoE model also expert parallelism ep 1-64 (powers of two
    dividing the expert count). Precision is set per coalition; `candidate_step_time` keeps only
    even layouts (`diffperf.explore.even_layout`: pp * vp divides the layer count)."""
    layers = int(np.asarray(model.layers))
    experts = int(np.asarray(model.num_experts))
    pow2 = [p for p in (1, 2, 4, 8, 16, 32, 64) if gpus % p == 0]
    axes = {
        "tp": [t for t in pow2 if t <= 8],
        "pp": [p for p in pow2 if p <= layers],
        "vp": [v for v in (1, 2, 3, 4, 6) if layers % v == 0],
        "micro_batch": [b for b in (1, 2, 4, 8) if global_batch % b == 0],
        "recompute": [0, 1, 2],
    }
    if experts > 1:
        axes["ep"] = [e for e in pow2 if experts % e == 0]
    return Grid(axes)


def candidate_step_time(model: Transformer, system: System, values: dict, gpus, global_batch,
                        eff: Efficiency, runtime: Runtime | None = None,
                        plan_defaults: dict | None = None) -> jax.Array:
    """Step time of the candidate plan given by grid `values`, or inf when it is infeasible or
    its pipeline layout is uneven (`diffperf.explore.even_layout`), s. Works under jit / vmap.
    `runtime` and `plan_defaults` (a software runtime's: the plan fields `values` does not
    give) as in `diffperf.explore.search_training`."""
    plan = plan_from_values(values, gpus, global_batch, plan_defaults)
    r = train_step(model, system, plan, eff, runtime)
    ok = r.feasible & even_layout(model, plan) & jnp.isfinite(r.step_time)
    return jnp.where(ok, r.step_time, jnp.inf)


def _coalition_system(base: System, target: System, on: dict, prec_ratio) -> System:
    """Base system with the factors switched `on` (dict factor -> bool array) taken from target."""
    ab, at = base.accelerator, target.accelerator
    acc = {}
    for f in Accelerator.__dataclass_fields__:
        b, t = getattr(ab, f), getattr(at, f)
        factor = _ACC_FACTOR.get(f)
        # a factor this attribution does not vary (training has no host_cpu) keeps the base's
        acc[f] = jnp.where(on[factor], t, b) if factor in on else b
    # low-precision rate = target's (fp8/bf16 or fp4/bf16) ratio x the coalition's bf16 rate
    acc["flops_fp8"] = acc["flops_bf16"] * prec_ratio[0]
    acc["flops_fp4"] = acc["flops_bf16"] * prec_ratio[1]
    nb, nt = base.network, target.network
    net = {f: (jnp.where(on[_NET_FACTOR[f]], getattr(nt, f), getattr(nb, f))
               if f in _NET_FACTOR else getattr(nb, f)) for f in Network.__dataclass_fields__}
    return System(Accelerator(**acc), Network(**net))


def coalition_times(model: Transformer, base: System, target: System, gpus: int,
                    global_batch: int, target_precision: str = "fp8",
                    base_precision: str = "bf16", efficiency: Efficiency | None = None,
                    grid: Grid | None = None, runtime: Runtime | None = None,
                    plan_defaults: dict | None = None) -> dict:
    """Step time of every coalition (rows of a 2^F x F 0/1 mask, factor order `FACTORS`);
    `runtime` and `plan_defaults` as in `candidate_step_time` (one software runtime on every
    system).

    **Returns:** dict with `masks` (2^F, F), `step_time` (2^F,), `feasible` (2^F,),
    `plan_index` (flat index in `grid` of the plan used per coalition), `grid`, `base_plan`.
    """
    eff = resolve_efficiency(efficiency)
    grid = candidate_plans(model, gpus, global_batch) if grid is None else grid
    pb, pt = precision_code(base_precision), precision_code(target_precision)
    at = target.accelerator
    bf16_t = float(at.flops_bf16)
    ratio = jnp.asarray([float(at.flops_fp8) / bf16_t, float(at.flops_fp4) / bf16_t])
    if pt >= 2 and float(at.peak_flops(pt)) <= 0:
        raise ValueError(f"target GPU does not support {target_precision}")
    n_plans = grid.size
    flat = jnp.arange(n_plans)
    F = len(FACTORS)
    masks = np.array(list(itertools.product([0, 1], repeat=F)), dtype=bool)

    def times_for(mask, precision):
        on = {f: mask[i] for i, f in enumerate(FACTORS)}
        system = _coalition_system(base, target, on, ratio)
        values = grid.decode(flat)
        fixed = plan_defaults or {}  # a runtime's software defaults win over the study's
        dtype = values["tp"].dtype
        values = dict(values, precision=jnp.full((n_plans,), precision, dtype),
                      zero=jnp.full((n_plans,), fixed.get("zero", 1.0), dtype),
                      sequence_parallel=jnp.full((n_plans,), fixed.get("sequence_parallel", 1.0),
                                                 dtype))

        return jax.vmap(lambda v: candidate_step_time(model, system, v, gpus, global_batch,
                                                      eff, runtime, plan_defaults))(values)

    @jax.jit
    def run(masks_j):
        base_t = times_for(jnp.zeros(F, bool), float(pb))
        base_idx = jnp.argmin(base_t)

        def coalition(mask):
            prec = jnp.where(mask[0], float(pt), float(pb))
            t = times_for(mask, prec)
            best_idx = jnp.argmin(t)
            idx = jnp.where(mask[FACTORS.index("best_plan")], best_idx, base_idx)
            return t[idx], idx
        t, idx = jax.lax.map(coalition, masks_j)
        return t, idx, base_idx

    t, idx, base_idx = jax.device_get(run(jnp.asarray(masks)))
    return {"masks": masks, "step_time": np.asarray(t, float), "feasible": np.isfinite(t),
            "plan_index": np.asarray(idx), "grid": grid, "base_plan_index": int(base_idx)}


def shapley(masks: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Exact Shapley values from the value of every coalition (masks: (2^F, F) 0/1)."""
    masks = np.asarray(masks, bool)
    F = masks.shape[1]
    key = {tuple(m): v for m, v in zip(masks, value)}
    phi = np.zeros(F)
    for m, v in zip(masks, value):
        s = int(m.sum())
        for i in range(F):
            if m[i]:
                continue
            w = math.factorial(s) * math.factorial(F - s - 1) / math.factorial(F)
            with_i = list(m)
            with_i[i] = True
            phi[i] += w * (key[tuple(with_i)] - v)
    return phi


def _alone(masks: np.ndarray, times: np.ndarray, factors) -> dict:
    """Speed-up of each factor applied alone: time of the empty coalition / time of the
    coalition holding only that factor."""
    single = np.eye(len(factors), dtype=bool)
    return {f: float(times[0] / times[int(np.flatnonzero((masks == single[i]).all(1))[0])])
            for i, f in enumerate(factors)}


def attribute(model: Transformer, base: System, target: System, gpus: int, global_batch: int,
              target_precision: str = "fp8", base_precision: str = "bf16",
              efficiency: Efficiency | None = None, grid: Grid | None = None,
              runtime: Runtime | None = None, plan_defaults: dict | None = None) -> dict:
    """Shapley attribution of the training speed-up `base -> target` (see module docstring),
    with one software `runtime` (and its `plan_defaults`) on both systems (default: the
    calibration set's).

    **Returns:** dict with `speedup` (T_base / T_target, each on its best candidate plan),
    `log_speedup`, `factors` {name: {"shapley_log": phi, "speedup": exp(phi),
    "alone": speed-up of that factor alone}}, `base_step_time`, `target_step_time`, plans and
    the raw `coalitions`.
    """
    res = coalition_times(model, base, target, gpus, global_batch, target_precision,
                          base_precision, efficiency, grid, runtime, plan_defaults)
    t = res["step_time"]
    if not np.isfinite(t[0]):
        raise ValueError(f"no candidate plan is feasible on the base system for {gpus} GPUs "
                         f"and global batch {global_batch} (`diffperf search train --gpus "
                         f"{gpus} --global-batch {global_batch}` lists why plans fail)")
    with np.errstate(divide="ignore"):  # an infeasible coalition: log 0 = -inf, named below
        value = np.log(t[0] / np.where(np.isfinite(t), t, np.inf))
    if not np.all(np.isfinite(value)):
        bad = [" + ".join(f for f, on in zip(FACTORS, m) if on) for m in
               res["masks"][~np.isfinite(value)]][:3]
        raise ValueError(f"some coalitions have no feasible plan, e.g. {bad}: a coalition "
                         f"without best_plan keeps the base's plan, which the changed hardware "
                         f"may not fit (a target with less HBM than the base); attribution "
                         f"needs targets at least as large as the base")
    phi = shapley(res["masks"], value)
    alone = _alone(res["masks"], t, FACTORS)
    grid_ = res["grid"]
    names = grid_.names
    decode = lambda i: {k: int(v[0]) for k, v in grid_.decode_host(np.array([i])).items()}
    return {
        "speedup": float(t[0] / t[-1]), "log_speedup": float(value[-1]),
        "base_step_time": float(t[0]), "target_step_time": float(t[-1]),
        "base_plan": decode(res["base_plan_index"]), "target_plan": decode(res["plan_index"][-1]),
        "plan_axes": names, "candidates_per_coalition": int(grid_.size),
        "coalitions": len(t),
        "factors": {f: {"shapley_log": float(phi[i]), "speedup": float(np.exp(phi[i])),
                        "alone": alone[f]} for i, f in enumerate(FACTORS)},
        "raw": res,
    }


#: Factors of an inference speed-up (a fixed plan: no capacity, domain, scale-out or plan factor).
INFER_FACTORS = ("precision", "tensor_flops", "hbm_bandwidth", "nvlink_bandwidth", "host_cpu")


def attribute_inference(model: Transformer, base: System, target: System, plan,
                        target_precision: str = "fp8", base_precision: str = "bf16",
                        efficiency: Efficiency | None = None,
                        runtime: Runtime | None = None) -> dict:
    """Shapley attribution of the end-to-end latency speed-up of one inference `plan`
    (`InferencePlan`: tp, pp, batch, lengths) from `base` to `target` over `INFER_FACTORS`:
    `precision` (weights, GEMM inputs and KV cache base -> target precision, the low-precision
    rate being the target's ratio to bf16 times the coalition's bf16 rate, as in training),
    `tensor_flops` (with L2 and SM count), `hbm_bandwidth` and `nvlink_bandwidth` (with the NVLink
    generation's hop latency and in-switch reduction) and `host_cpu` (the host CPU's
    `Accelerator.host_time_factor`: Grace on GB200 / GB300 multiplies a serving runtime's host
    times; 1x with a runtime that has none, like the default). HBM capacity, the NVLink domain
    and the scale-out network stay the base's: they do not change the time of a plan that
    fits. All 32 coalitions in one jitted vmap, with one serving `runtime` (default: the
    calibration set's).

    **Returns:** dict with `speedup`, `log_speedup`, `base_e2e_s`, `target_e2e_s`, `base_tpot_s`,
    `target_tpot_s` and `factors` {name: {"shapley_log", "speedup", "alone"}}; ValueError if a
    coalition's plan is infeasible (other than by memory)."""

    eff = resolve_efficiency(efficiency)
    pb, pt = precision_code(base_precision), precision_code(target_precision)
    at = target.accelerator
    if pt >= 2 and float(at.peak_flops(pt)) <= 0:
        raise ValueError(f"target GPU does not support {target_precision}")
    ratio = jnp.asarray([float(at.flops_fp8), float(at.flops_fp4)]) / float(at.flops_bf16)
    F = len(INFER_FACTORS)
    masks = np.array(list(itertools.product([0, 1], repeat=F)), dtype=bool)
    fixed = {"hbm_capacity": False, "nvlink_domain": False, "scaleout_bandwidth": False}

    def one(mask):
        on = {**fixed, **{f: mask[i] for i, f in enumerate(INFER_FACTORS)}}
        code = jnp.where(mask[0], float(pt), float(pb))
        p = eqx.tree_at(lambda q: (q.weight_precision, q.activation_precision, q.kv_precision),
                        plan, (code, code, code))
        r = infer(model, _coalition_system(base, target, on, ratio), p, eff, runtime)
        return r.e2e_latency, r.tpot, r.reason

    e2e, tpot, reason = jax.device_get(jax.jit(jax.vmap(one))(jnp.asarray(masks)))
    bad = [i for i, r in enumerate(reason) if int(r) not in VALID_OR_OUT_OF_HBM]
    if bad:
        names = " + ".join(f for f, on in zip(INFER_FACTORS, masks[bad[0]]) if on)
        where = f"with the target's {names}" if names else "on the base system"
        raise ValueError(f"the plan is infeasible {where}: "
                         f"{describe_failure(int(reason[bad[0]]), model, plan)}")
    value = np.log(e2e[0] / e2e)
    phi = shapley(masks, value)
    alone = _alone(masks, e2e, INFER_FACTORS)
    return {"speedup": float(e2e[0] / e2e[-1]), "log_speedup": float(value[-1]),
            "base_e2e_s": float(e2e[0]), "target_e2e_s": float(e2e[-1]),
            "base_tpot_s": float(tpot[0]), "target_tpot_s": float(tpot[-1]),
            "coalitions": len(masks),
            "factors": {f: {"shapley_log": float(phi[i]), "speedup": float(np.exp(phi[i])),
                            "alone": alone[f]} for i, f in enumerate(INFER_FACTORS)}}


#: Published comparisons quoted beside the model's headline (vendor claims, not measurements).
CLAIMS = [
    ("Kundu et al. IISWC 2024 (arXiv:2407.14645)", "B200 vs A100, GPT-3 175B training, system "
     "at scale incl. lower precision and best plans", 35.0),
    ("NVIDIA Blackwell launch (GTC 2024)", "DGX B200 vs DGX H100, training ('3x training')", 3.0),
    ("NVIDIA GB200 NVL72 page", "GB200 NVL72 vs H100, GPT-MoE-1.8T training ('4x faster "
     "training', FP8)", 4.0),
]
