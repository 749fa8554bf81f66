"""Can a measurement have come from the configuration its benchmark row records?

A row's *ideal bound* is the model's prediction on ideal hardware: every efficiency 1 (tensor
cores, HBM, L2 and links at their datasheet peaks, no small-GEMM loss), no kernel launch,
kernel or collective overhead, and every overlappable transfer fully hidden. The same work
(the FLOPs and bytes the row's model, batch, precision and parallel plan imply) cannot run
faster than that, except by the slack of the model's smooth maxima (`SLACK`). A measured
time below bound / slack (a throughput above bound x slack) therefore means the recorded
configuration is not what ran: a different batch, precision or parallel plan, or a misprinted
value. Such rows are reported, not silently fitted: no efficiency factor can explain them.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .data import BenchmarkRow
from .efficiency import Efficiency
from .roofline import GEMM_SHARPNESS, SHARPNESS


def _slack(g: float = GEMM_SHARPNESS, k: float = SHARPNESS) -> float:
    """Largest factor by which the model's time can exceed the true maximum of its terms.

    A GEMM's time is smooth_max(smooth_max(compute, HBM, g), L2, k): at most (1 + g) x max
    for the inner one at a tie, and the outer one peaks when the L2 time ties the inner terms,
    at ((2 + g) + sqrt(g^2 + k^2 (2 + g)^2)) / 2 = 1.339 x max for g = 0.3, k = 0.1. A hidden
    transfer's exposed part (`exposed_after_overlap`) is smoothed by at most k / 2 of the
    transfer, which adds at most k / 2 of the true time."""
    return 0.5 * ((2.0 + g) + (g * g + k * k * (2.0 + g) ** 2) ** 0.5) + 0.5 * k


#: Largest factor by which the model's smooth maxima can exceed the true time (1.389).
SLACK = _slack()
#: Measured columns that are times (larger = slower); the others are rates.
TIME_COLUMNS = ("step_time_s", "e2e_latency_s", "ttft_s", "tpot_s")


def ideal_efficiency() -> Efficiency:
    """Every fraction of peak 1, every overhead 0, every overlap complete, no size losses."""
    return Efficiency(matmul_peak=1.0, matmul_size_scale=1e-6, matmul_lowp=1.0, attention=1.0,
                      vector=1.0, hbm=1.0, l2=1.0, nvlink=1.0, scaleout=1.0,
                      kernel_overhead=0.0, collective_overhead=0.0, tp_overlap=1.0,
                      dp_overlap=1.0, pp_overlap=1.0, cp_overlap=1.0, zero3_overlap=1.0,
                      per_head_attention=1.0, memory_reserve=0.0)


def _ideal_inputs(systems, n: int):
    """Stacked systems without kernel launch cost, and `n` stacked ideal efficiencies."""
    from .validate import stack
    systems = eqx.tree_at(lambda s: s.accelerator.launch_overhead, systems,
                          jnp.zeros_like(systems.accelerator.launch_overhead))
    return systems, stack([ideal_efficiency()] * n)


def ideal_bounds(rows: list[BenchmarkRow], stacked=None) -> dict[str, dict[str, float]]:
    """`{row id: {measured column: ideal-hardware prediction}}` for every row whose specs are
    valid (train and infer rows, one batched evaluation per kind). `stacked`: the rows'
    `(stacked_train_specs, stacked_infer_specs)`, if already built."""
    from .inference_validate import _infer_batch, stacked_infer_specs
    from .validate import _train_batch, causal_flops_convention, stacked_train_specs
    out: dict[str, dict[str, float]] = {}
    if stacked is None:
        stacked = (stacked_train_specs([r for r in rows if r.kind == "train"]),
                   stacked_infer_specs([r for r in rows if r.kind == "infer"]))
    train, infer = stacked
    if train.rows:
        systems, effs = _ideal_inputs(train.systems, len(train.rows))
        causal = jnp.asarray([causal_flops_convention(r) for r in train.rows])
        rep, mflops = jax.device_get(_train_batch(train.models, systems, train.plans, effs,
                                                  causal))
        for i, r in enumerate(train.rows):
            step, n = float(rep.step_time[i]), float(rep.num_gpus[i])
            out[r.id] = {"step_time_s": step,
                         "tokens_per_s_per_gpu": float(rep.tokens_per_s_per_gpu[i]),
                         "model_tflops_per_gpu": float(mflops[i]) / step / n / 1e12}
    if infer.rows:
        systems, effs = _ideal_inputs(infer.systems, len(infer.rows))
        rep = jax.device_get(_infer_batch(infer.models, systems, infer.plans, effs))
        for i, r in enumerate(infer.rows):
            out[r.id] = {"e2e_latency_s": float(rep.e2e_latency[i]),
                         "ttft_s": float(rep.ttft[i]), "tpot_s": float(rep.tpot[i]),
                         "output_tok_s_per_gpu": float(rep.output_tok_s_per_gpu[i])}
    return out


def implausible_measurements(rows: list[BenchmarkRow], stacked=None) -> list[dict]:
    """Measured values that beat their row's ideal bound by more than `SLACK` (`stacked`: as
    in `ideal_bounds`).

    **Returns:** `[{"id", "metric", "measured", "bound", "factor", "warning"}]`, where `factor`
    is how many times faster than the ideal bound the measurement is (> `SLACK`)."""
    bounds = ideal_bounds(rows, stacked)
    found = []
    for r in rows:
        for metric, measured in r.measured.items():
            bound = bounds.get(r.id, {}).get(metric)
            if bound is None or not np.isfinite(bound) or bound <= 0:
                continue
            factor = bound / measured if metric in TIME_COLUMNS else measured / bound
            if factor > SLACK:
                found.append({
                    "id": r.id, "metric": metric, "measured": measured, "bound": bound,
                    "factor": factor,
                    "warning": (f"{metric} {measured:.4g} is {factor:.2f}x beyond the ideal-"
                                f"hardware bound {bound:.4g} of the recorded configuration "
                                f"(100 % of every peak, no overheads): the run cannot have used "
                                f"this batch / precision / plan")})
    return found
